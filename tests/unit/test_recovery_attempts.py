"""What follows an ended attempt (recovery/attempts.py), with literal rows: the verdict of
the classifier on a real signal, the job's record, and the next attempt or the end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpufleet.recovery.attempts import AttemptRecord, GiveUp, Resume, RetryPolicy, next_attempt
from gpufleet.recovery.breaker import BreakerPolicy, may_cordon
from gpufleet.recovery.classify import PodOutcome, RankError, Xid, classify

T = 10_000.0
POLICY = RetryPolicy(fault_budget=2, fault_window_s=3600.0, backoff_s=10.0, backoff_max_s=15.0)
CKPT = "s3://ckpt/ann/resnet/step-300"


def ended(
    exit_code: int | None = 1, reason: str = "", error: RankError | None = None
) -> PodOutcome:
    return PodOutcome(exit_code, None, reason, error, ("GPU-a-0", "GPU-a-1"), ("a",), T)


XID_79 = Xid(79, "GPU-a-0", "a", T - 5)  # the node's GPU fell off the bus just before
XID_13 = Xid(13, "GPU-a-1", "a", T - 5)


def test_a_disruption_restarts_at_once_anywhere_and_spends_nothing() -> None:
    verdict = classify(ended(None, "Preempted"))
    step = next_attempt(
        AttemptRecord(attempt=1, fault_times=(T - 60, T - 30), checkpoint=CKPT), verdict, POLICY, T
    )
    assert step == Resume(
        attempt=2,
        fault_times=(T - 60, T - 30),
        quick_faults=0,
        delay_s=0.0,
        avoid_nodes=frozenset(),
        avoid_gpus=frozenset(),
        resume_from=CKPT,
        message=(
            "the pod was stopped (Preempted): the job restarts without spending its retry "
            f"budget; attempt 2, resumes from {CKPT}, no fault counted"
        ),
    )


def test_a_node_fault_avoids_the_node_and_restarts_at_once() -> None:
    verdict = classify(ended(1), [XID_79])
    step = next_attempt(AttemptRecord(attempt=1), verdict, POLICY, T)
    assert isinstance(step, Resume)
    # What failed is left out: no reason to wait.
    assert (step.attempt, step.fault_times, step.delay_s) == (2, (T,), 0.0)
    assert step.avoid_nodes == {"a"} and step.resume_from is None
    assert step.message.endswith(
        "attempt 2, starts from the beginning (no checkpoint was saved), infrastructure "
        "fault 1 of 2 allowed within 1 h, not on a"
    )
    # Blamed again at once elsewhere: now it waits, as any quick repeat does.
    again = next_attempt(
        AttemptRecord(attempt=2, avoid_nodes=frozenset({"a"}), quick_faults=1),
        classify(ended(1), [replace(XID_79, gpu="GPU-b-0", node="b")]),
        POLICY,
        T,
    )
    assert isinstance(again, Resume) and (again.quick_faults, again.delay_s) == (2, 15.0)
    # A fault that blames nothing new backs off.
    in_place = next_attempt(AttemptRecord(attempt=1), classify(ended(1), [XID_13]), POLICY, T)
    assert isinstance(in_place, Resume) and in_place.delay_s == 10.0


def test_exclusions_add_up_and_back_off_doubles_up_to_its_limit() -> None:
    earlier = AttemptRecord(
        attempt=2,
        fault_times=(T - 100,),
        avoid_nodes=frozenset({"b"}),
        checkpoint=CKPT,
        ran_s=30.0,
        quick_faults=1,
    )
    step = next_attempt(earlier, classify(ended(1), [XID_79]), POLICY, T)
    assert isinstance(step, Resume)
    assert step.avoid_nodes == {"a", "b"} and step.quick_faults == 2
    assert step.delay_s == 15.0  # 20 s, capped at 15
    # An attempt that ran past backoff_reset_s ends the row: the back-off starts afresh.
    ran_well = replace(earlier, ran_s=POLICY.backoff_reset_s)
    step = next_attempt(ran_well, classify(ended(1), [XID_13]), POLICY, T)
    assert isinstance(step, Resume) and (step.quick_faults, step.delay_s) == (0, 10.0)


def test_the_budget_grows_with_the_job() -> None:
    assert [POLICY.budget_for(g) for g in (1, 1024, 2048, 16384)] == [2, 2, 4, 32]
    many = AttemptRecord(attempt=9, fault_times=tuple(T - i for i in range(1, 31)), gpus=16384)
    assert isinstance(next_attempt(many, classify(ended(1), [XID_79]), POLICY, T), Resume)


def test_a_restart_in_place_keeps_the_gpus_and_the_exclusions_it_had() -> None:
    earlier = AttemptRecord(attempt=1, avoid_gpus=frozenset({"GPU-b-3"}))
    step = next_attempt(earlier, classify(ended(1), [XID_13]), POLICY, T)
    assert isinstance(step, Resume)
    assert step.avoid_gpus == {"GPU-b-3"} and step.avoid_nodes == frozenset()


def test_the_fault_past_the_budget_ends_the_job_saying_why() -> None:
    spent = AttemptRecord(attempt=4, fault_times=(T - 600, T - 300), checkpoint=CKPT)
    step = next_attempt(spent, classify(ended(1), [XID_79]), POLICY, T)
    assert isinstance(step, GiveUp)
    assert step.message.endswith(
        "not retried: this is infrastructure fault 3 of the job within 1 h, and it restarts "
        "from at most 2"
    )
    # Faults older than the window no longer count: a long job survives a fault a day.
    old = AttemptRecord(attempt=4, fault_times=(T - 7200, T - 300), checkpoint=CKPT)
    step = next_attempt(old, classify(ended(1), [XID_79]), POLICY, T)
    assert isinstance(step, Resume) and step.fault_times == (T - 300, T)
    # A disruption still restarts a job whose budget is spent.
    assert isinstance(next_attempt(spent, classify(ended(None, "Drained")), POLICY, T), Resume)


def test_a_users_error_is_never_retried() -> None:
    error = RankError(1, "ValueError", "bad learning rate")
    step = next_attempt(AttemptRecord(attempt=1), classify(ended(1, error=error)), POLICY, T)
    assert step == GiveUp(
        "rank 1 raised ValueError: bad learning rate in the job's code: not retried; fix "
        "the error and submit again"
    )


def test_a_verdict_that_keeps_the_job_running_is_not_an_ended_attempt() -> None:
    with pytest.raises(ValueError, match="keeps the job running"):
        next_attempt(AttemptRecord(attempt=1), classify(Xid(63, "GPU-a-0", "a", T)), POLICY, T)


def test_a_policy_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="backoff_s <= backoff_max_s"):
        RetryPolicy(backoff_s=60.0, backoff_max_s=10.0)


@pytest.mark.parametrize(
    ("recent", "nodes", "allowed"),
    [(0, 2, True), (1, 2, False), (0, 3, True), (1, 3, False), (4, 10, True), (5, 10, False)],
)
def test_the_breaker_stops_cordons_past_its_share(recent: int, nodes: int, allowed: bool) -> None:
    assert may_cordon(recent, nodes, BreakerPolicy(share=0.5, window_s=300)) is allowed


def test_a_breaker_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="0 < share <= 1"):
        BreakerPolicy(share=0)
