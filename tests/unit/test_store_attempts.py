"""A job's attempts in the store against real databases (SQLite and PostgreSQL): a fault
or a preemption sends the job back to the queue as its next attempt, with its place, its
exclusions, its checkpoint and its log; an XID stops the job on the GPU at once. The
fleet is test_store.py's: a1 (4 A100), a2 (2 A100), h1 (2 H100); carol is in nlp (4 A100
guaranteed), alice in vision (2)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from prometheus_client import generate_latest
from sqlalchemy import Engine, select

from gpufleet.hub.metrics import ControllerMetrics
from gpufleet.recovery.attempts import RetryPolicy
from gpufleet.scheduler.errors import NotFound
from gpufleet.scheduler.snapshot import Policy
from gpufleet.scheduler.validation import JobRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.jobs import LogChunk, PodReport
from gpufleet.state.models import (
    Allocation,
    Event,
    Gpu,
    JobProgress,
    Node,
    WorkloadState,
)
from gpufleet.state.progress import (
    ProgressReport,
    Saved,
    progress_json,
    training_ratio,
)

from ..exposition import parse
from .test_store import ask, events, make_store, t, workload
from .test_store_jobs import NODES, SPEC, open_allocations, report

NOW_POLICY = Policy(min_run_time_s=0)
CHECKPOINT = "/ckpt/carol/train/step-40"


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def submit(store: FleetStore, at: float, gpus: int = 4, per_pod: int = 2) -> int:
    request = JobRequest("carol", "nlp", "A100", gpus, per_pod, None, "train")
    job = store.jobs.open_job(t(at), request, SPEC).id
    store.scheduling.scheduling_cycle(t(at + 1), NOW_POLICY)
    return job


def running(store: FleetStore, at: float, job: int, pods: int = 2, attempt: int = 1) -> None:
    report(store, at, *(PodReport(job, p, "running", attempt=attempt) for p in range(pods)))
    assert workload(store, job).state == WorkloadState.running


def checkpointed(store: FleetStore, at: float, job: int) -> None:
    saved = Saved(CHECKPOINT, 40, t(at))
    store.jobs.agent_sync(t(at), NODES, [], [], [ProgressReport(job, 0, checkpoints_saved=[saved])])


def placed_on(store: FleetStore, job: int) -> set[str]:
    return {p.node for p in store.jobs.desired_pods(NODES) if p.workload_id == job}


def test_an_unexplained_failure_comes_back_as_the_next_attempt_after_its_back_off(
    store: FleetStore,
) -> None:
    job = submit(store, 10)
    first = workload(store, job)
    running(store, 12, job)
    checkpointed(store, 13, job)
    store.jobs.agent_sync(t(13), NODES, [], [], [ProgressReport(job, 0, step=45, step_at=t(13))])
    store.jobs.agent_sync(t(13), NODES, [], [LogChunk(job, 0, "stdout", 0, "step 40\n")])
    report(store, 14, PodReport(job, 1, "exited", exit_code=1, reason="rank 3: Killed"))
    assert workload(store, job).state == WorkloadState.stopping
    assert open_allocations(store, job) == 4  # pod 0 may still run
    result = store.jobs.agent_sync(t(15), NODES, [PodReport(job, 0, "stopped", signal=15)], [])
    assert result.restarted == ["unknown"] and result.ended == []

    again = workload(store, job)
    assert (again.state, again.attempt, again.faults) == (WorkloadState.pending, 2, 1)
    assert again.created_at == first.created_at  # its place in the queue
    assert again.process_marker != first.process_marker
    assert again.not_before == t(25)  # 10 s of back-off after the first fault
    assert open_allocations(store, job) == 0 and store.jobs.job_pods(job) == []
    [restarting] = events(store, "job-restarting")
    assert restarting.endswith(
        f"attempt 2, resumes from {CHECKPOINT}, after 10 s of back-off, infrastructure "
        "fault 1 of 3 allowed within 24 h"
    )

    # It waits out its back-off, then starts again from its checkpoint.
    store.scheduling.scheduling_cycle(t(20), NOW_POLICY)
    assert workload(store, job).state == WorkloadState.pending
    assert workload(store, job).reason == "attempt 2 waits for its back-off (10 s)"
    store.scheduling.scheduling_cycle(t(26), NOW_POLICY)
    assert workload(store, job).state == WorkloadState.admitted
    desired = store.jobs.desired_pods(NODES)
    assert {(p.attempt, p.resume_from, p.started) for p in desired} == {(2, CHECKPOINT, False)}

    # What comes late from the first attempt changes nothing.
    report(store, 27, PodReport(job, 0, "exited", exit_code=1, attempt=1))
    assert workload(store, job).state == WorkloadState.admitted
    store.jobs.agent_sync(t(27), NODES, [], [LogChunk(job, 0, "stdout", 8, "stale\n", attempt=1)])
    # The log goes on where the first attempt's ended, after a line that says why.
    running(store, 28, job, attempt=2)
    # Its first step counts though the checkpoint it resumed from is older than the steps
    # attempt 1 reported; and how long the job took from the fault to it is measured.
    first_step = ProgressReport(job, 0, step=41, step_at=t(30))
    result = store.jobs.agent_sync(t(30), NODES, [], [], [first_step])
    assert result.resumed_after_s == [16.0]  # the pod failed at t(14)
    with store.read() as session:
        assert session.get(JobProgress, job).last_step == 41  # type: ignore[union-attr]
    store.jobs.agent_sync(t(29), NODES, [], [LogChunk(job, 0, "stdout", 0, "step 41\n", attempt=2)])
    log = store.jobs.read_log(job, 0, "stdout", 0, 1 << 20).data
    assert log.startswith("step 40\n--- gpufleet: attempt 2: the pod ended (exit 1)")
    assert log.endswith("allowed within 24 h ---\nstep 41\n") and "stale" not in log


def test_the_fault_past_the_budget_ends_the_job_saying_why(store: FleetStore) -> None:
    store.jobs.retry_policy = RetryPolicy(fault_budget=0)
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    report(store, 13, PodReport(job, 0, "exited", exit_code=1, reason="rank 1: Killed"))
    ended = workload(store, job)
    assert (ended.state, ended.outcome) == (WorkloadState.ended, "failed")
    assert ended.reason == (
        "pod 0 on a2 exited with code 1: rank 1: Killed; the pod ended (exit 1) with nothing "
        "to explain it: the job restarts and spends one attempt of its retry budget; not "
        "retried: this is infrastructure fault 1 of the job within 24 h, and it restarts from at "
        "most 0"
    )


def test_a_users_error_is_not_retried_and_the_reason_says_what_to_fix(store: FleetStore) -> None:
    job = submit(store, 10)
    running(store, 12, job)
    failure = PodReport(job, 1, "exited", exit_code=1, reason="rank 3: ValueError: lr < 0")
    report(store, 13, failure, PodReport(job, 0, "stopped", signal=15))
    ended = workload(store, job)
    assert (ended.state, ended.outcome, ended.attempt) == (WorkloadState.ended, "failed", 1)
    assert ended.reason.endswith(
        "rank 3 raised ValueError: lr < 0 in the job's code: not retried; fix the error and "
        "submit again"
    )
    assert events(store, "job-restarting") == []


def test_a_preempted_job_comes_back_by_itself_spending_nothing(store: FleetStore) -> None:
    # carol holds nlp's guarantee with a session; her job borrows a2 beyond it.
    ask(store, t(1), "carol", project="nlp", gpus=4)
    job = submit(store, 2, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 4, job, pods=1)
    checkpointed(store, 5, job)
    alice = ask(store, t(6), "alice", gpus=2)  # within vision's guarantee: a2 is reclaimed
    store.scheduling.scheduling_cycle(t(7), NOW_POLICY)
    assert workload(store, job).preempted_for_id == alice
    report(store, 8, PodReport(job, 0, "stopped", signal=15))

    back = workload(store, job)
    assert (back.state, back.attempt, back.faults, back.not_before) == (
        WorkloadState.pending,
        2,
        0,
        None,
    )
    assert events(store, "job-restarting")[0].endswith(
        f"attempt 2, resumes from {CHECKPOINT}, no fault counted"
    )
    store.scheduling.refresh_mirror(t(8))
    assert not store.scheduling.mirror.pending[job].recovering  # a preemption: no recovery spare
    store.scheduling.scheduling_cycle(t(9), NOW_POLICY)
    assert workload(store, alice).state == WorkloadState.admitted
    assert workload(store, job).state == WorkloadState.pending  # no room while alice runs
    store.workloads.end(t(10), alice, "stopped", "the server stopped")
    store.scheduling.scheduling_cycle(t(11), NOW_POLICY)
    assert workload(store, job).state == WorkloadState.admitted
    assert {p.resume_from for p in store.jobs.desired_pods(NODES)} == {CHECKPOINT}


def test_an_xid_79_stops_the_job_at_once_cordons_the_node_and_the_restart_avoids_it(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 12, job, pods=1)
    assert store.nodes.record_xid(t(13), "agent-1", "GPU-a2-0", 79)
    assert store.jobs.act_on_xid(t(13), "GPU-a2-0", 79) == [job]
    stopping = workload(store, job)
    assert stopping.state == WorkloadState.stopping
    assert stopping.reason.startswith("XID 79 on GPU GPU-a2-0")
    assert [p.run for p in store.jobs.desired_pods(NODES)] == [False]  # the agent stops its ranks
    assert events(store, "node-cordoned")[-1].startswith(
        "node a2 cordoned by the recovery loop: XID 79"
    )
    report(store, 14, PodReport(job, 0, "stopped", signal=15))
    back = workload(store, job)
    assert (back.state, back.attempt, back.faults) == (WorkloadState.pending, 2, 1)
    assert back.recovery is not None and back.recovery["avoid_nodes"] == ["a2"]
    # While a2 is cordoned the scheduler need not know: the request keeps the whole
    # policy (a particular one neither holds a zone nor preempts).
    store.scheduling.refresh_mirror(t(25))  # its back-off is over
    assert not store.scheduling.mirror.pending[job].particular
    assert store.scheduling.mirror.pending[
        job
    ].recovering  # a fault: it may use the recovery spares
    # An admin's uncordon returns a2, but this job's attempts still keep off it.
    store.nodes.set_cordoned(t(26), "a2", False, by="admin")
    store.scheduling.refresh_mirror(t(26))
    assert store.scheduling.mirror.pending[job].avoid_nodes == {"a2"}
    store.scheduling.scheduling_cycle(t(30), NOW_POLICY)
    assert workload(store, job).state == WorkloadState.admitted
    assert placed_on(store, job) == {"a1"}


def test_a_gpu_hardware_xid_cordons_the_gpu_alone(store: FleetStore) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-1", 48)
    assert store.jobs.act_on_xid(t(13), "GPU-a2-1", 48) == [job]
    report(store, 14, PodReport(job, 0, "stopped", signal=15))
    assert workload(store, job).recovery["avoid_gpus"] == ["GPU-a2-1"]  # type: ignore[index]
    # a2 keeps one usable GPU, nobody gets GPU-a2-1, and a 1-GPU session lands on a2.
    session = ask(store, t(30), "carol", server="one", project="nlp", gpus=1)
    store.scheduling.scheduling_cycle(t(31), NOW_POLICY)
    with store.read() as read:
        held = read.scalars(select(Allocation.gpu_uuid).where(Allocation.workload_id == session))
        assert list(held) == ["GPU-a2-0"]
        fault_events = read.scalars(select(Event.kind).where(Event.workload_id == job)).all()
    assert "job-fault" in fault_events
    # One fault: drained and reset (cordoned), not the lemon list.
    assert events(store, "gpu-cordoned")[0].startswith("GPU GPU-a2-1 (index 1) of node a2")
    assert events(store, "gpu-lemon") == []
    # An XID on a GPU nobody holds still takes it out of service, and changes no workload.
    assert store.jobs.act_on_xid(t(40), "GPU-a1-3", 79) == []
    assert events(store, "node-cordoned")[-1].startswith("node a1 cordoned by the recovery")
    assert store.jobs.act_on_xid(t(40), "GPU-nowhere", 79) == []


def test_a_job_that_stops_stepping_is_stopped_as_hung_and_its_restart_is_not_judged_by_steps(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    step = ProgressReport(job, 0, step=5, step_at=t(20), step_times_s=[1.0] * 20)
    store.jobs.agent_sync(t(20), NODES, [], [], [step])
    assert store.jobs.stop_hung_jobs(t(619)) == []  # 599 s without a step: within the floor
    assert store.jobs.stop_hung_jobs(t(621)) == [job]
    hung = workload(store, job)
    assert hung.state == WorkloadState.stopping
    assert hung.reason == (
        "no progress reported for 601 s (limit 600 s): the job is killed and restarts"
    )
    report(store, 622, PodReport(job, 0, "stopped", signal=15))
    assert (workload(store, job).attempt, workload(store, job).faults) == (2, 1)
    store.scheduling.scheduling_cycle(t(700), NOW_POLICY)
    running(store, 701, job, pods=1, attempt=2)
    # No step of its own yet: an attempt loading its checkpoint is not hung after 600 s.
    assert store.jobs.stop_hung_jobs(t(1400)) == []


def test_a_job_whose_step_counter_restarts_every_epoch_is_not_hung(store: FleetStore) -> None:
    # 1,000 steps an epoch, numbered from 0 in each, one a second; a report every 10 s.
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    for second in range(20, 1730, 10):
        epoch, step = divmod(second - 20, 1000)
        report = ProgressReport(job, 0, step, t(second), [1.0] * 10, epoch=epoch)
        store.jobs.agent_sync(t(second), NODES, [], [], [report])
        assert store.jobs.stop_hung_jobs(t(second + 5)) == [], second
    # Then it stops reporting: hung once the floor has passed since its last report.
    assert store.jobs.stop_hung_jobs(t(1720 + 600)) == []
    assert store.jobs.stop_hung_jobs(t(1720 + 601)) == [job]


def test_a_job_that_reports_progress_without_numbers_is_judged_by_when_it_reports(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    for second in (20, 500, 1000):
        report = ProgressReport(job, 0, step_at=t(second), metrics={"loss": 1.0})
        store.jobs.agent_sync(t(second), NODES, [], [], [report])
    # Its GPUs idle and it writes nothing, but it reports: not hung (it was before, as a
    # job that never reports: silent for job_silent_idle_seconds).
    assert store.jobs.stop_hung_jobs(t(1599)) == []
    assert store.jobs.stop_hung_jobs(t(1601)) == [job]
    assert workload(store, job).reason.startswith("no progress reported for 601 s")


def test_checkpoints_are_counted_by_attempt_and_the_resumed_one_is_named_in_the_restart(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    checkpointed(store, 13, job)
    report(store, 14, PodReport(job, 0, "exited", exit_code=1, reason="rank 1: Killed"))
    [restarting] = events(store, "job-restarting")
    assert f"resumes from {CHECKPOINT}" in restarting
    store.scheduling.scheduling_cycle(t(30), NOW_POLICY)
    running(store, 31, job, pods=1, attempt=2)
    for at, step in ((40, 50), (50, 60)):
        saved = Saved(f"/ckpt/carol/train/step-{step}", step, t(at))
        store.jobs.agent_sync(
            t(at), NODES, [], [], [ProgressReport(job, 0, checkpoints_saved=[saved])]
        )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None
        shown = progress_json(row)
    assert shown["checkpoints_saved"] == 3
    assert shown["checkpoints_saved_by_attempt"] == {1: 1, 2: 2}
    assert events(store, "job-checkpoint-saved") == []


def test_a_drain_cordons_the_node_stops_its_sessions_and_restarts_its_jobs_elsewhere(
    store: FleetStore,
) -> None:
    # Best fit puts both on a2 (2 A100): carol's 1-GPU session and her 1-GPU job.
    session = ask(store, t(1), "carol", project="nlp", gpus=1)
    job = submit(store, 2, gpus=1, per_pod=1)
    assert placed_on(store, job) == {"a2"}
    running(store, 4, job, pods=1)
    store.workloads.mark_running(t(4), session)
    drained = store.jobs.drain_node(t(5), "a2", "admin", "firmware update")
    said = "node a2 drained by admin: firmware update"
    assert events(store, "node-drained") == [said]
    assert set(drained.changed) == {job, session}
    assert [(s.workload_id, s.reason) for s in drained.sessions] == [(session, said)]
    assert workload(store, session).state == WorkloadState.stopping
    assert workload(store, session).reason == f"{said}; the session is snapshotted and stops"
    stopping = workload(store, job)
    assert stopping.state == WorkloadState.stopping and stopping.reason.startswith(said)
    # An admin's operation, not a fault: an event of its own, saying who drained which node.
    with store.read() as read:
        [drained_job] = read.scalars(
            select(Event).where(Event.workload_id == job, Event.kind == "job-drained")
        ).all()
        kinds = read.scalars(select(Event.kind).where(Event.workload_id == job)).all()
    assert "job-fault" not in kinds
    assert drained_job.message == (
        f"attempt 1: {said}; every rank gets the checkpoint signal, and the job restarts on "
        "another node without spending its retry budget"
    )
    assert (drained_job.at, drained_job.node, drained_job.cause) == (t(5), "a2", "admin")
    assert drained_job.data == {"attempt": 1, "node": "a2", "by": "admin", "why": "firmware update"}
    # The job restarts at once, spending nothing, and not on the cordoned node.
    report(store, 6, PodReport(job, 0, "stopped", signal=15))
    back = workload(store, job)
    assert (back.state, back.attempt, back.faults, back.not_before) == (
        WorkloadState.pending,
        2,
        0,
        None,
    )
    store.scheduling.scheduling_cycle(t(7), NOW_POLICY)
    assert placed_on(store, job) == {"a1"}
    with pytest.raises(NotFound, match="there is no node 'nowhere'"):
        store.jobs.drain_node(t(8), "nowhere", "admin", "")


def test_a_job_cancelled_while_it_stops_for_a_fault_ends_instead_of_coming_back(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.record_xid(t(13), "agent-1", "GPU-a2-0", 79)
    store.jobs.act_on_xid(t(13), "GPU-a2-0", 79)
    store.jobs.cancel_job(t(14), job, "carol")
    report(store, 15, PodReport(job, 0, "stopped", signal=15))
    ended = workload(store, job)
    assert (ended.state, ended.outcome, ended.attempt) == (WorkloadState.ended, "cancelled", 1)
    # And one waiting out its back-off ends at once.
    again = submit(store, 20, gpus=2)
    running(store, 22, again, pods=1)
    report(store, 23, PodReport(again, 0, "exited", exit_code=1))
    assert workload(store, again).state == WorkloadState.pending
    store.jobs.cancel_job(t(24), again, "carol")
    assert workload(store, again).outcome == "cancelled"


def test_the_breaker_stops_automated_cordons_past_half_the_cluster_until_reset(
    store: FleetStore,
) -> None:
    # a1, a2 and h1 are the cluster "local": the loop may cordon one of them (1.5 is half).
    assert store.jobs.act_on_xid(t(10), "GPU-a1-0", 79) == []
    assert workload_node(store, "a1").cordoned
    store.jobs.act_on_xid(t(20), "GPU-a2-0", 79)
    assert not workload_node(store, "a2").cordoned
    [tripped] = events(store, "recovery-breaker-tripped")
    assert tripped.startswith(
        "the recovery loop stops cordoning nodes of cluster local: 1 of its 3 node(s) were "
        "cordoned by it within 300 s, and one more would pass 50%"
    )
    assert store.jobs.breakers() == {"local": t(20)}
    store.jobs.act_on_xid(t(30), "GPU-h1-0", 79)  # open: held back, said again
    assert not workload_node(store, "h1").cordoned
    assert len(events(store, "recovery-cordon-withheld")) == 2
    # People still cordon; an admin's reset and uncordon let the loop act again.
    assert store.nodes.set_cordoned(t(40), "a1", False, by="admin")
    assert store.jobs.reset_breaker(t(41), "local", "admin") and store.jobs.breakers() == {
        "local": None
    }
    assert not store.jobs.reset_breaker(t(42), "local", "admin")
    store.jobs.act_on_xid(t(43), "GPU-a2-0", 79)
    assert workload_node(store, "a2").cordoned
    with pytest.raises(NotFound, match="there is no cluster 'elsewhere'"):
        store.jobs.reset_breaker(t(44), "elsewhere", "admin")


def workload_node(store: FleetStore, name: str) -> Node:
    with store.read() as session:
        found = session.scalar(select(Node).where(Node.name == name))
        assert found is not None
        return found


def health_metric(store: FleetStore) -> dict[str, str]:
    """Each GPU's ``state`` in the controller's ``gpufleet_gpu_health`` (one series each)."""
    scraped = parse(generate_latest(ControllerMetrics(store).registry).decode())
    states = [labels for labels, value in scraped.samples["gpufleet_gpu_health"] if value == 1]
    assert len(states) == len({s["UUID"] for s in states})
    return {labels["UUID"]: labels["state"] for labels in states}


def test_a_gpus_second_hardware_fault_in_a_week_puts_it_on_the_lemon_list(
    store: FleetStore,
) -> None:
    assert health_metric(store)["GPU-a1-2"] == "healthy"
    verdicts = []
    for day in (0, 3):  # XID 48 (double-bit ECC) on the same GPU, three days apart
        at = t(10 + day * 86400)
        assert store.nodes.record_xid(at, "agent-1", "GPU-a1-2", 48)
        store.jobs.act_on_xid(at, "GPU-a1-2", 48)
        verdicts.append(health_metric(store)["GPU-a1-2"])
    assert verdicts == ["cordoned", "lemon"]
    [lemon] = events(store, "gpu-lemon")
    assert lemon.startswith("GPU GPU-a1-2 (index 2) of node a1 is on the lemon list")
    # The node's uncordon returns its other cordoned GPUs, never a lemon.
    store.nodes.set_cordoned(t(3 * 86400 + 20), "a1", False, by="admin")
    with store.read() as session:
        gpu = session.get(Gpu, "GPU-a1-2")
        assert gpu is not None and (gpu.cordoned, gpu.lemon) == (True, True)
    assert health_metric(store)["GPU-a1-2"] == "lemon"
    assert store.jobs.clear_lemon(t(3 * 86400 + 30), "GPU-a1-2", "admin")
    assert health_metric(store)["GPU-a1-2"] == "healthy"
    assert not store.jobs.clear_lemon(t(3 * 86400 + 31), "GPU-a1-2", "admin")
    with store.read() as session:
        gpu = session.get(Gpu, "GPU-a1-2")
        assert gpu is not None and (gpu.cordoned, gpu.lemon) == (False, False)
    with pytest.raises(NotFound, match="there is no GPU 'GPU-x'"):
        store.jobs.clear_lemon(t(3 * 86400 + 32), "GPU-x", "admin")


def test_a_silent_agents_job_resumes_elsewhere_while_its_gpus_wait_for_its_processes(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 12, job, pods=1)
    ask(store, t(13), "carol", server="big", project="nlp", gpus=4)
    store.scheduling.scheduling_cycle(t(14), NOW_POLICY)  # a1 is full
    marker = workload(store, job).process_marker
    store.nodes.heartbeat(t(40), "agent-1", ["a1", "h1"])  # a2's agent fell silent at t(12)
    lost = store.jobs.lose_silent_nodes(t(45), timedelta(seconds=30))
    assert (lost.nodes, lost.changed, lost.restarted) == (["a2"], [job], ["agent-lost"])

    back = workload(store, job)
    assert (back.state, back.attempt, back.faults) == (WorkloadState.pending, 2, 1)
    assert back.recovery is not None and back.recovery["avoid_nodes"] == ["a2"]
    assert events(store, "job-pod-ended")[-1] == (
        "pod 0 on a2: its node agent went silent; its GPUs stay held until what is left of "
        "it is gone"
    )
    assert events(store, "node-cordoned")[-1].startswith(
        "node a2 cordoned by the recovery loop: the node agent of a2 has been silent for 45 s"
    )
    # The agent comes back and an admin uncordons a2: its GPUs still wait for the pod.
    store.nodes.heartbeat(t(46), "agent-1", ["a1", "a2", "h1"])
    store.nodes.set_cordoned(t(46), "a2", False, by="admin")
    alice = ask(store, t(47), "alice", gpus=2)
    store.scheduling.scheduling_cycle(t(48), NOW_POLICY)
    assert workload(store, alice).state == WorkloadState.pending
    result = store.jobs.agent_sync(t(49), ["a2"], [], [])
    assert [(x.node, x.marker, x.workload_id) for x in result.leftovers] == [
        ("a2", f"{marker}.0", job)
    ]
    # Only an agent of a2 may say the processes are gone, and only of that marker.
    assert store.jobs.agent_sync(t(50), ["a1"], [], [], gone=[f"{marker}.0"]).released == []
    assert store.jobs.agent_sync(t(50), ["a2"], [], [], gone=["other.0"]).released == []
    result = store.jobs.agent_sync(t(51), ["a2"], [], [], gone=[f"{marker}.0"])
    assert result.released == ["GPU-a2-0", "GPU-a2-1"] and result.leftovers == []
    assert events(store, "gpu-leftovers-gone") == [
        f"nothing of job {job}'s lost pod 0 runs on a2 any more: 2 GPU(s) held for it 6 s "
        "take work again"
    ]
    store.scheduling.scheduling_cycle(t(52), NOW_POLICY)
    assert workload(store, alice).state == WorkloadState.admitted


def test_a_silent_agents_jobs_keep_running_while_the_breaker_is_open(store: FleetStore) -> None:
    store.jobs.act_on_xid(t(5), "GPU-a1-0", 79)  # the cluster's one automated cordon
    store.jobs.act_on_xid(t(6), "GPU-h1-0", 79)  # opens the breaker
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.nodes.heartbeat(t(40), "agent-1", ["a1", "h1"])
    lost = store.jobs.lose_silent_nodes(t(45), timedelta(seconds=30))
    assert (lost.nodes, lost.changed) == (["a2"], [])
    assert workload(store, job).state == WorkloadState.running
    assert events(store, "recovery-cordon-withheld")[-1].startswith(
        "node a2 stays in service: the recovery breaker of cluster local is open"
    )


def test_a_jobs_effective_training_ratio_counts_redone_work_and_each_restart(
    store: FleetStore,
) -> None:
    job = submit(store, 10)
    running(store, 11, job)
    assert training_ratio(workload(store, job).recovery, t(11)) is None  # no step yet
    store.jobs.agent_sync(t(12), NODES, [], [], [ProgressReport(job, 0, step=0, step_at=t(12))])
    checkpointed(store, 20, job)
    store.jobs.agent_sync(t(25), NODES, [], [], [ProgressReport(job, 0, step=60, step_at=t(25))])
    assert training_ratio(workload(store, job).recovery, t(30)) == 1.0
    report(store, 30, PodReport(job, 1, "exited", exit_code=1, reason="rank 3: Killed"))
    report(store, 31, PodReport(job, 0, "stopped", signal=15))
    # 10 s since the checkpoint are done again; the wait to resume counts as it goes.
    assert training_ratio(workload(store, job).recovery, t(35)) == pytest.approx(1 - 15 / 23)
    store.scheduling.scheduling_cycle(t(41), NOW_POLICY)
    running(store, 42, job, attempt=2)
    resumed = ProgressReport(job, 0, step=41, step_at=t(45))
    assert store.jobs.agent_sync(t(45), NODES, [], [], [resumed]).resumed_after_s == [15.0]
    assert training_ratio(workload(store, job).recovery, t(62)) == pytest.approx(0.5)


def test_a_job_the_reconciler_finds_stopped_for_a_fault_comes_back_all_the_same(
    store: FleetStore,
) -> None:
    # Its agent is slow to report the pods' ends; the reconciler sees nothing of it run.
    job = submit(store, 10, gpus=2)
    running(store, 12, job, pods=1)
    store.jobs.act_on_xid(t(13), "GPU-a2-0", 13)
    stopping = workload(store, job)
    assert stopping.state == WorkloadState.stopping
    back = store.reconcile.end_reconciled(
        t(20), job, stopping.version, "stopped", "stop-finished", "nothing of it runs"
    )
    assert back is not None and back.state == WorkloadState.pending
    assert (back.attempt, back.faults) == (2, 1)
    assert open_allocations(store, job) == 0
    assert events(store, "job-restarting")[0].startswith("XID 13 on GPU GPU-a2-0")


def test_a_silent_agents_jobs_run_on_until_the_job_timeout_and_a_take_over_costs_nothing(
    store: FleetStore,
) -> None:
    job = submit(store, 10, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 12, job, pods=1)
    store.nodes.heartbeat(t(40), "agent-1", ["a1", "h1"])  # a2's agent fell silent at t(12)
    hb, jobs_after = timedelta(seconds=30), timedelta(seconds=120)
    lost = store.jobs.lose_silent_nodes(t(45), hb, jobs_after)
    assert (lost.nodes, lost.changed) == (["a2"], [])  # no new work there; the job runs on
    # The agent restarted: it is back, and takes its pod over.
    store.nodes.heartbeat(t(60), "agent-1", ["a1", "a2", "h1"])
    report(store, 61, PodReport(job, 0, "running", adopted=True))
    kept = workload(store, job)
    assert (kept.state, kept.attempt, kept.faults) == (WorkloadState.running, 1, 0)
    assert events(store, "job-pod-adopted") == [
        "pod 0 on a2 kept running through a restart of its node agent, which took it over "
        "(attempt 1; nothing was charged)"
    ]
    assert events(store, "job-fault") == []

    # Gone for good this time: once its silence passes the job timeout, once.
    store.nodes.heartbeat(t(100), "agent-1", ["a1", "h1"])
    assert store.jobs.lose_silent_nodes(t(100), hb, jobs_after, since=t(95)).nodes == ["a2"]
    assert store.jobs.lose_silent_nodes(t(180), hb, jobs_after, since=t(100)).changed == []
    lost = store.jobs.lose_silent_nodes(t(181), hb, jobs_after, since=t(180))
    assert (lost.changed, lost.restarted) == ([job], ["agent-lost"])
    assert store.jobs.lose_silent_nodes(t(200), hb, jobs_after, since=t(181)).changed == []
    back = workload(store, job)
    assert (back.state, back.attempt, back.faults) == (WorkloadState.pending, 2, 1)
    assert len(events(store, "job-pod-ended")) == 1


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        # what the job asked for: its own error, not retried
        (
            "could not start: checkpoint_uri /etc must be in /home/carol",
            ("ended", "failed", 1, 0, None),
        ),
        # what the node could not do: the infrastructure's, retried elsewhere
        (
            "this node could not start it: the sessions' base environment is missing",
            ("pending", None, 2, 1, ["a2"]),
        ),
        # an agent of an earlier release ran it and left no record: the platform's doing
        (
            "was ended: the node agent restarted and found no record of it",
            ("pending", None, 2, 0, None),
        ),
        # a reason whose rank number no int() takes is read as no rank error at all
        (f"rank {'9' * 5000}: ValueError: x", ("pending", None, 2, 1, None)),
    ],
)
def test_who_a_pod_that_did_not_run_is_charged_to_depends_on_why(
    store: FleetStore, reason: str, outcome: tuple[object, ...]
) -> None:
    job = submit(store, 10, gpus=2)
    assert placed_on(store, job) == {"a2"}
    running(store, 12, job, pods=1)
    report(store, 13, PodReport(job, 0, "failed", reason=reason))
    ended = workload(store, job)
    avoided = (ended.recovery or {}).get("avoid_nodes") or None
    assert (ended.state.value, ended.outcome, ended.attempt, ended.faults, avoided) == outcome
