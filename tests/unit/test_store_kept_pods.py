"""A restart that keeps a gang's healthy pods (``state/kept_pods.py``, ``AttemptStore.
_restart_keeping``), on SQLite and PostgreSQL: a Kubernetes job whose pod is deleted or
whose node is lost comes back as its next attempt at once, its other pods kept on their
nodes and only the lost one placed anew, empty nodes first; where the zone has no room,
the whole gang stops and restarts through the queue as before; and a cycle planned
before such a restart never hands out the GPUs it took.

The fleet: cluster-a's zone-a holds a-gpu-1, a-gpu-2, a-gpu-3 (2 A100 each), zone-b holds
b-gpu-1; carol's 2-pod × 2-GPU job runs in nlp (4 A100 guaranteed)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, select

from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import JobRequest
from gpufleet.state.clusters import ClusterNodeState
from gpufleet.state.cycle import Outcome
from gpufleet.state.fleet import FleetStore
from gpufleet.state.jobs import DesiredPod, PodReport
from gpufleet.state.models import Allocation, Gpu, WorkloadState

from .test_cluster_inventory_store import state
from .test_store import GROUPS, PRIORITY_CLASSES, PROFILES, PROJECTS, T0, ask, events, t, workload
from .test_store_jobs import SPEC

ZONE_A = ("a-gpu-1", "a-gpu-2", "a-gpu-3")
NODES = (*ZONE_A, "b-gpu-1")
NOW = Policy(min_run_time_s=0)


def node(name: str) -> ClusterNodeState:
    return state(name, "zone-b" if name.startswith("b-") else "zone-a", gpus=2)


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(T0, PROJECTS, PROFILES, PRIORITY_CLASSES)
    store.projects.sync_memberships(T0, GROUPS)
    store.clusters.sync_cluster_nodes(
        t(1), "cluster-a", [node(n) for n in NODES], complete=True, context="a"
    )
    return store


def sync(store: FleetStore, at: float, *reports: PodReport) -> list[DesiredPod]:
    return store.jobs.agent_sync(t(at), NODES, reports, [], kubernetes=True).desired


def running_job(store: FleetStore) -> tuple[int, dict[int, str]]:
    """Carol's job, admitted and running: its id and where each pod runs."""
    request = JobRequest("carol", "nlp", "A100", 4, 2, None, "train")
    job = store.jobs.open_job(t(10), request, SPEC).id
    store.scheduling.scheduling_cycle(t(11), NOW)
    sync(store, 12, *(PodReport(job, i, "running") for i in range(2)))
    assert workload(store, job).state == WorkloadState.running
    return job, {p.pod_index: p.node for p in sync(store, 13) if p.workload_id == job}


def open_gpus(store: FleetStore, job: int) -> dict[int, set[str]]:
    with store.read() as session:
        rows = session.execute(
            select(Allocation.pod_index, Allocation.gpu_uuid).where(
                Allocation.workload_id == job, Allocation.closed_at.is_(None)
            )
        ).all()
    held: dict[int, set[str]] = {}
    for index, uuid in rows:
        held.setdefault(index, set()).add(uuid)
    return held


def test_a_deleted_pod_is_placed_anew_and_the_other_keeps_its_node(store: FleetStore) -> None:
    job, where = running_job(store)
    before = open_gpus(store, job)
    first_marker = workload(store, job).process_marker
    desired = sync(
        store,
        20,
        PodReport(job, 1, "failed", reason="pod gf-job-1-a1-1 was deleted", cause="Deleted"),
    )
    restarted = workload(store, job)
    assert (restarted.state, restarted.attempt) == (WorkloadState.running, 2)
    assert restarted.outcome is None and restarted.process_marker != first_marker
    pods = {p.pod_index: p for p in desired if p.workload_id == job}
    # Pod 0 is the one that ran: kept, not to be created, named after attempt 1.
    assert (pods[0].node, pods[0].kept, pods[0].started) == (where[0], True, True)
    assert (pods[0].attempt, pods[0].created_attempt, pods[0].run) == (2, 1, True)
    # Pod 1 is new, in the zone, on GPUs nothing else holds; the marker is new too.
    assert pods[1].node in ZONE_A and pods[1].node != where[0]
    assert not pods[1].kept and not pods[1].started and pods[1].created_attempt == 2
    after = open_gpus(store, job)
    assert after[0] == before[0] and len(after[1]) == 2
    assert pods[0].marker == pods[1].marker == restarted.process_marker
    [said] = events(store, "job-restarting")
    assert "pods 0 keep their nodes and run it in place" in said
    assert f"pod 1 on {pods[1].node} is placed anew" in said
    # The old attempt's late reports change nothing; the new pod's start is attempt 2's.
    sync(store, 21, PodReport(job, 0, "exited", exit_code=1, attempt=1))
    assert workload(store, job).state == WorkloadState.running
    sync(store, 22, PodReport(job, 1, "running", attempt=2))
    assert workload(store, job).state == WorkloadState.running


def test_a_pod_of_a_lost_node_is_replaced_and_its_gpus_wait_for_what_may_run(
    store: FleetStore,
) -> None:
    job, where = running_job(store)
    lost_gpus = open_gpus(store, job)[0]
    store.jobs.lose_cluster_node(t(20), where[0], "is not Ready (kubelet stopped posting)")
    restarted = workload(store, job)
    assert (restarted.state, restarted.attempt) == (WorkloadState.running, 2)
    pods = {p.pod_index: p for p in sync(store, 21) if p.workload_id == job}
    assert pods[1].kept and pods[1].node == where[1]
    assert pods[0].node in ZONE_A and pods[0].node not in (where[0],)
    with store.read() as session:
        held = session.scalars(
            select(Gpu.uuid).where(
                Gpu.leftover_workload_id == job, Gpu.leftover_marker.is_not(None)
            )
        ).all()
    assert set(held) == lost_gpus  # not free while the lost pod may still run


def test_without_room_in_the_zone_the_whole_gang_restarts_through_the_queue(
    store: FleetStore,
) -> None:
    job, where = running_job(store)
    alice = ask(store, t(14), "alice", gpus=2)  # vision's 2 A100 take the zone's last node
    store.scheduling.scheduling_cycle(t(15), NOW)
    assert workload(store, alice).state == WorkloadState.admitted
    store.jobs.lose_cluster_node(t(20), where[0], "was deleted")
    stopped = workload(store, job)
    assert (stopped.state, stopped.attempt) == (WorkloadState.stopping, 1)
    assert events(store, "job-restarting") == []


def test_a_cycle_planned_before_the_restart_does_not_hand_out_its_gpus(
    store: FleetStore,
) -> None:
    job, _ = running_job(store)
    alice = ask(store, t(14), "alice", gpus=2)  # would take the zone's empty node
    planned = store.scheduling.plan_cycle(t(15), NOW)
    assert planned.allocations
    # Its GPUs stay held (its node is in doubt): the replacement takes the empty node.
    sync(store, 16, PodReport(job, 1, "failed", reason="its node is lost", cause="NodeLost"))
    assert workload(store, job).attempt == 2
    assert not store.scheduling.commit_cycle(planned)  # dropped: its nodes changed
    store.scheduling.settle_cycle(Outcome.DROPPED)
    store.scheduling.scheduling_cycle(t(17), NOW)
    with store.read() as session:
        held = session.execute(
            select(Allocation.gpu_uuid, Allocation.workload_id).where(
                Allocation.closed_at.is_(None)
            )
        ).all()
    uuids = [uuid for uuid, _ in held]
    assert len(uuids) == len(set(uuids)) == 6  # no GPU twice
    assert {u for u, w in held if w == alice} == {
        "k8s/cluster-a/b-gpu-1/0",
        "k8s/cluster-a/b-gpu-1/1",
    }  # planned again: the other zone


def test_a_pod_kept_twice_keeps_the_name_of_the_attempt_that_made_it(store: FleetStore) -> None:
    job, _ = running_job(store)
    gone = "deleted by someone other than gpufleet"
    sync(store, 20, PodReport(job, 1, "failed", reason=gone, cause="Deleted"))
    sync(store, 21, PodReport(job, 1, "running", attempt=2))
    desired = sync(store, 22, PodReport(job, 1, "failed", reason=gone, cause="Deleted", attempt=2))
    assert workload(store, job).attempt == 3
    made_by = {p.pod_index: p.created_attempt for p in desired if p.workload_id == job}
    assert made_by == {0: 1, 1: 3}


def test_a_gang_whose_other_pod_ends_in_the_same_report_keeps_none(store: FleetStore) -> None:
    """The other pod's end may be its ranks' own error: nothing is kept that has ended."""
    job, _ = running_job(store)
    sync(
        store,
        20,
        PodReport(job, 0, "failed", reason="deleted", cause="Deleted"),
        PodReport(job, 1, "exited", exit_code=1, reason="rank 3: RuntimeError: peer lost"),
    )
    # Both ended: the attempt is over, and the next waits in the queue, whole.
    after = workload(store, job)
    assert (after.state, after.attempt) == (WorkloadState.pending, 2)
    assert not any("kept" in said for said in events(store, "job-failed"))
