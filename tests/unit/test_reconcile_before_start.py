"""A new start of a server whose previous workload still holds GPUs: ``before_start``,
with literal inputs and outputs."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from gpufleet.hub.reconcile import (
    BeforeStart,
    EndWorkload,
    MarkedProcess,
    RecordedWorkload,
    Rule,
    before_start,
)

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)

# Stopped while the controller was down: the release never arrived. Just now: no grace.
ALICE = RecordedWorkload(
    id=19,
    version=4,
    kind="session",
    username="alice",
    server_name="",
    state="running",
    since=T0,
    marker="m-alice",
)
STRANGER = MarkedProcess(300, "m-someone-else")


def test_a_previous_workload_with_nothing_alive_is_ended_as_lost_at_once() -> None:
    assert before_start([ALICE], [STRANGER]) == BeforeStart(
        ends=(
            EndWorkload(
                workload_id=19,
                version=4,
                outcome="lost",
                rule=Rule.session_lost,
                reason="a new start of server (default) of alice found workload 19 still "
                "running although the hub no longer runs the server, and no process of it "
                "is alive; its GPUs are released",
            ),
        ),
        refused=None,
    )


def test_a_stopping_one_is_ended_as_stopped() -> None:
    stopping = replace(ALICE, state="stopping", server_name="big")
    assert before_start([stopping], []) == BeforeStart(
        ends=(
            EndWorkload(
                workload_id=19,
                version=4,
                outcome="stopped",
                rule=Rule.stop_finished,
                reason="a new start of server big of alice found workload 19 still "
                "stopping although the hub no longer runs the server, and no process of it "
                "is alive; its GPUs are released",
            ),
        ),
    )


def test_live_processes_refuse_the_start_and_say_what_runs() -> None:
    alive = [MarkedProcess(102, "m-alice"), MarkedProcess(101, "m-alice"), STRANGER]
    assert before_start([ALICE], alive) == BeforeStart(
        ends=(),
        refused="server (default) of alice still holds GPUs as workload 19 (running): 2 "
        "processes (101, 102) of it are still alive on this machine, though the hub no "
        "longer runs the server. The reconciler ends such processes and then releases the "
        "GPUs; start the server again once it has (its next passes), or end the processes "
        "first",
    )
    admitted = replace(ALICE, state="admitted")
    assert before_start([admitted], alive[1:2]).refused == (
        "server (default) of alice still holds GPUs as workload 19 (admitted): process 101 "
        "of it is still alive on this machine, though the hub no longer runs the server. "
        "The reconciler ends such processes and then releases the GPUs; start the server "
        "again once it has (its next passes), or end the processes first"
    )


def test_what_nothing_proves_gone_refuses_the_start() -> None:
    unmarked = replace(ALICE, marker=None)
    assert before_start([unmarked], []) == BeforeStart(
        ends=(),
        refused="server (default) of alice still holds GPUs as workload 19 (running) and "
        "started before process markers were recorded, so nothing proves it gone; ask an "
        "admin to release workload 19, then start the server again",
    )
    snapshotting = replace(ALICE, snapshot_pending=True)
    assert before_start([snapshotting], []) == BeforeStart(
        ends=(),
        refused="server (default) of alice still holds GPUs as workload 19 (running): the "
        "final snapshot of its last session is still being retried, and its GPUs are kept "
        "until it is saved; start the server again once it is, or ask an admin to release "
        "workload 19",
    )


def test_requests_that_hold_nothing_alive_are_left_for_the_new_request_to_supersede() -> None:
    pending = replace(ALICE, id=20, state="pending")
    admitted = replace(ALICE, id=21, state="admitted", marker="m-admitted")
    unmarked = replace(admitted, marker=None)
    assert before_start([pending, admitted, unmarked], []) == BeforeStart(ends=())
    assert before_start([], [STRANGER]) == BeforeStart(ends=())


def test_the_ends_are_decided_even_when_another_workload_refuses_the_start() -> None:
    older = replace(ALICE, id=18, state="stopping", marker="m-older")
    decision = before_start([ALICE, older], [MarkedProcess(101, "m-alice")])
    assert [(e.workload_id, e.outcome) for e in decision.ends] == [(18, "stopped")]
    assert decision.refused is not None and decision.refused.startswith(
        "server (default) of alice still holds GPUs as workload 19 (running): process 101 "
    )


def test_a_start_waits_for_the_previous_pod_to_be_gone() -> None:
    decision = before_start([ALICE], [], frozenset({ALICE.marker or ""}))
    assert decision.ends == ()
    assert decision.refused is not None
    assert "its pod still exists in its Kubernetes cluster" in decision.refused
