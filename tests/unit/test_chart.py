"""The helm chart (helm/gpufleet), checked without a cluster: ``helm lint --strict``, every
example rendered and validated against the Kubernetes API's schemas (the oldest and the
newest that kubernetes-validate bundles), the values schema refusing what it must, the
settings the chart hands gpufleet being real options with values they take, the RBAC
being the test tier's grants, the NetworkPolicies keeping the metadata server out, the
remote-write configuration passing promtool, the generated secrets' read-back, and the
chart's copies of docs/monitoring being the same files.

helm comes from ``scripts/install --test`` (``.tools/bin/helm``) or PATH; without it every
test here fails saying so. What is not checked here: an install and an upgrade on a live
API server (the tier's), where ``lookup`` finds the Secret an earlier install made.
"""

from __future__ import annotations

import ast
import base64
import ipaddress
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from traitlets import HasTraits
from traitlets.config.loader import PyFileConfigLoader

from gpufleet.clusters.kube_config import ClusterSettings
from gpufleet.hub.kube_jobs import KubeJobs
from gpufleet.hub.notifier import Notifier
from gpufleet.spawner.kubernetes import KubeGPUSpawner

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gpufleet"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
TIER = CHART / "examples" / "test-tier-1.20.yaml"
MODERN = [e for e in EXAMPLES if e != TIER]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


OLDEST_K8S = min(kubernetes_validate.utils.all_versions(), key=_version_key)
NEWEST_K8S = kubernetes_validate.latest_version()
# The Prometheus operator's kinds are CRDs, no part of Kubernetes' API: kubernetes-validate
# bundles Kubernetes' own schemas only. Their content is checked below by what they carry.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
MONITORING_API = ["--api-versions", "monitoring.coreos.com/v1"]
# What a 1.20 API server serves of what the chart makes (the test tier's).
APIS_OF_1_20 = {
    "v1",
    "apps/v1",
    "rbac.authorization.k8s.io/v1",
    "networking.k8s.io/v1",
    "scheduling.k8s.io/v1",
    "policy/v1beta1",
}
METADATA_SERVER = "169.254.169.254/32"


@pytest.fixture(scope="module")
def helm() -> str:
    local = ROOT / ".tools" / "bin" / "helm"
    if local.is_file():
        return str(local)
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    pytest.fail("helm is missing: run scripts/install --test, which puts it at .tools/bin/helm")


def _run(helm: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def render(helm: str, *args: str | Path) -> list[dict[str, Any]]:
    """The objects ``helm template`` makes of the chart as release gpufleet in gpufleet."""
    done = _run(helm, "template", "gpufleet", CHART, "--namespace", "gpufleet", *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def values_args(example: Path | None) -> list[str]:
    return ["-f", str(example)] if example else []


def settings_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each component's settings (the config Secret's keys), decoded."""
    [secret] = [
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "gpufleet-settings"
    ]
    return {
        key.removesuffix(".yaml"): yaml.safe_load(base64.b64decode(value))
        for key, value in secret["data"].items()
    }


def validate(objects: list[dict[str, Any]], version: str) -> None:
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        where = f"{obj['kind']} {obj['metadata']['name']} against Kubernetes {version}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {list(e.path)}")


# ---------------------------------------------------------------- lint and the API's schemas


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda e: e.stem if e else "defaults")
def test_lint_strict(helm: str, example: Path | None) -> None:
    kube = ["--kube-version", "1.20.2"] if example == TIER else []
    done = _run(helm, "lint", "--strict", CHART, *values_args(example), *kube)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", [OLDEST_K8S, NEWEST_K8S])
@pytest.mark.parametrize("example", [None, *MODERN], ids=lambda e: e.stem if e else "defaults")
def test_rendered_objects_are_valid(helm: str, example: Path | None, version: str) -> None:
    objects = render(helm, *values_args(example), *MONITORING_API)
    assert objects
    validate(objects, version)


def test_test_tier_profile_uses_what_1_20_serves(helm: str) -> None:
    """Rendered for the tier's 1.20 API server: PodDisruptionBudgets from policy/v1beta1,
    every other API one 1.20 serves. kubernetes-validate bundles no 1.20 schema: the
    objects are validated against the oldest it has, the budgets as policy/v1, whose
    fields the chart uses (selector, maxUnavailable) are v1beta1's too."""
    objects = render(helm, "-f", TIER, "--kube-version", "1.20.2")
    assert {o["apiVersion"] for o in objects} <= APIS_OF_1_20
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert {b["apiVersion"] for b in budgets} == {"policy/v1beta1"}
    assert {b["metadata"]["name"] for b in budgets} == {
        "gpufleet-hub",
        "gpufleet-proxy",
        "gpufleet-controller",
    }
    for budget in budgets:
        assert set(budget["spec"]) == {"selector", "maxUnavailable"}
    as_v1 = [{**o, "apiVersion": "policy/v1"} if o in budgets else o for o in objects]
    validate(as_v1, OLDEST_K8S)


def test_pdb_api_follows_what_the_cluster_serves(helm: str) -> None:
    def apis(*args: str) -> set[str]:
        return {o["apiVersion"] for o in render(helm, *args) if o["kind"] == "PodDisruptionBudget"}

    assert apis() == {"policy/v1"}
    assert apis("--kube-version", "1.20.2") == {"policy/v1beta1"}
    # A live cluster's answer wins over the version.
    live = ["--api-versions", "policy/v1/PodDisruptionBudget"]
    assert apis("--kube-version", "1.20.2", *live) == {"policy/v1"}


# ---------------------------------------------------------------- the values schema


@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize(
    ("setting", "named"),
    [
        (["--set", "hub.bogus=1"], "bogus"),
        (["--set", "controller.db.bogus=1"], "bogus"),
        (
            ["--set", "remoteClusters[0].name=west", "--set", "remoteClusters[0].kubeconfig=x"],
            "kubeconfig",
        ),
        (["--set", "bogus=1"], "bogus"),
    ],
    ids=["hub", "nested", "list-item", "top"],
)
def test_schema_refuses_an_unknown_key(
    helm: str, command: str, setting: list[str], named: str
) -> None:
    args = ["gpufleet", CHART] if command == "template" else [CHART]
    done = _run(helm, command, *args, *setting)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert f"Additional property {named} is not allowed" in said, said


@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize(
    ("setting", "key", "expected"),
    [
        (["--set-string", "hub.pdb.maxUnavailable=one"], "hub.pdb.maxUnavailable", "integer"),
        (["--set", "controller.leaseSeconds=soon"], "controller.leaseSeconds", "number"),
        (["--set", "snapshots.enabled=maybe"], "snapshots.enabled", "boolean"),
        (["--set", "agent.nvml=sometimes"], "agent.nvml", "must be one of"),
    ],
    ids=["integer", "number", "boolean", "enum"],
)
def test_schema_refuses_a_wrong_type(
    helm: str, command: str, setting: list[str], key: str, expected: str
) -> None:
    args = ["gpufleet", CHART] if command == "template" else [CHART]
    done = _run(helm, command, *args, *setting)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert f"{key}:" in said and expected in said, said


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("controller.db.url=", "controller.db.url: give the PostgreSQL URL"),
        ("hub.db.url=", "hub.db.url: give the PostgreSQL URL"),
        ("snapshots.enabled=true", "snapshots.store: name the S3 store"),
    ],
)
def test_missing_values_are_named(helm: str, setting: str, said: str) -> None:
    done = _run(helm, "template", "gpufleet", CHART, "--set", setting)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr


def test_every_value_has_a_default_and_the_readme_lists_it() -> None:
    """values.yaml holds what the schema declares, and the README's table is the one
    helm/tools/values_table.py makes of both (run it after changing either)."""
    sys.path.insert(0, str(ROOT / "helm" / "tools"))
    try:
        import values_table
    finally:
        sys.path.pop(0)
    table = values_table.table()
    unset = [
        line.split("|")[1].strip()
        for line in table.splitlines()[2:]
        if "[]" not in line.split("|")[1] and line.split("|")[3].strip() == "—"
    ]
    assert not unset, f"values.yaml has no default for {unset}"
    readme = (CHART / "README.md").read_text()
    assert values_table.readme_with_table(readme) == readme, (
        "helm/gpufleet/README.md's values table is not current: run "
        ".venv/bin/python helm/tools/values_table.py"
    )


# ---------------------------------------------------------------- the settings gpufleet reads


def _configurables() -> dict[str, type[HasTraits]]:
    """Every class the chart's settings may name, by its config section."""
    from jupyterhub.app import JupyterHub
    from jupyterhub.auth import Authenticator
    from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
    from jupyterhub.proxy import ConfigurableHTTPProxy
    from jupyterhub.spawner import Spawner

    from gpufleet.agent.app import NodeAgent
    from gpufleet.hub.app import FleetController
    from gpufleet.hub.kube_drains import KubeDrains
    from gpufleet.snapshotter.settings import SnapshotSettings
    from gpufleet.spawner.kubernetes import KubeGPUSpawner

    classes: list[type[HasTraits]] = [
        JupyterHub,
        ConfigurableHTTPProxy,
        Spawner,
        Authenticator,
        SharedPasswordAuthenticator,
        KubeGPUSpawner,
        FleetController,
        *FleetController.classes,
        KubeDrains,
        NodeAgent,
        SnapshotSettings,
    ]
    return {cls.__name__: cls for cls in classes}


def _check_option(cls: type[HasTraits], name: str, value: Any) -> None:
    traits = cls.class_traits(config=True)
    assert name in traits, f"c.{cls.__name__}.{name} is no option of gpufleet or JupyterHub"
    # An instance whose __init__ did not run: its traits validate as the config loader's do.
    traits[name]._validate(cls.__new__(cls), value)


def _check_structured(section: str, options: dict[str, Any]) -> None:
    """Lists of dicts the options hold, through gpufleet's own parsers."""
    from gpufleet.clusters.kube_config import ClusterSettings
    from gpufleet.clusters.manifests import Volume
    from gpufleet.scheduler.model import project_tree

    for cluster in options.get("clusters", ()):
        ClusterSettings.model_validate(cluster)
    for key in ("session_volumes", "volumes"):
        for volume in options.get(key, ()):
            Volume(**volume)
    if section == "FleetController" and "projects" in options:
        project_tree(options["projects"])


@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda e: e.stem if e else "defaults")
def test_settings_are_real_options(helm: str, example: Path | None) -> None:
    classes = _configurables()
    for component, settings in settings_of(render(helm, *values_args(example))).items():
        assert settings["component"] == component
        for section, options in settings["traitlets"].items():
            assert section in classes, f"{component}: c.{section} is no class the chart knows"
            for name, value in options.items():
                _check_option(classes[section], name, value)
            _check_structured(section, options)


def _load_config(settings: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = tmp_path / f"{settings['component']}.yaml"
    path.write_text(yaml.safe_dump(settings))
    environment = {
        "GPUFLEET_CHART_SETTINGS": str(path),
        "GPUFLEET_DATA_DIR": str(tmp_path / "data"),
        "GPUFLEET_CONTROLLER_TOKEN": "controller-token",
        "GPUFLEET_AGENT_TOKEN": "agent-token",
        "GPUFLEET_SPAWNER_TOKEN": "spawner-token",
        "GPUFLEET_NODE_NAME": "gpu-node-7",
        "GPUFLEET_NODE_IP": "10.1.2.3",
        "GPUFLEET_ZONE": "us-east-1a",
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return PyFileConfigLoader("gpufleet_config.py", path=str(CHART / "files")).load_config()


def test_config_file_makes_the_hub_of_pods(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's config file: the hub's roles and services from gpufleet.hub.setup, the
    controller and the agents as external services with the chart's tokens."""
    settings = settings_of(render(helm, "-f", CHART / "examples" / "one-cluster.yaml"))
    c = _load_config(settings["hub"], tmp_path, monkeypatch)
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert services["gpufleet"]["url"] == "http://gpufleet-controller.gpufleet.svc:8003"
    assert {name: s["api_token"] for name, s in services.items()} == {
        "gpufleet": "controller-token",
        "gpufleet-agent": "agent-token",
        "gpufleet-spawner": "spawner-token",
    }
    assert not any("command" in s or "environment" in s for s in services.values())
    assert c.KubeGPUSpawner.controller_token == "spawner-token"
    assert c.JupyterHub.spawner_class == "gpufleet.spawner.kubernetes.KubeGPUSpawner"
    assert c.JupyterHub.hub_bind_url == "http://:8081"
    assert c.ConfigurableHTTPProxy.should_start is False
    assert c.JupyterHub.load_groups["vision"] == {"users": ["alice", "bob"]}
    assert c.JupyterHub.load_groups["gpufleet-admins"] == {"users": ["admin"]}
    assert c.SharedPasswordAuthenticator.user_password == "change-this-password"
    assert any(role["name"] == "gpufleet-controller" for role in c.JupyterHub.load_roles)
    # Who may log in: the projects' members and the admins (JupyterHub's default: nobody).
    assert _allowed(c) == {"alice", "bob", "carol", "admin"}


def test_the_hub_allows_the_members_besides_those_its_config_allows(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = tmp_path / "allowed.yaml"
    extra.write_text(
        yaml.safe_dump({"hub": {"config": {"Authenticator": {"allowed_users": ["eve"]}}}})
    )
    example = CHART / "examples" / "one-cluster.yaml"
    settings = settings_of(render(helm, "-f", example, "-f", extra))
    c = _load_config(settings["hub"], tmp_path, monkeypatch)
    assert _allowed(c) == {"alice", "bob", "carol", "admin", "eve"}


def _allowed(c: Any) -> set[str]:
    """The users the hub's Authenticator lets in, as JupyterHub applies the config."""
    allowed = c.Authenticator.allowed_users
    return set(allowed.get_value(set()) if hasattr(allowed, "get_value") else allowed)


def test_config_file_makes_the_controller_and_the_agent(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_of(render(helm, "-f", CHART / "examples" / "aws-irsa-amp.yaml"))
    c = _load_config(settings["controller"], tmp_path, monkeypatch)
    assert c.FleetController.db_password_file == "/run/gpufleet/secrets/db-password"
    assert c.SnapshotSettings.store == "s3://example-gpufleet/snapshots"
    assert c.KubeJobs.progress_url == "http://$(GPUFLEET_HOST_IP):9207/progress"
    assert c.KubeJobs.python == "/opt/session/bin/python"  # the session image's
    assert "JupyterHub" not in c  # the hub's part is the hub's alone
    agent = _load_config(settings["agent"], tmp_path, monkeypatch)
    assert agent.NodeAgent.node_name == "gpu-node-7"
    assert agent.NodeAgent.progress_ip == agent.NodeAgent.metrics_ip == "10.1.2.3"
    assert agent.NodeAgent.zone == "us-east-1a"
    assert agent.SnapshotSettings.key_file == "/etc/gpufleet/secrets/snapshot-master-key"


@pytest.mark.parametrize("example", ["one-cluster.yaml", "several-clusters.yaml"])
def test_the_peers_the_chart_gives_make_every_cluster_s_pod_policies(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example: str
) -> None:
    """In pods the hub and the controller are Service names, which no NetworkPolicy can
    name: the chart's peers stand for them, for the job pods of every cluster and for the
    sessions, and the controller starts with them."""
    objects = render(helm, "-f", CHART / "examples" / example)
    settings = settings_of(objects)
    c = _load_config(settings["controller"], tmp_path, monkeypatch)
    # Every cluster reached as the pod's own (the others' kubeconfig Secrets are not here).
    entries = [
        {**entry, "kubeconfig": None, "in_cluster": True} for entry in c.FleetController.clusters
    ]
    clusters = [ClusterSettings.model_validate(entry) for entry in entries]
    [deployment] = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-controller")
    ]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    jobs = KubeJobs(
        clusters,
        store=None,  # type: ignore[arg-type]  # nothing here reaches the store
        now=lambda: datetime.now(UTC),
        kick=lambda: None,
        notifier=Notifier(),
        hub_url=env["JUPYTERHUB_API_URL"],
        controller_url=c.FleetController.service_url,
        config=c,
    )
    for manager in jobs.managers.values():
        assert manager.settings.hub.peer.pod_labels or manager.settings.hub.peer.cidr
    hub = _load_config(settings["hub"], tmp_path, monkeypatch)
    hub.KubeGPUSpawner.clusters = entries
    for name in (cluster.name for cluster in clusters):
        spawner = KubeGPUSpawner(
            config=hub,
            user=SimpleNamespace(name="alice", id=7, url="/user/alice/"),
            hub=SimpleNamespace(
                api_url=f"{hub.JupyterHub.hub_connect_url}/hub/api",
                url="/hub/",
                base_url="/",
                public_host="",
            ),
        )
        spawner.load_state(
            {
                "gpufleet_workload_id": 42,
                "gpufleet_gpu_uuids": [f"k8s/{name}/n-1/0"],
                "gpufleet_node": "n-1",
                "gpufleet_marker": "m",
                "gpufleet_cluster": name,
            }
        )
        spawner.user_options = {"project": "vision", "gpu_type": "A100-80GB", "gpus": 1}
        spawner._uid, spawner._gid = 200_001, 200_001
        policy = spawner.network_policy()
        assert policy["spec"]["egress"], name


# ---------------------------------------------------------------- RBAC and NetworkPolicies


def _tier_grants() -> dict[str, Any]:
    """The grants of the test tier's identities (tests/k8s/control_plane.py), read from its
    source: its tests check that gpufleet needs no more."""
    tree = ast.parse((ROOT / "tests" / "k8s" / "control_plane.py").read_text())
    grants = {}
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id.endswith("_RULES")
            and node.value is not None
        ):
            grants[node.target.id] = ast.literal_eval(node.value)
    return grants


def _rules(rules: list[dict[str, Any]]) -> set[tuple[tuple[str, ...], ...]]:
    return {
        (tuple(r["apiGroups"]), tuple(sorted(r["resources"])), tuple(sorted(r["verbs"])))
        for r in rules
    }


def test_rbac_is_what_the_tier_grants(helm: str) -> None:
    objects = render(helm, "--set", "controller.recycleAction=delete-node")
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"].endswith("Role")}
    grants = _tier_grants()
    cluster_role = roles["ClusterRole", "gpufleet-controller"]
    assert _rules(cluster_role["rules"]) == _rules(grants["CONTROLLER_RULES"])
    namespaced = roles["Role", "gpufleet-controller"]
    assert _rules(namespaced["rules"]) == _rules(grants["CONTROLLER_NAMESPACE_RULES"])
    assert _rules(roles["Role", "gpufleet-hub"]["rules"]) == _rules(grants["SPAWNER_RULES"])
    assert {name for kind, name in roles if kind == "ClusterRole"} == {"gpufleet-controller"}
    # Without node recycling by deletion, no right to delete a Node.
    plain = render(helm)
    [role] = [o for o in plain if o["kind"] == "ClusterRole"]
    assert "delete" not in next(r for r in role["rules"] if r["resources"] == ["nodes"])["verbs"]


def _pods(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objects:
        if o["kind"] in ("Deployment", "DaemonSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def test_pods_run_locked_down_and_the_agent_alone_as_root(helm: str) -> None:
    objects = render(helm, "-f", CHART / "examples" / "aws-irsa-amp.yaml")
    for name, pod in _pods(objects):
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
        if name == "gpufleet-agent":
            assert pod["containers"][0]["securityContext"]["runAsUser"] == 0
            assert pod["hostPID"] and pod["hostNetwork"]
            assert pod["automountServiceAccountToken"] is False
        else:
            assert pod["securityContext"]["runAsNonRoot"] is True, name
        if name in ("gpufleet-proxy", "gpufleet-agent"):
            assert pod["automountServiceAccountToken"] is False


def _ip_blocks(policy: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for rule in policy["spec"].get("egress", []):
        for peer in rule.get("to", []):
            if "ipBlock" in peer:
                yield peer["ipBlock"]


def _covers_metadata_server(cidr: str) -> bool:
    network = ipaddress.ip_network(cidr)
    return network.version == 4 and ipaddress.ip_address("169.254.169.254") in network


@pytest.mark.parametrize("example", MODERN, ids=lambda e: e.stem)
def test_no_pod_of_gpufleet_reaches_the_metadata_server(helm: str, example: Path) -> None:
    """Neither the chart's policies nor the job policy's egress the chart sets
    (c.KubeJobs.network_egress) let a pod reach 169.254.169.254."""
    objects = render(helm, "-f", example)
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for block in _ip_blocks(policy):
            if _covers_metadata_server(block["cidr"]):
                assert METADATA_SERVER in block.get("except", []), policy["metadata"]["name"]
    controller = settings_of(objects).get("controller")  # none in a member cluster
    egress = controller["traitlets"]["KubeJobs"]["network_egress"] if controller else []
    for peer in egress:
        if "cidr" in peer and _covers_metadata_server(peer["cidr"]):
            assert METADATA_SERVER in peer["except_cidrs"]


def test_network_policies_let_in_whom_each_platform_pod_serves(helm: str) -> None:
    objects = render(helm, "-f", CHART / "examples" / "aws-irsa-amp.yaml")
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    gpufleet_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/managed-by": "gpufleet"}}}
    assert gpufleet_pods in policies["gpufleet-hub"]["ingress"][0]["from"]
    assert gpufleet_pods in policies["gpufleet-controller"]["ingress"][0]["from"]
    assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in policies["gpufleet-controller"]["ingress"][0][
        "from"
    ], "the node agents (host network) reach the controller"
    proxy_api = policies["gpufleet-proxy"]["ingress"][1]
    assert proxy_api["ports"] == [{"port": 8001}] and len(proxy_api["from"]) == 1
    # Sessions get S3 besides what their own policies allow; the chart's policies select no
    # session or job pod for ingress: those are gpufleet's own.
    s3 = policies["gpufleet-sessions-s3"]
    assert s3["policyTypes"] == ["Egress"]
    assert s3["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "session"
    for name, spec in policies.items():
        if "Ingress" in spec["policyTypes"]:
            labels = spec["podSelector"]["matchLabels"]
            assert labels.get("app.kubernetes.io/managed-by") != "gpufleet", name


# ---------------------------------------------------------------- monitoring


@pytest.mark.parametrize("name", ["gpufleet-rules.yml", "gpufleet-dashboard.json"])
def test_monitoring_files_are_the_docs_own(name: str) -> None:
    """helm reads no file outside the chart, so it carries copies of docs/monitoring/'s:
    a change to one without the other fails here (copy the docs' over the chart's)."""
    docs = (ROOT / "docs" / "monitoring" / name).read_bytes()
    assert (CHART / "files" / name).read_bytes() == docs, (
        f"helm/gpufleet/files/{name} differs from docs/monitoring/{name}: "
        f"cp docs/monitoring/{name} helm/gpufleet/files/"
    )


def test_monitoring_objects_need_the_operators_crds(helm: str) -> None:
    example = CHART / "examples" / "one-cluster.yaml"
    kinds = {o["kind"] for o in render(helm, "-f", example)}
    assert not kinds & CRD_KINDS  # no CRDs, no objects: the install would fail on them
    objects = render(helm, "-f", example, *MONITORING_API)
    by_kind = {o["kind"]: o for o in objects}
    assert set(by_kind) >= CRD_KINDS
    for kind in CRD_KINDS:
        assert by_kind[kind]["metadata"]["labels"]["release"] == "kps", kind
    endpoint = by_kind["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["path"] == "/services/gpufleet/metrics"
    rules = yaml.safe_load((CHART / "files" / "gpufleet-rules.yml").read_text())
    assert by_kind["PrometheusRule"]["spec"] == rules
    [dashboard] = [o for o in objects if o["metadata"]["name"] == "gpufleet-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    carried = (CHART / "files" / "gpufleet-dashboard.json").read_text()
    assert json.loads(dashboard["data"]["gpufleet-dashboard.json"]) == json.loads(carried)
    # Off by default, even where the CRDs exist.
    assert not {o["kind"] for o in render(helm, *MONITORING_API)} & CRD_KINDS


def test_remote_write_configuration_passes_promtool(helm: str, tmp_path: Path) -> None:
    """The agent-mode Prometheus's configuration, with SigV4 for Amazon Managed Service
    for Prometheus, is one Prometheus takes (promtool: scripts/install --test)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: run scripts/install --test")
    objects = render(helm, "-f", CHART / "examples" / "aws-irsa-amp.yaml")
    [config_map] = [
        o
        for o in objects
        if o["metadata"]["name"] == "gpufleet-prometheus" and o["kind"] == "ConfigMap"
    ]
    config = yaml.safe_load(config_map["data"]["prometheus.yml"])
    [write] = config["remote_write"]
    assert write["sigv4"] == {"region": "us-east-1"}
    assert write["queue_config"] == {
        "capacity": 2500,
        "max_shards": 200,
        "max_samples_per_send": 1000,
    }
    assert {job["job_name"] for job in config["scrape_configs"]} == {
        "gpufleet-controller",
        "gpufleet-agent",
    }
    [agents] = [job for job in config["scrape_configs"] if job["job_name"] == "gpufleet-agent"]
    assert agents["kubernetes_sd_configs"] == [
        {
            "role": "pod",
            "namespaces": {"names": ["gpufleet"]},
            "selectors": [
                {
                    "role": "pod",
                    "label": "app.kubernetes.io/instance=gpufleet,"
                    "app.kubernetes.io/component=agent",
                }
            ],
        }
    ]
    # Debian's promtool is built without Kubernetes discovery (it refuses the field): the
    # agents' job is checked above, the rest of the file by promtool.
    config["scrape_configs"].remove(agents)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [account] = [
        o
        for o in objects
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "gpufleet-prometheus"
    ]
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]


# ---------------------------------------------------------------- secrets and databases


def test_generated_secrets_are_read_back(helm: str, tmp_path: Path) -> None:
    """The helper behind the platform's Secret keeps what an earlier install made.
    `helm template` has no cluster (`lookup` finds nothing), so the helper is rendered in
    a chart of its own, given the Secret's data as `lookup` would."""
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
    shutil.copy(CHART / "templates" / "_helpers-secrets.tpl", probe / "templates")
    kept = base64.b64encode(b"kept-token").decode()
    (probe / "templates" / "probe.yaml").write_text(
        'kept: {{ include "gpufleet.secretValue" (dict "existing" (dict "proxy-token" '
        f'"{kept}") "key" "proxy-token" "generate" "new") }}}}\n'
        'made: {{ include "gpufleet.secretValue" (dict "existing" (dict "proxy-token" '
        f'"{kept}") "key" "agent-token" "generate" "new") }}}}\n'
        'none: {{ include "gpufleet.secretValue" (dict "existing" dict "key" "x" "generate" '
        '(include "gpufleet.newToken" .)) }}\n'
    )
    done = _run(helm, "template", "probe", probe)
    assert done.returncode == 0, done.stderr
    [out] = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert out["kept"] == "kept-token"
    assert out["made"] == "new"
    assert len(str(out["none"])) == 64 and int(str(out["none"]), 16) >= 0


def test_platform_secret_is_made_whole_and_kept(helm: str) -> None:
    objects = render(helm)
    [secret] = [o for o in objects if o["metadata"]["name"] == "gpufleet-secret"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert len(base64.b64decode(data.pop("snapshot-master-key"))) == 32
    for key, value in data.items():
        assert len(value) == 64 and int(value, 16) >= 0, key  # hex: JPY_COOKIE_SECRET's form
    # A Secret of the operator's instead: none is made, every pod refers to it.
    own = render(
        helm,
        "--set",
        "secrets.existingSecret=mine",
        "--set",
        "snapshots.enabled=true",
        "--set",
        "snapshots.store=s3://b/p",
    )
    assert not [o for o in own if o["metadata"]["name"] == "gpufleet-secret"]
    refs = json.dumps([pod for _, pod in _pods(own)])
    assert '"name": "mine"' in refs and "gpufleet-secret" not in refs


def _strategy(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    [deployment] = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    ]
    strategy: dict[str, Any] = deployment["spec"]["strategy"]
    return strategy


def test_controller_rolls_under_the_lease_except_on_sqlite(helm: str) -> None:
    rolling = _strategy(render(helm), "gpufleet-controller")
    assert rolling == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1},
    }
    tier = render(helm, "-f", TIER, "--kube-version", "1.20.2")
    assert _strategy(tier, "gpufleet-controller") == {"type": "Recreate"}
    claims = {o["metadata"]["name"] for o in tier if o["kind"] == "PersistentVolumeClaim"}
    assert claims == {"gpufleet-hub", "gpufleet-controller"}
    settings = settings_of(tier)
    assert settings["controller"]["traitlets"]["FleetController"]["db_url"].startswith("sqlite:")
    upgrading = render(helm, "--set", "controller.db.upgrade=true")
    assert _strategy(upgrading, "gpufleet-controller") == {"type": "Recreate"}
    [pod] = [p for n, p in _pods(upgrading) if n == "gpufleet-controller"]
    assert pod["initContainers"][-1]["command"] == ["gpufleet-controller", "upgrade-db"]


def test_commands_are_the_projects_entry_points(helm: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {n: p["containers"][0]["command"][0] for n, p in _pods(render(helm))}
    assert commands["gpufleet-controller"] in scripts
    assert commands["gpufleet-agent"] in scripts
    assert commands["gpufleet-hub"] == "jupyterhub"  # JupyterHub's own, with the chart's file


def test_agents_per_zone(helm: str) -> None:
    objects = render(helm, "--set", "agent.zones={us-east-1a,us-east-1b}")
    agents = {n: p for n, p in _pods(objects) if n.startswith("gpufleet-agent")}
    assert set(agents) == {"gpufleet-agent-us-east-1a", "gpufleet-agent-us-east-1b"}
    pod = agents["gpufleet-agent-us-east-1b"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    [expression] = term["nodeSelectorTerms"][0]["matchExpressions"]
    assert expression == {
        "key": "topology.kubernetes.io/zone",
        "operator": "In",
        "values": ["us-east-1b"],
    }
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GPUFLEET_ZONE"] == "us-east-1b"
