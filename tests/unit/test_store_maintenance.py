"""Maintenance against real databases (SQLite and PostgreSQL): what a fault leaves due is
asked of the node agent only once nothing runs where it acts; a pass returns the node or
GPU to service, a failure leaves it out and says why. test_store.py's fleet: a1 (4 A100),
a2 (2 A100), h1 (2 H100)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine

from gpufleet.scheduler.errors import NotFound
from gpufleet.state.fleet import FleetStore
from gpufleet.state.jobs import PodReport
from gpufleet.state.models import Gpu, WorkloadState

from .test_store import ask, events, make_store, t, workload
from .test_store_attempts import NOW_POLICY, running, submit, workload_node
from .test_store_jobs import report


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def node_state(store: FleetStore, name: str) -> tuple[bool, str | None]:
    node = workload_node(store, name)
    return node.cordoned, node.maintenance


def gpu_state(store: FleetStore, uuid: str) -> tuple[bool, str | None]:
    with store.read() as session:
        gpu = session.get(Gpu, uuid)
        assert gpu is not None
        return gpu.cordoned, gpu.maintenance


def agent_runs(store: FleetStore, at: float, node: str, state: str = "done", **kw: object) -> dict:
    """The node's agent claims the one operation asked of it and reports its end."""
    [operation] = store.node_operations.claim_node_operations(t(at), [node])
    assert store.node_operations.report_node_operation(t(at), operation.id, state=state, **kw)  # type: ignore[arg-type]
    return {"kind": operation.kind, **operation.request}


def test_a_fallen_node_is_recycled_once_empty_then_diagnosed_and_returns(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-0", 79)
    store.jobs.act_on_xid(t(13), "GPU-a2-0", 79)
    assert node_state(store, "a2") == (True, "recycle")
    assert store.maintenance.start_due_maintenance(t(14)) == []  # the job's ranks are still there
    report(store, 15, PodReport(job, 0, "stopped", signal=15))
    assert len(store.maintenance.start_due_maintenance(t(16))) == 1
    assert store.maintenance.start_due_maintenance(t(17)) == []  # one at a time
    assert node_state(store, "a2") == (True, "recycling")
    ran = agent_runs(store, 18, "a2", result={"summary": "power cycled"})
    assert ran == {
        "kind": "recycle",
        "scope": "node",
        "uuids": ["GPU-a2-0", "GPU-a2-1"],
        "indexes": [0, 1],
        "by": "recovery",
    }
    assert events(store, "maintenance-passed") == [
        "recycle of node a2 passed (power cycled): its diagnostics follow"
    ]
    assert node_state(store, "a2") == (True, "diagnose")
    assert len(store.maintenance.start_due_maintenance(t(19))) == 1
    assert agent_runs(store, 20, "a2")["kind"] == "diagnose"
    assert node_state(store, "a2") == (False, None)
    # The job's next attempt, which kept off a2 since its fault, may use it again.
    assert events(store, "maintenance-passed")[-1] == (
        f"diagnose of node a2 passed: it takes work again; job {job} no longer avoids it"
    )
    # Its GPUs take work again: a 2-GPU session lands there.
    ask(store, t(21), "carol", project="nlp", gpus=4)
    alice = ask(store, t(21), "alice", gpus=2)
    store.scheduling.scheduling_cycle(t(22), NOW_POLICY)
    assert workload(store, alice).state == WorkloadState.admitted


def test_failed_diagnostics_keep_the_node_out_and_say_why(store: FleetStore) -> None:
    store.jobs.act_on_xid(t(10), "GPU-a2-0", 79)
    store.maintenance.start_due_maintenance(t(11))
    agent_runs(store, 12, "a2")
    store.maintenance.start_due_maintenance(t(13))
    agent_runs(store, 14, "a2", state="failed", error="GPU-a2-1: memory test failed")
    assert node_state(store, "a2") == (True, None)
    assert events(store, "maintenance-failed") == [
        "diagnose of node a2 failed (GPU-a2-1: memory test failed): it stays cordoned until "
        "an admin acts"
    ]
    assert store.maintenance.start_due_maintenance(t(15)) == []


def test_a_gpu_hardware_fault_resets_the_gpu_once_its_job_let_go(store: FleetStore) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-1", 48)
    store.jobs.act_on_xid(t(13), "GPU-a2-1", 48)
    assert gpu_state(store, "GPU-a2-1") == (True, "reset")
    assert store.maintenance.start_due_maintenance(t(14)) == []
    report(store, 15, PodReport(job, 0, "stopped", signal=15))
    store.maintenance.start_due_maintenance(t(16))
    ran = agent_runs(store, 17, "a2")
    assert (ran["kind"], ran["scope"], ran["uuids"]) == ("reset", "gpu", ["GPU-a2-1"])
    assert gpu_state(store, "GPU-a2-1") == (False, None)
    assert node_state(store, "a2") == (False, None)  # the node never left service


def test_a_degraded_gpu_is_reset_at_its_next_idle_point(store: FleetStore) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.jobs.act_on_xid(t(13), "GPU-a2-0", 63)  # a row remap pending: the job keeps running
    assert workload(store, job).state == WorkloadState.running
    assert gpu_state(store, "GPU-a2-0") == (False, "reset-at-idle")
    assert store.maintenance.start_due_maintenance(t(14)) == []
    report(store, 20, PodReport(job, 0, "exited", exit_code=0))
    store.maintenance.start_due_maintenance(t(21))
    assert gpu_state(store, "GPU-a2-0") == (True, "resetting")  # nothing lands on it now
    agent_runs(store, 22, "a2")
    assert gpu_state(store, "GPU-a2-0") == (False, None)


def test_an_admins_recycle_drains_first_and_an_agent_that_stops_reporting_fails_it(
    store: FleetStore,
) -> None:
    session = ask(store, t(1), "alice", gpus=2)
    store.scheduling.scheduling_cycle(t(2), NOW_POLICY)
    stops = store.maintenance.recycle_node(t(3), "a2", "admin", "firmware")
    assert [s.workload_id for s in stops.sessions] == [session]
    assert node_state(store, "a2") == (True, "recycle")
    assert events(store, "node-maintenance-planned") == [
        "admin asked for node a2 to be recycled: it is recycled once nothing runs there, "
        "then diagnosed; it returns to service if the diagnostics pass"
    ]
    assert store.maintenance.start_due_maintenance(t(4)) == []
    store.workloads.end(t(5), session, "stopped", "final snapshot taken")
    store.maintenance.start_due_maintenance(t(6))
    [operation] = store.node_operations.claim_node_operations(t(7), ["a2"])
    assert operation.request["by"] == "admin"
    store.maintenance.start_due_maintenance(t(7) + timedelta(seconds=300))
    assert node_state(store, "a2") == (True, None)
    assert events(store, "maintenance-failed") == [
        "recycle of node a2 failed (its node agent stopped reporting on it): it stays "
        "cordoned until an admin acts"
    ]
    # A late report of it changes nothing.
    assert not store.node_operations.report_node_operation(t(400), operation.id, state="done")
    with pytest.raises(NotFound):
        store.maintenance.recycle_node(t(401), "nowhere", "admin", "")


def test_an_admins_uncordon_cancels_what_the_loop_left_due(store: FleetStore) -> None:
    store.jobs.act_on_xid(t(10), "GPU-a2-0", 79)
    store.nodes.set_cordoned(t(11), "a2", False, by="admin")
    assert node_state(store, "a2") == (False, None)
    assert store.maintenance.start_due_maintenance(t(12)) == []


def test_with_maintenance_off_a_fault_only_cordons(store: FleetStore) -> None:
    store.jobs.plan_maintenance = False
    store.jobs.act_on_xid(t(10), "GPU-a2-0", 79)
    store.jobs.act_on_xid(t(11), "GPU-a1-0", 48)
    assert node_state(store, "a2") == (True, None)
    assert gpu_state(store, "GPU-a1-0") == (True, None)
    assert store.maintenance.start_due_maintenance(t(12)) == []
    # An admin's recycle still runs.
    store.maintenance.recycle_node(t(13), "h1", "admin", "")
    assert len(store.maintenance.start_due_maintenance(t(14))) == 1


def test_a_recycle_its_cluster_does_is_claimed_by_the_controller_alone_and_ends_the_node(
    store: FleetStore,
) -> None:
    place = store.clusters.cluster_of_node("h1")
    assert place is not None
    store.maintenance.replacing_clusters = frozenset({place[0]})
    store.maintenance.recycle_node(t(1), "h1", "admin", "kernel update")
    [asked] = store.maintenance.start_due_maintenance(t(2))
    assert events(store, "maintenance-asked") == [
        "recycle of node h1 asked of its cluster: the Node is deleted for its node group to replace"
    ]
    assert store.node_operations.claim_node_operations(t(3), ["h1"]) == []  # no agent's
    [operation] = store.node_operations.claim_node_operations(t(3), ["h1"], by_cluster=True)
    assert operation.id == asked
    result = {"summary": "Node h1 deleted in cluster c", "replaced": True}
    store.node_operations.report_node_operation(t(4), asked, state="done", result=result)
    # Gone for its node group to replace: no diagnostics follow, it stays cordoned.
    assert node_state(store, "h1") == (True, None)
    assert events(store, "maintenance-passed")[-1] == (
        "recycle of node h1 passed (Node h1 deleted in cluster c): its node group replaces "
        "it (the new node joins under a name of its own)"
    )
    assert store.maintenance.start_due_maintenance(t(5)) == []
