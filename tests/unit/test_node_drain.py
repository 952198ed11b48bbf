"""What a drain of a Kubernetes node evicts (``clusters/node_drain.py``): literal pods."""

from __future__ import annotations

from typing import Any

from gpufleet.clusters.node_drain import NodePod, eviction, read_node_pod, to_evict


def pod(name: str, phase: str = "Running", **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", **metadata},
        "status": {"phase": phase},
    }


def test_a_drain_evicts_only_what_nobody_else_ends_or_puts_back() -> None:
    listed = [
        pod("web-2"),
        pod("agent-x", ownerReferences=[{"kind": "DaemonSet", "name": "gpufleet-agent"}]),
        pod("etcd-node", annotations={"kubernetes.io/config.mirror": "abc"}),
        pod("batch-done", phase="Succeeded"),
        pod("going", deletionTimestamp="2026-12-06T01:00:00Z"),
        pod("gf-job-7-a1-0", labels={"app.kubernetes.io/managed-by": "gpufleet"}),
        pod("web-1", ownerReferences=[{"kind": "ReplicaSet", "name": "web"}]),
    ]
    assert [p.key for p in to_evict(listed)] == ["team/web-1", "team/web-2"]
    assert [read_node_pod(p).why_not for p in listed[1:6]] == [
        "a DaemonSet's",
        "a static (mirror) pod",
        "ended (Succeeded)",
        "being deleted",
        "gpufleet's own: stopped as a session or a job",
    ]


def test_the_eviction_names_the_pod_in_the_version_asked() -> None:
    assert eviction(NodePod("team", "web-1", True), "policy/v1beta1") == {
        "apiVersion": "policy/v1beta1",
        "kind": "Eviction",
        "metadata": {"name": "web-1", "namespace": "team"},
    }
