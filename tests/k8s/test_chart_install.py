"""The helm chart installed on the tier's real 1.20 control plane, its platform running as
pods there: ``helm install --wait`` of the tier's values profile is accepted object by
object (admission, RBAC escalation checks, the 1.20 APIs) and returns once the hub, the
proxy, the controller and the node agent are Ready in pods of the tier's fake GPU nodes.
Through the hub's proxy the controller answers, a session spawns (KubeGPUSpawner in the
hub's pod, in-cluster credentials) and a job runs to its end, its output relayed by the
chart's node agent; ``helm upgrade`` with another guarantee restarts
the controller and keeps the session and the generated secrets (read back from the live
Secret with ``lookup``); ``helm rollback`` brings the guarantee back; ``helm uninstall``
leaves the generated Secret behind.

The test kubelets run the platform's images from the platform environment
(``scripts/build-session-env --platform``) and resolve the chart's Service names in each
pod's hosts file (``names``).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpufleet.client import Client
from gpufleet.snapshotter.sandbox import default_session_env

from ..integration.harness import REPO, wait_for
from ..ports import free_ports
from .control_plane import Cluster, ControlPlane
from .tier import CLUSTER_A

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

CHART = REPO / "helm" / "gpufleet"
PROFILE = CHART / "examples" / "test-tier-1.20.yaml"
# A release of its own per run: its cluster-scoped objects (roles) are named after it.
RELEASE = f"gfchart{uuid.uuid4().hex[:6]}"
GPU_NODE = "a-gpu-1"  # the release's only GPU node
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


def agent_values(tier: ControlPlane, workdir: Path) -> dict[str, Any]:
    """The node agent of the release's GPU node: its ports are free ones, its files the
    test's, and the output it relays its node's test kubelet's."""
    metrics, progress = free_ports(2)
    state = workdir / "agent-state"
    state.mkdir()
    kubelet = tier[CLUSTER_A].kubelets[GPU_NODE]
    return {
        "ports": {"metrics": metrics, "progress": progress},
        "stateHostPath": str(state),
        "podLogDir": str(kubelet.directory / "logs"),
    }


def release_values(namespace: str, guaranteed: int, agent: dict[str, Any]) -> dict[str, Any]:
    """The test's values over the tier profile: its own namespace and priority classes
    (cluster-scoped: other tests' gpufleet made theirs), one GPU node (the tier's nodes
    share this machine's network, where two agents would ask for one port), alice in
    project vision, whose guarantee the upgrade changes, and the node agent's ``agent``
    values."""
    return {
        "cluster": {
            "name": CLUSTER_A,
            "namespace": namespace,
            "gpuNodeSelector": {"kubernetes.io/hostname": GPU_NODE},
        },
        "priorityClasses": {
            "platform": {"name": f"{namespace}-platform"},
            "session": {"name": f"{namespace}-session"},
            "job": {"name": f"{namespace}-job"},
        },
        "hub": {"groups": {"vision": ["alice"]}},
        "controller": {
            "projects": [{"name": "vision", "quotas": {"A100-80GB": {"guaranteed": guaranteed}}}],
        },
        "agent": agent,
        # The sessions' image is the tier's base environment, at this checkout's own path.
        "jobs": {"python": str(Path(default_session_env()) / "bin" / "python")},
    }


class Helm:
    def __init__(
        self,
        tier: ControlPlane,
        namespace: str,
        workdir: Path,
    ):
        self.binary = helm_binary()
        self.tier = tier
        self.namespace = namespace
        self.workdir = workdir
        self.agent = agent_values(tier, workdir)
        self.base = [
            f"--kubeconfig={tier.admin_kubeconfig}",
            f"--kube-context={CLUSTER_A}",
            f"--namespace={namespace}",
        ]

    def __call__(self, *args: str, guaranteed: int | None = None) -> str:
        values: list[str] = []
        if guaranteed is not None:
            extra = self.workdir / f"values-{guaranteed}.yaml"
            extra.write_text(yaml.safe_dump(release_values(self.namespace, guaranteed, self.agent)))
            values = ["-f", str(PROFILE), "-f", str(extra)]
        done = subprocess.run(
            [self.binary, *args, *values, *self.base],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, (
            f"helm {' '.join(args)}: {done.stdout}{done.stderr}\n{self.report()}"
        )
        return done.stdout

    def report(self) -> str:
        """The release's pods as the tier has them, and the last output of each: what a
        failed ``--wait`` waited for."""
        cluster = self.tier[CLUSTER_A]
        lines = []
        for pod in pods_of(cluster, self.namespace, f"app.kubernetes.io/instance={RELEASE}"):
            name, node = pod["metadata"]["name"], pod["spec"].get("nodeName", "")
            statuses = pod["status"].get("containerStatuses") or []
            lines.append(f"pod {name} on {node or '(none)'}: {pod['status'].get('phase')}")
            lines += [f"  {c['name']}: ready={c['ready']} {c['state']}" for c in statuses]
            for c in statuses if node in cluster.kubelets else []:
                output = cluster.kubelets[node].logs(self.namespace, name, c["name"])
                lines += [f"    {line}" for line in output.splitlines()[-15:]]
        return "\n".join(lines)


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


def static_volumes(cluster: Cluster, namespace: str, root: Path) -> list[str]:
    """A hostPath PersistentVolume for each SQLite claim of the release (hub, controller),
    bound to it in advance, its directory the pods' account's; their names."""
    names = []
    with cluster.rest("admin") as api:
        for component in ("hub", "controller"):
            claim = f"{RELEASE}-gpufleet-{component}"
            directory = root / component
            directory.mkdir(mode=0o755)
            os.chown(directory, 1000, 1000)
            made = api.post(
                "/api/v1/persistentvolumes",
                json={
                    "apiVersion": "v1",
                    "kind": "PersistentVolume",
                    "metadata": {"name": f"{namespace}-{component}"},
                    "spec": {
                        "capacity": {"storage": "1Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": "gpufleet-tier",
                        "persistentVolumeReclaimPolicy": "Retain",
                        "claimRef": {"namespace": namespace, "name": claim},
                        "hostPath": {"path": str(directory), "type": "Directory"},
                    },
                },
            )
            assert made.status_code == 201, made.text
            names.append(made.json()["metadata"]["name"])
    return names


def pods_of(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    with cluster.rest("admin") as api:
        listed = api.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
        listed.raise_for_status()
        return list(listed.json()["items"])


def component_pod(cluster: Cluster, namespace: str, component: str) -> dict[str, Any]:
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    running = [
        p
        for p in pods_of(cluster, namespace, selector)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    assert len(running) == 1, [p["metadata"]["name"] for p in running]
    return running[0]


def component_log(tier: ControlPlane, namespace: str, component: str) -> str:
    """What the release's running pod of ``component`` wrote, for a failure's message."""
    pod = component_pod(tier[CLUSTER_A], namespace, component)
    kubelet = tier[CLUSTER_A].kubelets[pod["spec"]["nodeName"]]
    container = pod["spec"]["containers"][0]["name"]
    return kubelet.logs(namespace, pod["metadata"]["name"], container)[-6000:]


def guaranteed(hub: httpx.Client, controller: str) -> int | None:
    """vision's A100-80GB guarantee, as the controller behind the hub's proxy answers; None
    while none answers. The hub is Ready before it has given the proxy the controller's
    route (it retries the proxy's API until its name answers), and until then the hub
    answers the path with a redirect; a new controller's address reaches the proxy's hosts
    file a moment after it is Ready."""
    answer = hub.get(f"{controller}/projects")
    if answer.status_code != 200:
        return None
    [vision] = [p for p in answer.json()["items"] if p["name"] == "vision"]
    [quota] = [q for q in vision["quotas"] if q["gpu_type"] == "A100-80GB"]
    return int(quota["guaranteed"])


def alice_ready(hub: httpx.Client) -> bool:
    server = hub.get("/hub/api/users/alice").json()["servers"].get("") or {}
    return bool(server.get("ready"))


def test_the_installed_chart_runs_the_platform_a_session_and_a_job_through_upgrade_and_rollback(
    k8s_tier: ControlPlane, chart_namespace: str, tmp_path: Path
) -> None:
    cluster = k8s_tier[CLUSTER_A]
    settings = cluster.kubelet_settings
    assert settings is not None and settings.images, (
        "the platform's environment, which plays the chart's images, is not built: run "
        "scripts/install --k8s (scripts/build-session-env --platform)"
    )
    volumes = static_volumes(cluster, chart_namespace, tmp_path)
    helm = Helm(k8s_tier, chart_namespace, tmp_path)
    secret_name = f"{RELEASE}-gpufleet-secret"
    try:
        helm("install", RELEASE, str(CHART), "--wait", "--timeout", "4m", guaranteed=4)
        made = secret_data(cluster, chart_namespace, secret_name)
        assert set(made) == SECRET_KEYS and all(made.values())
        assert len(base64.b64decode(made["snapshot-master-key"])) == 32
        # What the 1.20 server took besides the workloads: budgets as policy/v1beta1.
        with cluster.rest("admin") as api:
            policy = f"/apis/policy/v1beta1/namespaces/{chart_namespace}/poddisruptionbudgets"
            assert api.get(policy).json()["items"]
            netpols = f"/apis/networking.k8s.io/v1/namespaces/{chart_namespace}/networkpolicies"
            assert api.get(netpols).json()["items"]
        proxy = component_pod(cluster, chart_namespace, "proxy")["status"]["podIP"]
        hub_url = f"http://{proxy}:8000"
        controller = f"{hub_url}/services/gpufleet/api/v1"
        with httpx.Client(base_url=hub_url, timeout=30) as hub:
            # alice's token, asked for with the shared password (the hub's own API).
            token = hub.post(
                "/hub/api/users/alice/tokens",
                json={"auth": {"username": "alice", "password": "tier-password"}},
            )
            assert token.status_code == 201, component_log(k8s_tier, chart_namespace, "hub")
            hub.headers["Authorization"] = f"token {token.json()['token']}"
            # The controller answers through the hub's proxy, with vision's guarantee.
            wait_for(lambda: guaranteed(hub, controller) == 4, 120, "the controller's answer")

            # A session: spawned by the hub's pod on a fake GPU node of the cluster.
            spawned = hub.post(
                "/hub/api/users/alice/server",
                json={"project": "vision", "gpu_type": "A100-80GB", "gpus": 1},
            )
            assert spawned.status_code in (201, 202), spawned.text
            wait_for(lambda: alice_ready(hub), 120, "alice's session ready")
            [session] = pods_of(cluster, chart_namespace, "gpufleet.io/user=alice")
            assert session["spec"]["nodeName"] == GPU_NODE
            assert hub.get("/user/alice/api/status").status_code == 200

            # A job, submitted with the SDK through the hub, runs to its end on the cluster.
            # Its output comes from the node agent of the chart's DaemonSet.
            with Client(controller, token.json()["token"]) as alice:
                job = alice.submit(
                    "print('trained')", project="vision", gpu_type="A100-80GB", gpus=1
                )
                ended = alice.wait(job.id, timeout=180)
                assert (ended.state, ended.outcome) == ("ended", "succeeded"), ended.reason
                assert [p.node for p in ended.pod_states] == [GPU_NODE]
                output = "the job's output through the node agent"
                try:
                    wait_for(lambda: "".join(alice.logs(job.id, rank=0)) == "trained\n", 30, output)
                except AssertionError as e:
                    raise AssertionError(f"{e}\n{helm.report()}") from e

            # An upgrade with another guarantee restarts the controller, not the session.
            helm("upgrade", RELEASE, str(CHART), "--wait", "--timeout", "4m", guaranteed=6)
            wait_for(lambda: guaranteed(hub, controller) == 6, 60, "the new guarantee")
            [kept] = pods_of(cluster, chart_namespace, "gpufleet.io/user=alice")
            assert kept["metadata"]["uid"] == session["metadata"]["uid"]
            assert alice_ready(hub) and hub.get("/user/alice/api/status").status_code == 200
            assert secret_data(cluster, chart_namespace, secret_name) == made  # read back

            helm("rollback", RELEASE, "1", "--wait", "--timeout", "4m")
            wait_for(lambda: guaranteed(hub, controller) == 4, 60, "the guarantee rolled back")
            assert alice_ready(hub)
        assert secret_data(cluster, chart_namespace, secret_name) == made
        history = yaml.safe_load(helm("history", RELEASE, "--output", "yaml"))
        assert [h["revision"] for h in history] == [1, 2, 3]
        helm("uninstall", RELEASE, "--wait")
        # The generated secrets outlive the release: without the master key no snapshot reads.
        assert secret_data(cluster, chart_namespace, secret_name) == made
    finally:
        with cluster.rest("admin") as api:
            for name in volumes:
                api.delete(f"/api/v1/persistentvolumes/{name}")
