"""The helm chart on the tier's real 1.20 API server: ``helm install`` of the tier's values
profile is accepted object by object (admission, RBAC escalation checks, the 1.20 APIs),
``helm upgrade`` with a changed quota changes the controller's settings and keeps the
generated secrets (read back from the live Secret with ``lookup``), ``helm rollback``
restores the quota, and ``helm uninstall`` leaves the generated Secret behind.

The platform's pods are pinned to a node label no node has, so they stay Pending here:
running the hub, the controller and the agents as pods needs the images' environments,
which the test kubelet does not provide (helm/images/README.md). ``--wait`` is not used.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..integration.harness import REPO
from .control_plane import Cluster, ControlPlane
from .tier import CLUSTER_A

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

CHART = REPO / "helm" / "gpufleet"
PROFILE = CHART / "examples" / "test-tier-1.20.yaml"
# A release of its own per run: its cluster-scoped objects (roles) are named after it.
RELEASE = f"gfchart{uuid.uuid4().hex[:6]}"
NOWHERE = {"gpufleet.io/chart-test": "no-node-has-this"}
SECRET_KEYS = {
    "cookie-secret",
    "proxy-token",
    "controller-token",
    "agent-token",
    "spawner-token",
    "snapshot-master-key",
}


def helm_binary() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    found = str(local) if local.is_file() else shutil.which("helm")
    if found is None:
        pytest.fail("helm is missing: run scripts/install --test, which puts it at .tools/bin/helm")
    return found


def overrides(namespace: str, guaranteed: int) -> dict[str, Any]:
    """The test's values over the tier profile: its own namespace and priority classes
    (cluster-scoped: other tests' gpufleet made theirs), pods kept off every node, and a
    project whose quota the upgrade changes."""
    return {
        "cluster": {"name": CLUSTER_A, "namespace": namespace},
        "priorityClasses": {
            "platform": {"name": f"{namespace}-platform"},
            "session": {"name": f"{namespace}-session"},
            "job": {"name": f"{namespace}-job"},
        },
        "hub": {"nodeSelector": NOWHERE},
        "proxy": {"nodeSelector": NOWHERE},
        "controller": {
            "nodeSelector": NOWHERE,
            "projects": [{"name": "vision", "quotas": {"A100-80GB": {"guaranteed": guaranteed}}}],
        },
        "agent": {"nodeSelector": NOWHERE},
    }


class Helm:
    def __init__(self, tier: ControlPlane, namespace: str, workdir: Path):
        self.binary = helm_binary()
        self.namespace = namespace
        self.workdir = workdir
        self.base = [
            f"--kubeconfig={tier.admin_kubeconfig}",
            f"--kube-context={CLUSTER_A}",
            f"--namespace={namespace}",
        ]

    def __call__(self, *args: str, guaranteed: int | None = None) -> str:
        values: list[str] = []
        if guaranteed is not None:
            extra = self.workdir / f"values-{guaranteed}.yaml"
            extra.write_text(yaml.safe_dump(overrides(self.namespace, guaranteed)))
            values = ["-f", str(PROFILE), "-f", str(extra)]
        done = subprocess.run(
            [self.binary, *args, *values, *self.base],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout


@pytest.fixture
def chart_namespace(k8s_tier: ControlPlane) -> Iterator[str]:
    namespace = f"chart-{uuid.uuid4().hex[:6]}"
    api = k8s_tier[CLUSTER_A].rest("admin")
    created = api.post(
        "/api/v1/namespaces", json={"metadata": {"name": namespace}, "apiVersion": "v1"}
    )
    assert created.status_code == 201, created.text
    try:
        yield namespace
    finally:
        api.delete(f"/api/v1/namespaces/{namespace}")
        for kind in ("clusterroles", "clusterrolebindings"):
            found = api.get(f"/apis/rbac.authorization.k8s.io/v1/{kind}").json()["items"]
            for item in found:
                if item["metadata"]["name"].startswith(RELEASE):
                    api.delete(
                        f"/apis/rbac.authorization.k8s.io/v1/{kind}/{item['metadata']['name']}"
                    )
        for suffix in ("platform", "session", "job"):
            api.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{namespace}-{suffix}")


def secret_data(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    found = cluster.rest("admin").get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
    assert found.status_code == 200, found.text
    return {k: base64.b64decode(v).decode("latin-1") for k, v in found.json()["data"].items()}


def vision_quota(cluster: Cluster, namespace: str) -> int:
    settings = secret_data(cluster, namespace, f"{RELEASE}-gpufleet-settings")
    controller = yaml.safe_load(settings["controller.yaml"])
    [vision] = [
        p for p in controller["traitlets"]["FleetController"]["projects"] if p["name"] == "vision"
    ]
    return int(vision["quotas"]["A100-80GB"]["guaranteed"])


def test_install_upgrade_and_rollback_on_a_real_api_server_keep_the_generated_secrets(
    k8s_tier: ControlPlane, chart_namespace: str, tmp_path: Path
) -> None:
    cluster = k8s_tier[CLUSTER_A]
    helm = Helm(k8s_tier, chart_namespace, tmp_path)
    helm("install", RELEASE, str(CHART), guaranteed=4)
    secret_name = f"{RELEASE}-gpufleet-secret"
    made = secret_data(cluster, chart_namespace, secret_name)
    assert set(made) == SECRET_KEYS and all(made.values())
    assert len(base64.b64decode(made["snapshot-master-key"])) == 32
    # What the 1.20 server took: the workloads, the budgets as policy/v1beta1, the roles.
    api = cluster.rest("admin")
    apps = f"/apis/apps/v1/namespaces/{chart_namespace}"
    deployments = {d["metadata"]["name"] for d in api.get(f"{apps}/deployments").json()["items"]}
    assert {f"{RELEASE}-gpufleet-{c}" for c in ("hub", "proxy", "controller")} <= deployments
    assert api.get(f"{apps}/daemonsets").json()["items"]
    budgets = api.get(f"/apis/policy/v1beta1/namespaces/{chart_namespace}/poddisruptionbudgets")
    assert budgets.json()["items"]
    policies = api.get(f"/apis/networking.k8s.io/v1/namespaces/{chart_namespace}/networkpolicies")
    assert policies.json()["items"]
    assert vision_quota(cluster, chart_namespace) == 4

    helm("upgrade", RELEASE, str(CHART), guaranteed=6)
    assert vision_quota(cluster, chart_namespace) == 6
    assert secret_data(cluster, chart_namespace, secret_name) == made  # read back, kept

    helm("rollback", RELEASE, "1")
    assert vision_quota(cluster, chart_namespace) == 4  # helm waits for the server's answer
    assert secret_data(cluster, chart_namespace, secret_name) == made
    history = yaml.safe_load(helm("history", RELEASE, "--output", "yaml"))
    assert [h["revision"] for h in history] == [1, 2, 3]

    helm("uninstall", RELEASE)
    # The generated secrets outlive the release: without the master key no snapshot reads.
    assert secret_data(cluster, chart_namespace, secret_name) == made
