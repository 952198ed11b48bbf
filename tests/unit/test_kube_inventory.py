"""The pure parts of the Kubernetes inventory: the clusters' configuration, what a Node
object says of a GPU node, and when an API server counts as not answering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufleet.clusters.kube_config import ClusterConfigError, ClusterSettings, parse_clusters
from gpufleet.clusters.node_watch import (
    ClusterView,
    Reachability,
    gpu_type_of_product,
    observe_node,
    parse_quantity,
)
from gpufleet.state.clusters import ClusterNodeState


@pytest.fixture
def kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\n")
    return str(path)


# ------------------------------------------------------------------ configuration
def test_a_cluster_needs_only_a_name_and_its_credentials(kubeconfig: str) -> None:
    (cluster,) = parse_clusters([{"name": "us-east", "kubeconfig": kubeconfig}])
    assert cluster == ClusterSettings(name="us-east", kubeconfig=kubeconfig)
    assert (cluster.namespace, cluster.gpu_resource, cluster.mig_profile) == (
        "gpufleet",
        "nvidia.com/gpu",
        None,
    )
    assert cluster.pod_address(ip="10.0.3.7", port=8888, pod="jupyter-alice") == (
        "http://10.0.3.7:8888"
    )


def test_an_ingress_template_and_a_mig_resource(kubeconfig: str) -> None:
    (cluster,) = parse_clusters(
        [
            {
                "name": "eu",
                "kubeconfig": kubeconfig,
                "gpu_resource": "nvidia.com/mig-3g.40gb",
                "pod_url": "https://{cluster}.gpus.example.org/{namespace}/{pod}",
            }
        ]
    )
    assert cluster.mig_profile == "3g.40gb"
    assert cluster.pod_address(ip="10.0.0.1", port=8888, pod="jupyter-bob") == (
        "https://eu.gpus.example.org/gpufleet/jupyter-bob"
    )


def test_every_problem_of_every_cluster_is_named_at_once(tmp_path: Path, kubeconfig: str) -> None:
    with pytest.raises(ClusterConfigError) as caught:
        parse_clusters(
            [
                {"name": "a", "kubeconfig": kubeconfig, "namespce": "x"},
                {"name": "a", "kubeconfig": kubeconfig},
                {"name": "b", "kubeconfig": str(tmp_path / "missing.yaml")},
                {"name": "c"},
                {"name": "d", "kubeconfig": kubeconfig, "gpu_resource": "gpus"},
                {"name": "e", "in_cluster": True, "pod_url": "http://{host}:{port}"},
                {"name": "Bad_Name", "in_cluster": True},
                {"name": "f", "in_cluster": True, "namespace": "Team_A"},
                {"name": "g", "in_cluster": True, "network": {"hub": {"cidr": "10.0.0.300/32"}}},
            ]
        )
    problems = str(caught.value).split("; ")
    assert problems[0].startswith("cluster 'a': namespce: unknown key (the keys are name, ")
    assert problems[1:] == [
        "cluster 'c': give exactly one of kubeconfig (a file) and in_cluster (True: the pod's "
        "own service account)",
        "cluster 'd': gpu_resource: 'gpus' is not an extended resource name such as "
        "nvidia.com/gpu or nvidia.com/mig-3g.40gb",
        "cluster 'e': pod_url: pod_url 'http://{host}:{port}' uses host, which it may not: "
        "it may use only cluster, ip, namespace, pod, port",
        "cluster 'Bad_Name': name: 'Bad_Name' is not a valid cluster name: use lower-case "
        "letters, digits and dashes, at most 63 characters, starting and ending with a "
        "letter or digit",
        "cluster 'f': namespace: 'Team_A' is not a valid Kubernetes namespace name: use "
        "lower-case letters, digits and dashes, at most 63 characters, starting and ending "
        "with a letter or digit",
        "cluster 'g': network: network.hub: '10.0.0.300/32' does not appear to be an IPv4 or "
        "IPv6 network",
        "cluster 'a' is declared 2 times",
        f"cluster 'b': kubeconfig {tmp_path / 'missing.yaml'} does not exist or is not a file",
    ]


# ------------------------------------------------------------------ Node objects
SETTINGS = ClusterSettings(name="cluster-a", in_cluster=True)


def node(
    name: str = "a-gpu-1",
    *,
    gpus: str | None = "4",
    ready: str = "True",
    unschedulable: bool | None = None,
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as an API server returns it (the parts gpufleet reads, and some it does not)."""
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110"}
    if gpus is not None:
        resources["nvidia.com/gpu"] = gpus
    spec: dict[str, Any] = {"taints": taints or []}
    if unschedulable is not None:
        spec["unschedulable"] = unschedulable
    return {
        "metadata": {
            "name": name,
            "resourceVersion": "4711",
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": "zone-a",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.memory": "81920",
                **(labels or {}),
            },
        },
        "spec": spec,
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "MemoryPressure",
                    "status": "False",
                    "reason": "KubeletHasSufficientMemory",
                },
                {
                    "type": "Ready",
                    "status": ready,
                    "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown",
                    "message": "kubelet is posting ready status"
                    if ready == "True"
                    else "Kubelet stopped posting node status.",
                    "lastHeartbeatTime": "2026-12-02T10:00:00Z",
                },
            ],
        },
    }


def test_a_ready_gpu_node_is_read_whole() -> None:
    assert observe_node(node(), SETTINGS) == ClusterNodeState(
        name="a-gpu-1",
        zone="zone-a",
        gpu_type="A100-80GB",
        gpus=4,
        ready=True,
        unschedulable=False,
        why_not_ready="",
        cpus=32.0,
        memory_bytes=256 * 2**30,
        labels=node()["metadata"]["labels"],
    )


def test_heartbeats_alone_do_not_change_the_reading() -> None:
    later = node()
    later["metadata"]["resourceVersion"] = "4712"
    later["status"]["conditions"][1]["lastHeartbeatTime"] = "2026-12-02T10:00:10Z"
    assert observe_node(later, SETTINGS) == observe_node(node(), SETTINGS)


@pytest.mark.parametrize(
    ("given", "ready", "why"),
    [
        (node(ready="Unknown"), False, "NodeStatusUnknown: Kubelet stopped posting node status."),
        (
            node(taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}]),
            False,
            "tainted node.kubernetes.io/unreachable",
        ),
        (node(taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]), True, ""),
    ],
)
def test_readiness_comes_from_the_ready_condition_and_the_lifecycle_taints(
    given: dict[str, Any], ready: bool, why: str
) -> None:
    state = observe_node(given, SETTINGS)
    assert state is not None
    assert (state.ready, state.why_not_ready) == (ready, why)


def test_a_cordon_is_spec_unschedulable() -> None:
    state = observe_node(node(unschedulable=True), SETTINGS)
    assert state is not None and state.unschedulable


def test_nodes_that_are_not_the_fleets_gpu_nodes_are_left_out() -> None:
    cpu_only = node(gpus=None, labels={"nvidia.com/gpu.product": ""})
    assert observe_node(cpu_only, SETTINGS) is None
    selective = ClusterSettings(
        name="c", in_cluster=True, gpu_node_selector={"pool": "gpu-research"}
    )
    assert observe_node(node(), selective) is None
    chosen = observe_node(node(labels={"pool": "gpu-research"}), selective)
    assert chosen is not None and chosen.gpus == 4


def test_a_node_whose_device_plugin_has_not_reported_offers_no_gpus_yet() -> None:
    waiting = node(gpus=None)
    state = observe_node(waiting, SETTINGS)
    assert state is not None and (state.gpus, state.gpu_type) == (0, "A100-80GB")


@pytest.mark.parametrize(
    ("product", "resource", "names", "expected"),
    [
        ("NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu", {}, "A100-80GB"),
        ("NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu", {}, "H100-80GB"),
        ("NVIDIA-A100-SXM4-80GB", "nvidia.com/mig-3g.40gb", {}, "A100-80GB:3g.40gb"),
        ("Tesla-T4", "nvidia.com/gpu", {"Tesla-T4": "T4"}, "T4"),
    ],
)
def test_gpu_types_are_named_as_the_node_agent_names_them(
    product: str, resource: str, names: dict[str, str], expected: str
) -> None:
    settings = ClusterSettings(
        name="c", in_cluster=True, gpu_resource=resource, gpu_type_names=names
    )
    assert gpu_type_of_product(product, 81920, settings) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [("32", 32.0), ("500m", 0.5), ("256Gi", 256 * 2**30), ("1e3", 1000.0), ("2k", 2000.0)],
)
def test_quantities(text: str, value: float) -> None:
    assert parse_quantity(text) == value


def test_a_quantity_that_is_not_one_says_so() -> None:
    with pytest.raises(ValueError, match="'12 cores' is not a Kubernetes quantity"):
        parse_quantity("12 cores")


# ------------------------------------------------------------------ reachability
def test_an_api_server_stops_answering_only_after_failing_the_whole_time() -> None:
    reach = Reachability(after=20.0)
    assert not reach.record(False, 0.0, "timeout")
    assert not reach.record(False, 19.0, "timeout")
    assert reach.reachable
    assert reach.record(False, 20.0, "refused")
    assert (reach.reachable, reach.why) == (False, "refused")
    assert not reach.record(False, 25.0, "refused")
    assert reach.record(True, 26.0)
    assert reach.reachable
    # A success in between starts the count again.
    assert not reach.record(False, 30.0, "timeout")
    assert not reach.record(True, 40.0)
    assert not reach.record(False, 45.0, "timeout")
    assert not reach.record(False, 60.0, "timeout")
    assert reach.reachable


def test_a_view_reports_only_what_changed() -> None:
    view = ClusterView(SETTINGS)
    first = observe_node(node(), SETTINGS)
    assert first is not None
    view.relisted([first])
    assert (view.changed, view.complete) == ({"a-gpu-1"}, True)
    view.changed.clear()
    assert not view.seen("a-gpu-1", first)
    cordoned = observe_node(node(unschedulable=True), SETTINGS)
    assert view.seen("a-gpu-1", cordoned)
    assert view.seen("a-gpu-1", None)
    assert (view.changed, view.gone) == (set(), {"a-gpu-1"})
    assert not view.seen("a-gpu-1", None)


async def test_watch_lines_of_any_length_survive_any_chunking() -> None:
    from gpufleet.clusters.node_watch import _lines

    events = [b'{"type": "MODIFIED", "pad": "' + b"x" * 200_000 + b'"}', b'{"type": "DELETED"}']
    body = b"\n".join(events) + b"\n"

    class Stream:
        async def iter_any(self):  # type: ignore[no-untyped-def]
            for start in range(0, len(body), 7_001):  # chunk edges fall anywhere
                yield body[start : start + 7_001]

    assert [line async for line in _lines(Stream())] == events


def test_a_cordon_sets_unschedulable_and_gpufleets_taint_and_keeps_the_others() -> None:
    from gpufleet.clusters.node_watch import cordon_patch, is_cordoned

    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    node = {"metadata": {"resourceVersion": "41"}, "spec": {"taints": [gpu_taint]}}
    patch = cordon_patch(node, True)
    assert patch == {
        "metadata": {"resourceVersion": "41"},
        "spec": {
            "unschedulable": True,
            "taints": [
                gpu_taint,
                {"key": "gpufleet.io/cordoned", "value": "true", "effect": "NoSchedule"},
            ],
        },
    }
    cordoned = {"metadata": {"resourceVersion": "42"}, "spec": patch["spec"]}
    assert is_cordoned(cordoned)
    # kubectl uncordon clears spec.unschedulable only: the taint keeps the cordon.
    assert is_cordoned({"spec": {**patch["spec"], "unschedulable": False}})
    assert cordon_patch(cordoned, False)["spec"] == {"unschedulable": False, "taints": [gpu_taint]}
    assert is_cordoned({"spec": {"unschedulable": True}})  # kubectl cordon is a cordon
    assert not is_cordoned({"spec": {"taints": [gpu_taint]}})
