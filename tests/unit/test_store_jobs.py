"""Jobs in the store against real databases (SQLite and PostgreSQL): what the node agents'
reports do to a job, cancel, and the per-rank logs. The fleet, projects and helpers are
test_store.py's: carol is in nlp (4 A100 guaranteed)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, select

from gpufleet.scheduler.validation import JobRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.jobs import JobSpec, LogChunk, PodReport
from gpufleet.state.models import Allocation, WorkloadState

from .test_store import cycle, make_store, t, workload

NODES = ["a1", "a2", "h1"]
SPEC = JobSpec(
    script="print('hi')", python="/usr/bin/python3", checkpoint_store="/ckpt/{user}/{job}"
)


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def submit(store: FleetStore, gpus: int = 4, per_pod: int | None = 2) -> int:
    request = JobRequest("carol", "nlp", "A100", gpus, per_pod, None, "train")
    job = store.jobs.open_job(t(10), request, SPEC).id
    cycle(store, t(11))
    return job


def report(store: FleetStore, at: float, *reports: PodReport) -> list[int]:
    return store.jobs.agent_sync(t(at), NODES, reports, []).changed


def open_allocations(store: FleetStore, job: int) -> int:
    with store.read() as session:
        return len(
            session.scalars(
                select(Allocation).where(
                    Allocation.workload_id == job, Allocation.closed_at.is_(None)
                )
            ).all()
        )


def test_a_job_is_placed_as_pods_that_the_agent_learns_and_succeeds_when_all_exit_0(
    store: FleetStore,
) -> None:
    job = submit(store)
    assert workload(store, job).state == WorkloadState.admitted
    assert workload(store, job).spec["checkpoint_uri"] == "/ckpt/carol/train"
    desired = store.jobs.desired_pods(NODES)
    assert [(p.pod_index, p.run, p.started, len(p.gpu_uuids)) for p in desired] == [
        (0, True, False, 2),
        (1, True, False, 2),
    ]
    assert len({u for p in desired for u in p.gpu_uuids}) == 4  # no GPU twice
    assert report(store, 12, PodReport(job, 0, "running"), PodReport(job, 1, "running")) == [job]
    assert workload(store, job).state == WorkloadState.running
    assert all(p.started for p in store.jobs.desired_pods(NODES))

    report(store, 13, PodReport(job, 0, "exited", exit_code=0))
    assert workload(store, job).state == WorkloadState.running  # pod 1 still runs
    assert open_allocations(store, job) == 4
    report(store, 14, PodReport(job, 1, "exited", exit_code=0))
    done = workload(store, job)
    assert (done.state, done.outcome) == (WorkloadState.ended, "succeeded")
    assert done.reason == "all 4 rank(s) exited with code 0"
    assert open_allocations(store, job) == 0
    assert store.jobs.desired_pods(NODES) == []


def test_a_failed_pod_stops_the_others_and_the_gpus_wait_until_they_are_gone(
    store: FleetStore,
) -> None:
    job = submit(store)
    report(store, 12, PodReport(job, 0, "running"), PodReport(job, 1, "running"))
    error = "rank 3: torch.OutOfMemoryError: CUDA out of memory"
    report(store, 13, PodReport(job, 1, "exited", exit_code=1, reason=error))
    failing = workload(store, job)
    assert (failing.state, failing.outcome) == (WorkloadState.stopping, "failed")
    assert "pod 1" in failing.reason and f"exited with code 1: {error}" in failing.reason
    assert [(p.pod_index, p.run) for p in store.jobs.desired_pods(NODES)] == [(0, False)]
    assert open_allocations(store, job) == 4  # pod 0 may still run

    report(store, 14, PodReport(job, 0, "stopped", signal=15))
    ended = workload(store, job)
    assert (ended.state, ended.outcome) == (WorkloadState.ended, "failed")
    assert error in ended.reason and "ran out of GPU memory" in ended.reason  # not retried
    assert open_allocations(store, job) == 0


def test_cancel_ends_a_waiting_job_at_once_and_stops_a_placed_one(store: FleetStore) -> None:
    waiting = store.jobs.open_job(t(10), JobRequest("carol", "nlp", "A100", 4, 4, None, ""), SPEC)
    assert workload(store, waiting.id).name == f"job-{waiting.id}"
    store.jobs.cancel_job(t(10.5), waiting.id, "carol")
    assert workload(store, waiting.id).outcome == "cancelled"

    job = submit(store)
    report(store, 12, PodReport(job, 0, "running"))
    store.jobs.cancel_job(t(13), job, "carol")
    stopping = workload(store, job)
    assert stopping.state == WorkloadState.stopping and stopping.reason.startswith("cancelled")
    assert {p.run for p in store.jobs.desired_pods(NODES)} == {False}
    # Pod 1 never started: the agent makes sure nothing of it runs, and says so.
    report(store, 14, PodReport(job, 0, "stopped"), PodReport(job, 1, "stopped"))
    ended = workload(store, job)
    assert (ended.outcome, ended.reason) == ("cancelled", "cancelled by carol; every rank stopped")


def test_a_cancelled_job_the_reconciler_finds_gone_ends_cancelled(store: FleetStore) -> None:
    """The reconciler may see a cancelled job's ranks gone before its agent reports them
    (a slow agent, a busy node): the job ended "stopped" then, as if nobody had cancelled
    it."""
    job = submit(store)
    report(store, 12, PodReport(job, 0, "running"), PodReport(job, 1, "running"))
    store.jobs.cancel_job(t(13), job, "carol")
    version = workload(store, job).version
    said = "its stop was asked and nothing of it runs any more; its GPUs are released"
    store.reconcile.end_reconciled(t(40), job, version, "stopped", "stop-finished", said)
    ended = workload(store, job)
    assert (ended.state, ended.outcome) == (WorkloadState.ended, "cancelled")
    assert ended.reason == "cancelled by carol; every rank stopped"
    assert open_allocations(store, job) == 0


def test_reports_cannot_revive_an_ended_pod_nor_touch_another_agents_pods(
    store: FleetStore,
) -> None:
    job = submit(store)
    report(store, 12, PodReport(job, 0, "running"), PodReport(job, 1, "running"))
    report(store, 13, PodReport(job, 0, "exited", exit_code=0))
    report(store, 14, PodReport(job, 0, "running"))  # late, or repeated: ignored
    assert [p.state for p in store.jobs.job_pods(job)] == ["exited", "running"]
    # An agent of other nodes reports pod 1 gone: not its pod, not its say.
    store.jobs.agent_sync(t(15), ["h1"], [PodReport(job, 1, "exited", exit_code=0)], [])
    assert workload(store, job).state == WorkloadState.running


def test_output_resent_longer_after_an_agent_restart_is_stored_whole(
    store: FleetStore,
) -> None:
    """The old agent's chunks were stored but their answer lost when it died; the agent
    that takes the pod over resends from the last acknowledged offset, in one longer chunk
    cut elsewhere. Before, a chunk at an offset already stored was dropped whole, and the
    bytes it held past the stored chunk were lost from the log."""
    job = submit(store)
    store.jobs.agent_sync(t(12), NODES, [], [LogChunk(job, 0, "stdout", 0, "step 0\n")])
    lost_answer = [
        LogChunk(job, 0, "stdout", 7, "step 1\n"),
        LogChunk(job, 0, "stdout", 14, "step 2 ✓\n"),
    ]
    store.jobs.agent_sync(t(13), NODES, [], lost_answer)
    resent = LogChunk(job, 0, "stdout", 7, "step 1\nstep 2 ✓\nstep 3\nstep 4\n")
    store.jobs.agent_sync(t(14), NODES, [], [resent])
    store.jobs.agent_sync(t(15), NODES, [], [LogChunk(job, 0, "stdout", 39, "step 5\n")])
    whole = store.jobs.read_log(job, 0, "stdout", 0, 1 << 20)
    assert whole.data == "step 0\nstep 1\nstep 2 ✓\nstep 3\nstep 4\nstep 5\n"
    assert whole.next_offset == len(whole.data.encode()) == store.jobs.log_size(job, 0, "stdout")
    # The same resend again, or a shorter one, adds nothing.
    store.jobs.agent_sync(t(16), NODES, [], [resent, LogChunk(job, 0, "stdout", 7, "step")])
    assert store.jobs.read_log(job, 0, "stdout", 0, 1 << 20).data == whole.data


def test_log_chunks_are_stored_once_and_read_from_any_offset(store: FleetStore) -> None:
    job = submit(store)
    first = LogChunk(job, 0, "stdout", 0, "step 1\n")
    second = LogChunk(job, 0, "stdout", 7, "step 2 ✓\n")
    store.jobs.agent_sync(t(12), NODES, [], [first, second])
    store.jobs.agent_sync(t(13), NODES, [], [second])  # sent again: the answer was lost
    whole = store.jobs.read_log(job, 0, "stdout", 0, 1 << 20)
    assert whole.data == "step 1\nstep 2 ✓\n"
    assert whole.next_offset == len(whole.data.encode()) == store.jobs.log_size(job, 0, "stdout")
    assert store.jobs.read_log(job, 0, "stdout", 3, 1 << 20).data == "p 1\nstep 2 ✓\n"
    assert store.jobs.read_log(job, 0, "stdout", whole.next_offset, 1 << 20).data == ""
    # A chunk past a gap waits for the gap to be filled.
    store.jobs.agent_sync(t(14), NODES, [], [LogChunk(job, 0, "stdout", 100, "later")])
    assert store.jobs.read_log(job, 0, "stdout", whole.next_offset, 1 << 20).data == ""
    assert store.jobs.read_log(job, 1, "stdout", 0, 1 << 20).data == ""  # other ranks apart
