"""Faults and node operations under training jobs on the tier: an XID written to a
Kubernetes node's fake NVML (its node agent, as the DaemonSet would, reports the node's
GPUs) cordons the node in its cluster, stops the gang and resumes it elsewhere from its
checkpoint; a drain evicts what else runs on the node through the Eviction API, so a
PodDisruptionBudget holds, snapshots and stops gpufleet's session there and stops its job
with the checkpoint signal."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.client import Client
from gpufleet.recovery.fake_nvml import write_control

from ..exposition import parse
from ..integration.harness import Hub, wait_for
from .control_plane import NAMESPACE, ControlPlane
from .hubs import node_homes_config
from .kubelet_helpers import manifest
from .nodes import NodeSpec
from .test_jobs import (
    RESUMING,
    job_pods,
    running_attempt,
    running_jobs_hub,
    submit,
    wait_node_in_inventory,
)
from .test_sessions import objects_of, spawn_api
from .tier import CLUSTER_A, CLUSTER_B

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

BUDGETS = f"/apis/policy/v1beta1/namespaces/{NAMESPACE}/poddisruptionbudgets"

# The node agent of a-gpu-1 reports its GPUs through the fake NVML (the other nodes' GPUs
# are their clusters' slots).
WATCHED = [
    {"name": "a-gpu-1", "cluster": CLUSTER_A, "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4}
]
FAULTS_CONFIG = f"""
c.NodeAgent.nvml = "fake"
c.NodeAgent.declared_nodes = {WATCHED!r}
c.NodeAgent.heartbeat_interval = 1
c.NodeAgent.sample_interval = 1
c.KubeInventory.recycle_action = "delete-node"
c.KubeDrains.eviction_retry_seconds = 1
c.KubeGPUSpawner.final_snapshot_retry_seconds = 1
"""


@pytest.fixture(scope="module")
def faults_hub(k8s_tier: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = Path(tmp_path_factory.mktemp("kube-faults"))
    homes = root / "homes"  # sessions' homes stay on their node; its agent snapshots them
    homes.mkdir(mode=0o755)
    with running_jobs_hub(k8s_tier, root, FAULTS_CONFIG + node_homes_config(homes)) as hub:
        yield hub


@pytest.fixture
def alice(faults_hub: Hub) -> Iterator[Client]:
    with Client(faults_hub.controller_api, faults_hub.user_token("alice")) as client:
        yield client


def agent_reports_its_gpus(hub: Hub) -> None:
    """Wait until a-gpu-1's GPUs are its node agent's, no longer its cluster's slots."""
    declared = [g.uuid for g in declared_fake_gpus(WATCHED)]
    wait_for(
        lambda: any(
            n["name"] == "a-gpu-1" and n["gpu_uuids"] == declared
            for n in hub.controller("GET", "/nodes").json()["items"]
        ),
        timeout=60,
        what="a-gpu-1's GPUs reported by its node agent",
    )


def checkpointing_job_on(
    hub: Hub, alice: Client, node: str, name: str, session: bool = False
) -> tuple[int, Any, Any]:
    """A job running on ``node`` alone (every other node cordoned until it runs), once it
    saved a checkpoint: its id, its first attempt and that checkpoint. With ``session``,
    alice's session of 2 GPUs runs there first, and the job has the other 2."""
    others = only_on(hub, node)
    try:
        sizes: dict[str, Any] = {}
        if session:
            spawn_api(hub, "alice", "", "vision", 2)
            hub.wait_ready("alice", timeout=180)
            sizes = {"gpus": 2, "gpus_per_pod": 2}
        env = {"GPUFLEET_PROGRESS_INTERVAL": "0.5"}
        job_id = submit(alice, RESUMING, name=name, env=env, **sizes)
        first = running_attempt(alice, job_id, 1)
        assert {a.node for a in first.allocations} == {node}
    finally:
        for other in others:
            hub.controller("POST", f"/nodes/{other}/uncordon").raise_for_status()
    saved = wait_for(
        lambda: (p := alice.job(job_id).progress) and p.last_checkpoint,
        timeout=60,
        what="a checkpoint saved",
    )
    return job_id, first, saved


def held_by_pods(hub: Hub, uuids: set[str]) -> dict[str, dict[str, str]]:
    """The labels of ``DCGM_FI_DEV_GPU_UTIL`` for those of ``uuids`` that name a pod."""
    scraped = parse(httpx.get(hub.metrics_url, timeout=10).text)
    return {
        labels["UUID"]: labels
        for labels, _ in scraped.samples.get("DCGM_FI_DEV_GPU_UTIL", [])
        if labels["UUID"] in uuids and labels.get("pod")
    }


def only_on(hub: Hub, node: str) -> list[str]:
    """Cordon every other node (gpufleet's cordons, made in the clusters); returns them."""
    others = [
        n["name"] for n in hub.controller("GET", "/nodes").json()["items"] if n["name"] != node
    ]
    for other in others:
        hub.controller("POST", f"/nodes/{other}/cordon").raise_for_status()
    return others


def node_spec(plane: ControlPlane, node: str) -> dict[str, object]:
    cluster = next(c for c in (CLUSTER_A, CLUSTER_B) if node in plane[c].nodes)
    with plane[cluster].rest() as api:
        found = api.get(f"/api/v1/nodes/{node}")
        found.raise_for_status()
        return dict(found.json()["spec"])


def test_an_xid_on_a_kubernetes_node_cordons_it_there_and_the_job_resumes_elsewhere(
    k8s_tier: ControlPlane, faults_hub: Hub, alice: Client
) -> None:
    agent_reports_its_gpus(faults_hub)
    job_id, first, saved = checkpointing_job_on(faults_hub, alice, "a-gpu-1", "xid")
    # The node agent's metrics name the pod holding each of the job's GPUs, as
    # dcgm-exporter does, beside the job itself (stable across attempts).
    held = {a.uuid for a in first.allocations}
    labelled = wait_for(
        lambda: found if set(found := held_by_pods(faults_hub, held)) == held else None,
        timeout=30,
        what="the job's GPUs labelled with their pods",
    )
    pods = {f"gf-job-{job_id}-a1-{i}" for i in range(first.pods)}
    for labels in labelled.values():
        assert labels["pod"] in pods, labels
        assert (labels["namespace"], labels["container"]) == (NAMESPACE, "torchrun")
        assert labels["hpc_job"] == str(job_id), labels
    gpus = declared_fake_gpus(WATCHED)
    blamed = next(g for g in gpus if g.uuid in {a.uuid for a in first.allocations})
    write_control(
        faults_hub.fake_nvml_control,
        [replace(g, xid_events=[79]) if g is blamed else g for g in gpus],
    )
    try:
        second = running_attempt(alice, job_id, 2)
        assert "a-gpu-1" not in {a.node for a in second.allocations}
        # The recovery loop's cordon is the cluster's: spec.unschedulable and the taint.
        spec = wait_for(
            lambda: (s := node_spec(k8s_tier, "a-gpu-1")).get("unschedulable") and s,
            timeout=30,
            what="a-gpu-1 cordoned in its cluster",
        )
        assert any(t["key"] == "gpufleet.io/cordoned" for t in spec.get("taints", [])), spec
        faults = [e for e in alice.events(workload_id=job_id) if e.kind == "job-fault"]
        assert faults and "XID 79" in faults[0].message, faults
        resumed = wait_for(
            lambda: "attempt 2 starts at step" in (out := "".join(alice.logs(job_id))) and out,
            timeout=60,
            what="attempt 2's first words",
        )
        start = int(resumed.split("attempt 2 starts at step ")[1].split()[0])
        assert start >= saved.step + 1, (start, saved)
        # Still cordoned a while later: the Node's updates do not undo it.
        node = next(
            n
            for n in faults_hub.controller("GET", "/nodes").json()["items"]
            if n["name"] == "a-gpu-1"
        )
        assert node["cordoned"], node
        alice.cancel(job_id)
        assert alice.wait(job_id, timeout=90).outcome == "cancelled"
    finally:
        write_control(faults_hub.fake_nvml_control, gpus)
        faults_hub.controller("POST", "/nodes/a-gpu-1/uncordon").raise_for_status()
    wait_for(
        lambda: not job_pods(k8s_tier, CLUSTER_A, job_id),
        timeout=30,
        what="the job's pods gone",
    )


def web_server(plane: ControlPlane, node: str) -> str:
    """Another team's pod on ``node`` (not gpufleet's), with a budget that lets none go."""
    body = manifest("web", ["sleep", "600"], node=node)
    body["metadata"]["labels"] = {"app": "web"}
    budget = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    }
    with plane[CLUSTER_A].rest() as api:
        api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=body).raise_for_status()
        api.post(f"{BUDGETS}/", json=budget).raise_for_status()

        def budget_holds() -> bool:
            status = api.get(f"{BUDGETS}/web").json().get("status") or {}
            return status.get("currentHealthy") == 1 and status.get("disruptionsAllowed") == 0

        wait_for(budget_holds, timeout=60, what="the web pod running under its budget")
    return str(body["metadata"]["name"])


def test_a_drain_stops_the_session_and_the_job_and_evicts_the_rest_as_its_budget_allows(
    k8s_tier: ControlPlane, faults_hub: Hub, alice: Client
) -> None:
    job_id, _first, saved = checkpointing_job_on(
        faults_hub, alice, "a-gpu-2", "drained", session=True
    )
    [session] = [w for w in faults_hub.workloads(username="alice") if w["kind"] == "session"]
    assert {a["node"] for a in session["allocations"]} == {"a-gpu-2"}
    web = web_server(k8s_tier, "a-gpu-2")
    drained = faults_hub.controller(
        "POST", "/nodes/a-gpu-2/drain", json={"reason": "kernel update"}
    )
    drained.raise_for_status()
    try:
        assert node_spec(k8s_tier, "a-gpu-2").get("unschedulable")  # in its cluster
        # gpufleet's job: checkpoint signal, and its next attempt elsewhere, charged nothing.
        second = running_attempt(alice, job_id, 2)
        assert "a-gpu-2" not in {a.node for a in second.allocations}
        assert second.faults == 0
        resumed = wait_for(
            lambda: "attempt 2 starts at step" in (out := "".join(alice.logs(job_id))) and out,
            timeout=60,
            what="attempt 2's first words",
        )
        assert int(resumed.split("attempt 2 starts at step ")[1].split()[0]) > saved.step
        # gpufleet's session: snapshotted by the agent on its node, then stopped.
        ended = faults_hub.wait_ended(session, 120)
        assert ended["outcome"] == "stopped", ended
        assert "final snapshot" in ended["reason"] and "on the node" in ended["reason"], ended
        assert objects_of(k8s_tier, CLUSTER_A, session["id"], "pods") == []
        # The other team's pod stays while its budget refuses, and the drain says why.
        waiting = wait_for(
            lambda: next(
                (e for e in node_events(faults_hub) if e["kind"] == "node-eviction-waiting"), None
            ),
            timeout=30,
            what="the eviction waiting on the budget",
        )
        assert f"pod {NAMESPACE}/{web}" in waiting["message"], waiting
        assert "disruption budget" in waiting["message"], waiting
        assert waiting["cause"] == "test-admin"
        with k8s_tier[CLUSTER_A].rest() as api:
            pod = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{web}").json()
            assert "deletionTimestamp" not in pod["metadata"], pod["metadata"]
            # Its budget lets it go: the drain evicts it, and is done.
            api.delete(f"{BUDGETS}/web").raise_for_status()
        wait_for(
            lambda: any(e["kind"] == "node-drain-done" for e in node_events(faults_hub)),
            timeout=60,
            what="the drain done",
        )
        kinds = [(e["kind"], e["data"].get("pod")) for e in node_events(faults_hub)]
        assert ("node-pod-evicted", f"{NAMESPACE}/{web}") in kinds, kinds
        # gpufleet's own pods were stopped its own way, never evicted; all of it as events.
        evicted = [pod for kind, pod in kinds if kind == "node-pod-evicted"]
        assert evicted == [f"{NAMESPACE}/{web}"], evicted
        assert {"node-cordoned", "node-drained", "node-drain-done"} <= {k for k, _ in kinds}, kinds
        alice.cancel(job_id)
        assert alice.wait(job_id, timeout=90).outcome == "cancelled"
    finally:
        faults_hub.stop_all_servers()  # and uncordons what the test cordoned
        with k8s_tier[CLUSTER_A].rest() as api:
            api.delete(f"{BUDGETS}/web")
            api.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{web}", params={"gracePeriodSeconds": 0}
            )


def node_events(hub: Hub, node: str = "a-gpu-2") -> list[dict[str, object]]:
    found = hub.controller("GET", "/events", params={"limit": 500}).json()["items"]
    return [e for e in found if e["node"] == node]


def test_a_recycle_deletes_the_node_for_its_node_group_to_replace(
    k8s_tier: ControlPlane, faults_hub: Hub
) -> None:
    b = k8s_tier[CLUSTER_B]
    name = b.spare_node_name()
    b.add_node(NodeSpec(name, "zone-c", gpus=4))
    try:
        wait_node_in_inventory(faults_hub, name)
        faults_hub.controller(
            "POST", f"/nodes/{name}/recycle", json={"reason": "kernel update"}
        ).raise_for_status()
        with b.rest() as api:
            wait_for(
                lambda: api.get(f"/api/v1/nodes/{name}").status_code == 404,
                timeout=30,
                what=f"Node {name} deleted in its cluster",
            )
        said = wait_for(
            lambda: [
                e["message"]
                for e in node_events(faults_hub, name)
                if e["kind"] in ("maintenance-asked", "maintenance-passed")
            ],
            timeout=30,
            what="the recycle's events",
        )
        assert (
            f"recycle of node {name} passed (Node {name} deleted in cluster {CLUSTER_B}): its "
            "node group replaces it (the new node joins under a name of its own)"
        ) in said, said
        assert any("asked of its cluster" in m for m in said), said
    finally:
        b.remove_node(name)
