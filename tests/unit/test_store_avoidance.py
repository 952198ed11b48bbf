"""What a job's next attempts avoid, against real databases (SQLite and PostgreSQL): the
GPUs and nodes its faults blamed, only until they pass maintenance; and a waiting attempt
whose avoided hardware is what keeps it out is told so. test_store.py's fleet: a1 (4
A100), a2 (2 A100), h1 (2 H100), all in zone-a."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, select

from gpufleet.state.fleet import FleetStore
from gpufleet.state.jobs import PodReport
from gpufleet.state.models import Allocation, WorkloadState

from .test_store import events, make_store, t, workload
from .test_store_attempts import NOW_POLICY, placed_on, running, submit
from .test_store_jobs import report
from .test_store_maintenance import agent_runs


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def held(store: FleetStore, job: int) -> list[str]:
    with store.read() as session:
        return sorted(
            session.scalars(
                select(Allocation.gpu_uuid).where(
                    Allocation.workload_id == job, Allocation.closed_at.is_(None)
                )
            )
        )


def avoided(store: FleetStore, job: int) -> tuple[list[str], list[str]]:
    recovery = workload(store, job).recovery or {}
    return recovery.get("avoid_nodes", []), recovery.get("avoid_gpus", [])


def faulted_on_a2_then_running_on_a1(store: FleetStore) -> int:
    """A 2-GPU job whose GPU-a2-1 raised XID 48 (reset due): attempt 2 runs on a1."""
    job = submit(store, 10, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-1", 48)
    store.jobs.act_on_xid(t(13), "GPU-a2-1", 48)
    report(store, 14, PodReport(job, 0, "stopped", signal=15))
    assert avoided(store, job) == ([], ["GPU-a2-1"])
    store.scheduling.scheduling_cycle(t(15), NOW_POLICY)  # a2 has one usable GPU: a1 it is
    assert placed_on(store, job) == {"a1"}
    running(store, 16, job, pods=1, attempt=2)
    return job


def test_a_restart_lands_at_once_on_a_gpu_whose_reset_passed_since_its_fault(
    store: FleetStore,
) -> None:
    job = faulted_on_a2_then_running_on_a1(store)
    # Nothing holds GPU-a2-1 any more: its reset runs and passes.
    assert len(store.maintenance.start_due_maintenance(t(17))) == 1
    agent_runs(store, 18, "a2")
    assert events(store, "maintenance-passed") == [
        f"reset of GPU GPU-a2-1 of node a2 passed: it takes work again; job {job} no longer "
        "avoids it"
    ]
    assert avoided(store, job) == ([], [])
    # A drain of a1 sends the job back: a2's two GPUs, the reset one among them, take it.
    store.jobs.drain_node(t(19), "a1", "admin", "firmware")
    report(store, 20, PodReport(job, 0, "stopped", signal=15, attempt=2))
    assert workload(store, job).state == WorkloadState.pending
    store.scheduling.scheduling_cycle(t(21), NOW_POLICY)
    assert workload(store, job).state == WorkloadState.admitted
    assert held(store, job) == ["GPU-a2-0", "GPU-a2-1"]


def test_a_node_that_passed_its_recycle_and_diagnostics_is_no_longer_avoided(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-0", 79)
    store.jobs.act_on_xid(t(13), "GPU-a2-0", 79)
    report(store, 14, PodReport(job, 0, "stopped", signal=15))
    assert avoided(store, job) == (["a2"], [])
    store.scheduling.scheduling_cycle(t(25), NOW_POLICY)  # after the back-off: on a1
    assert placed_on(store, job) == {"a1"}
    store.maintenance.start_due_maintenance(t(26))
    agent_runs(store, 27, "a2")  # the recycle passes: the node is still out
    assert avoided(store, job) == (["a2"], [])
    store.maintenance.start_due_maintenance(t(28))
    agent_runs(store, 29, "a2")  # and its diagnostics
    assert avoided(store, job) == ([], [])


def test_an_admins_uncordon_is_no_maintenance_and_the_reason_names_the_avoided_gpu(
    store: FleetStore,
) -> None:
    job = faulted_on_a2_then_running_on_a1(store)
    # The uncordon cancels the reset: nothing showed GPU-a2-1 healthy, so it stays avoided.
    store.nodes.set_cordoned(t(17), "a2", False, by="admin")
    store.jobs.drain_node(t(19), "a1", "admin", "firmware")
    report(store, 20, PodReport(job, 0, "stopped", signal=15, attempt=2))
    store.scheduling.scheduling_cycle(t(21), NOW_POLICY)
    waiting = workload(store, job)
    assert waiting.state == WorkloadState.pending
    assert waiting.reason == (
        "Waiting for 2 GPUs on one node: node a2 has 2 × A100 free, but one of them, "
        "GPU-a2-1, failed this job before and is avoided; the most it may use on one node "
        "is 1 × A100, in zone-a; within project nlp's guarantee (0/4 used)"
    )
