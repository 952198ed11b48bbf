"""Traces in the store against real databases (SQLite and PostgreSQL): a hang's trace
holds the gang until every pod's stacks are in, only the agent of a pod's node answers for
it, and a trace that is not answered closes after its wait saying which pods were silent.
The fleet and helpers are test_store_attempts.py's (a 4-GPU job as 2 pods of 2)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, select

from gpufleet.scheduler.errors import InvalidRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Event, WorkloadState
from gpufleet.state.progress import ProgressReport
from gpufleet.state.traces import PodStacks

from .test_store import events, make_store, t, workload
from .test_store_attempts import running, submit
from .test_store_jobs import NODES

WHERE = {
    0: "all_reduce (torch/distributed/distributed_c10d.py:2501)",
    1: "all_reduce (torch/distributed/distributed_c10d.py:2501)",
    2: "wait_for_nothing (train.py:12)",
    3: "all_reduce (torch/distributed/distributed_c10d.py:2501)",
}


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def stacks(trace: int, job: int, pod: int) -> PodStacks:
    ranks = [
        {"rank": r, "pid": 100 + r, "where": WHERE[r], "text": f"Thread 1: {WHERE[r]}"}
        for r in (2 * pod, 2 * pod + 1)
    ]
    return PodStacks(trace, job, pod, ranks)


def traces_listed(store: FleetStore, job: int) -> dict[int, int | None]:
    return {p.pod_index: p.trace for p in store.jobs.desired_pods(NODES) if p.workload_id == job}


def hung_job(store: FleetStore) -> int:
    job = submit(store, 10)
    running(store, 12, job)
    step = ProgressReport(job, 0, step=5, step_at=t(20), step_times_s=[1.0] * 20)
    store.jobs.agent_sync(t(20), NODES, [], [], [step])
    assert store.jobs.stop_hung_jobs(t(621)) == [job]
    return job


def test_a_hangs_stacks_are_asked_of_every_pod_before_the_stop_and_say_where_each_rank_was(
    store: FleetStore,
) -> None:
    job = hung_job(store)
    assert workload(store, job).state == WorkloadState.stopping
    [trace] = store.traces.traces(job)
    assert (trace.why, trace.attempt, trace.closed_at) == ("hang", 1, None)
    desired = [p for p in store.jobs.desired_pods(NODES) if p.workload_id == job]
    assert {(p.run, p.trace) for p in desired} == {(False, trace.id)}

    # An agent of other nodes cannot answer for the job's pods.
    store.jobs.agent_sync(t(622), ["h1"], [], [], stacks=[stacks(trace.id, job, 0)])
    assert traces_listed(store, job) == {0: trace.id, 1: trace.id}

    result = store.jobs.agent_sync(t(623), NODES, [], [], stacks=[stacks(trace.id, job, 0)])
    assert job in result.changed
    assert traces_listed(store, job) == {0: None, 1: trace.id}
    assert events(store, "job-traced") == []  # pod 1 is still awaited

    store.jobs.agent_sync(t(624), NODES, [], [], stacks=[stacks(trace.id, job, 1)])
    assert traces_listed(store, job) == {0: None, 1: None}
    [said] = events(store, "job-traced")
    assert said == (
        "attempt 1: stacks of every rank (the hang): "
        + "; ".join(f"rank {r} in {WHERE[r]}" for r in range(4))
    )
    with store.read() as session:
        event = session.scalars(select(Event).where(Event.kind == "job-traced")).one()
        assert event.data["where"] == {str(r): w for r, w in WHERE.items()}
    [closed] = store.traces.traces(job)
    assert closed.closed_at == t(624)
    assert [(d.pod_index, [r["rank"] for r in d.ranks]) for d in closed.dumps] == [
        (0, [0, 1]),
        (1, [2, 3]),
    ]
    # A second answer for a pod changes nothing.
    store.jobs.agent_sync(t(625), NODES, [], [], stacks=[stacks(trace.id, job, 1)])
    assert len(store.traces.traces(job)[0].dumps) == 2


def test_a_trace_no_pod_answers_closes_after_its_wait_naming_the_silent_pods(
    store: FleetStore,
) -> None:
    job = submit(store, 10)
    running(store, 12, job)
    asked = store.traces.ask(t(30), job, "carol")
    assert traces_listed(store, job) == {0: asked, 1: asked}
    assert store.traces.close_expired(t(49)) == []
    store.jobs.agent_sync(t(49), NODES, [], [], stacks=[stacks(asked, job, 1)])
    assert store.traces.close_expired(t(50)) == [job]  # the 20 s wait is over
    [said] = events(store, "job-traced")
    assert said == (
        f"attempt 1: stacks of every rank (asked by carol): rank 2 in {WHERE[2]}; "
        f"rank 3 in {WHERE[3]}; pod(s) 0 did not answer within the wait"
    )
    assert traces_listed(store, job) == {0: None, 1: None}
    # An answer after the close is too late to count.
    store.jobs.agent_sync(t(51), NODES, [], [], stacks=[stacks(asked, job, 0)])
    assert [d.pod_index for d in store.traces.traces(job)[0].dumps] == [1]


def test_stacks_are_asked_only_of_a_job_whose_ranks_run(store: FleetStore) -> None:
    job = submit(store, 10)
    with pytest.raises(InvalidRequest, match=r"no running ranks \(it is admitted\)"):
        store.traces.ask(t(11), job, "carol")
    running(store, 12, job)
    store.traces.ask(t(13), job, "carol")
    assert store.traces.traces(job)[0].asked_by == "carol"
