"""The idle policy with literal inputs: what a researcher would see happen to a session."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpufleet.culler.errors import PolicyError
from gpufleet.culler.policy import (
    Action,
    Cause,
    IdlePolicy,
    ReclaimMode,
    Session,
    Signals,
    decide,
    resolve,
)

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
ALWAYS = IdlePolicy(mode=ReclaimMode.ALWAYS, idle_timeout_s=3600, warn_before_s=600)
ON_DEMAND = IdlePolicy(mode=ReclaimMode.ON_DEMAND, idle_timeout_s=3600, warn_before_s=600)


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


def session(**kw: object) -> Session:
    return Session(workload_id=7, started_at=T0, **kw)  # type: ignore[arg-type]


def test_a_busy_kernel_keeps_a_session_whose_browser_closed_long_ago() -> None:
    signals = Signals(hub_activity=minutes(1), kernels_busy=True, reported_at=minutes(299))
    decision = decide(session(), signals, ALWAYS, minutes(300))
    assert decision.action is Action.KEEP
    assert "a kernel is running code" in decision.reason


def test_an_open_jupyterlab_is_not_use_once_the_session_extension_reports() -> None:
    # The page polls kernels, contents and notices: the hub's last_activity moves with it.
    polled = Signals(hub_activity=minutes(50.9), kernel_activity=minutes(1))
    reporting = Signals(
        hub_activity=minutes(50.9), kernel_activity=minutes(1), reported_at=minutes(50.5)
    )
    warn = decide(session(), reporting, ALWAYS, minutes(51))
    assert warn.action is Action.WARN and warn.due_at == minutes(61)
    assert warn.reason.startswith("idle for 50 min (last in use: a kernel ran code)")
    # A session whose extension never reported has only the hub to go by.
    kept = decide(session(), polled, ALWAYS, minutes(51))
    assert kept.action is Action.KEEP
    assert kept.reason == "last in use 6 s ago: browser or API activity"


@pytest.mark.parametrize(
    ("action", "said"),
    [
        ("file", "a file saved or changed in JupyterLab"),
        ("input", "typing, clicks or scrolling in JupyterLab"),
    ],
)
def test_what_its_user_did_in_jupyterlab_keeps_the_session_and_is_named(
    action: str, said: str
) -> None:
    signals = Signals(
        kernel_activity=minutes(0),
        user_activity=minutes(40),
        user_action=action,
        reported_at=minutes(49.5),
    )
    kept = decide(session(), signals, ALWAYS, minutes(50))
    assert (kept.action, kept.reason) == (Action.KEEP, f"last in use 10 min ago: {said}")
    assert kept.recheck_at == minutes(90)


def test_a_warning_announces_a_whole_minute_and_the_stop_comes_then() -> None:
    signals = Signals(kernel_activity=minutes(0.25), reported_at=minutes(50))
    warn = decide(session(), signals, ALWAYS, minutes(50.25))
    # Due at 10:00:15: announced as the whole minute after it, which the text says exactly.
    assert (warn.action, warn.due_at, warn.pending) == (Action.WARN, minutes(61), Action.CULL)
    assert warn.reason.endswith("it will be snapshotted and stopped at 10:01 UTC")
    warned = session(warned_at=minutes(50.25), warned_stop_at=minutes(61))
    waiting = decide(warned, signals, ALWAYS, minutes(60.5))
    assert (waiting.action, waiting.due_at, waiting.recheck_at) == (
        Action.KEEP,
        minutes(61),
        minutes(61),
    )
    # A sign of use from before the warning, reported late, that leaves the session due by
    # the announced time: the time stands; not a later stop without a word.
    late = Signals(kernel_activity=minutes(0.75), reported_at=minutes(51))
    assert decide(warned, late, ALWAYS, minutes(60.9)).due_at == minutes(61)
    cull = decide(warned, late, ALWAYS, minutes(61))
    assert (cull.action, cull.due_at) == (Action.CULL, minutes(61))
    # One that makes it due later than announced: the warning goes, or gives the new time.
    used = Signals(kernel_activity=minutes(50.1), reported_at=minutes(51))
    assert decide(warned, used, ALWAYS, minutes(51)).action is Action.WITHDRAW
    rewarn = decide(warned, used, ALWAYS, minutes(100.1))
    assert (rewarn.action, rewarn.due_at) == (Action.WARN, minutes(111))


def test_a_short_warning_gives_its_time_to_the_second() -> None:
    policy = IdlePolicy(mode=ReclaimMode.ALWAYS, idle_timeout_s=20, warn_before_s=6)
    signals = Signals(reported_at=T0 + timedelta(seconds=14))
    warn = decide(session(), signals, policy, T0 + timedelta(seconds=14.3))
    assert warn.due_at == T0 + timedelta(seconds=21)  # a full 6 s, to the next second
    assert warn.reason == (
        "idle for 14 s (last in use: the session started): "
        "it will be snapshotted and stopped at 09:00:21 UTC"
    )


def test_gpus_that_did_work_keep_a_session_without_any_browser() -> None:
    signals = Signals(hub_activity=minutes(1), gpu_activity=minutes(290))
    decision = decide(session(), signals, ALWAYS, minutes(300))
    assert decision.action is Action.KEEP
    assert "its GPUs did work" in decision.reason


def test_a_busy_report_holds_until_the_extension_should_have_reported_again() -> None:
    # A long silent cell since minute 10: the last report, 40 s ago, said "busy".
    busy = Signals(kernels_busy=True, kernel_activity=minutes(10), reported_at=minutes(74.4))
    kept = decide(session(), busy, ALWAYS, minutes(75))
    assert (kept.action, kept.last_active) == (Action.KEEP, minutes(75))
    # An extension that stopped reporting vouches for no longer than its report holds.
    stale = Signals(kernels_busy=True, reported_at=minutes(10))
    decision = decide(session(), stale, ALWAYS, minutes(75))
    assert decision.action is Action.WARN
    assert decision.last_active == minutes(11.5)


def test_always_mode_warns_then_culls_after_the_full_warning() -> None:
    signals = Signals(hub_activity=minutes(0))
    keep = decide(session(), signals, ALWAYS, minutes(49))
    assert keep.action is Action.KEEP
    assert keep.recheck_at == minutes(50)  # the culler looks again exactly then
    # 50 minutes idle: the 10-minute warning before the 60-minute time-out.
    warn = decide(session(), signals, ALWAYS, minutes(50))
    assert warn.action is Action.WARN
    assert warn.due_at == minutes(60)
    assert "idle for 50 min" in warn.reason
    assert "snapshotted and stopped at 10:00 UTC" in warn.reason
    warned = session(warned_at=minutes(50), warned_stop_at=warn.due_at)
    waiting = decide(warned, signals, ALWAYS, minutes(59))
    assert (waiting.action, waiting.recheck_at) == (Action.KEEP, minutes(60))
    cull = decide(warned, signals, ALWAYS, minutes(60))
    assert (cull.action, cull.cause) == (Action.CULL, Cause.IDLE)


def test_a_session_found_idle_late_still_gets_its_full_warning() -> None:
    # The controller was down: the session is found 3 hours idle, never warned.
    signals = Signals(hub_activity=minutes(0))
    warn = decide(session(), signals, ALWAYS, minutes(180))
    assert warn.action is Action.WARN and warn.due_at == minutes(190)
    warned = session(warned_at=minutes(180))
    assert decide(warned, signals, ALWAYS, minutes(189)).action is Action.KEEP
    assert decide(warned, signals, ALWAYS, minutes(190)).action is Action.CULL


def test_activity_after_a_warning_cancels_it() -> None:
    warned = session(warned_at=minutes(52), warned_stop_at=minutes(60))
    signals = Signals(hub_activity=minutes(0), kernel_activity=minutes(55))
    decision = decide(warned, signals, ALWAYS, minutes(61))
    assert decision.action is Action.WITHDRAW
    assert decision.reason == "last in use 6 min ago: a kernel ran code"
    # Idle again later: a new warning, not a cull on the strength of the old one.
    later = decide(warned, signals, ALWAYS, minutes(108))
    assert later.action is Action.WARN and later.due_at == minutes(118)


def test_on_demand_marks_an_idle_session_and_never_stops_it_itself() -> None:
    signals = Signals(hub_activity=minutes(0))
    warn = decide(session(), signals, ON_DEMAND, minutes(55))
    assert warn.action is Action.WARN
    assert "when someone needs its GPUs" in warn.reason
    marked = decide(session(warned_at=minutes(55)), signals, ON_DEMAND, minutes(65))
    assert (marked.action, marked.cause) == (Action.MARK_IDLE, Cause.IDLE)
    assert marked.reason.endswith("snapshotted and stopped when a waiting workload needs its GPUs")
    for hours in (2, 10, 48):
        kept = decide(
            session(warned_at=minutes(55), idle_marked=True),
            signals,
            ON_DEMAND,
            minutes(60 * hours),
        )
        assert kept.action is Action.KEEP
        assert "when a waiting workload needs its GPUs" in kept.reason


def test_on_demand_mark_is_cleared_when_the_session_is_used_again() -> None:
    signals = Signals(hub_activity=minutes(0), terminal_activity=minutes(130))
    decision = decide(
        session(idle_marked=True, warned_at=minutes(55)), signals, ON_DEMAND, minutes(131)
    )
    assert decision.action is Action.UNMARK
    assert "terminal activity" in decision.reason


def test_a_project_may_keep_its_idle_sessions_out_of_reach() -> None:
    policy = IdlePolicy(mode=ReclaimMode.ON_DEMAND, reclaim_by_anyone=False)
    decision = decide(session(), Signals(), policy, minutes(600))
    assert decision.action is Action.KEEP
    assert "keeps idle sessions" in decision.reason


def test_keep_alive_holds_until_its_time_then_the_policy_applies() -> None:
    signals = Signals(hub_activity=minutes(0), keep_alive_until=minutes(240))
    kept = decide(session(), signals, ALWAYS, minutes(200))
    assert kept.action is Action.KEEP and "kept alive by its user until 13:00 UTC" in kept.reason
    marked = decide(session(idle_marked=True), signals, ON_DEMAND, minutes(200))
    assert marked.action is Action.UNMARK
    after = decide(session(), signals, ALWAYS, minutes(241))
    assert after.action is Action.WARN


def test_max_age_stops_even_a_busy_session_after_a_warning() -> None:
    policy = IdlePolicy(mode=ReclaimMode.ALWAYS, max_age_s=8 * 3600, warn_before_s=600)
    busy = Signals(kernels_busy=True, reported_at=minutes(470))
    warn = decide(session(), busy, policy, minutes(470))
    assert (warn.action, warn.cause, warn.due_at) == (Action.WARN, Cause.MAX_AGE, minutes(480))
    assert "maximum age of 8 h 00 min" in warn.reason
    busy_later = Signals(kernels_busy=True, reported_at=minutes(480))
    assert decide(session(warned_at=minutes(470)), busy_later, policy, minutes(479)).action is (
        Action.KEEP
    )
    cull = decide(session(warned_at=minutes(470)), busy_later, policy, minutes(480))
    assert (cull.action, cull.cause) == (Action.CULL, Cause.MAX_AGE)


def test_without_a_warning_period_the_action_is_immediate() -> None:
    policy = IdlePolicy(mode=ReclaimMode.ALWAYS, idle_timeout_s=600, warn_before_s=0)
    assert decide(session(), Signals(), policy, minutes(10)).action is Action.CULL
    assert decide(session(), Signals(), policy, minutes(9)).action is Action.KEEP


def test_policies_resolve_default_then_project_then_profile() -> None:
    config = {
        "default": {"idle_timeout_s": 7200, "mode": "always"},
        "projects": {"vision": {"idle_timeout_s": 1800, "warn_before_s": 300}},
        "profiles": {"a100-large": {"mode": "on-demand"}},
    }
    assert resolve(config, "nlp") == IdlePolicy(mode=ReclaimMode.ALWAYS, idle_timeout_s=7200)
    vision = resolve(config, "vision")
    assert (vision.mode, vision.idle_timeout_s, vision.warn_before_s) == (
        ReclaimMode.ALWAYS,
        1800,
        300,
    )
    large = resolve(config, "vision", "a100-large")
    assert (large.mode, large.idle_timeout_s) == (ReclaimMode.ON_DEMAND, 1800)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"idle_timeout": 60}, "unknown key(s) idle_timeout; known: "),
        ({"mode": "sometimes"}, "mode 'sometimes' is not one of always, on-demand"),
        ({"idle_timeout_s": 300, "warn_before_s": 600}, "warn_before_s must be less than"),
        ({"idle_timeout_s": "1h"}, "idle_timeout_s must be a number of seconds"),
        ({"max_age_s": 60}, "max_age_s must be more than warn_before_s"),
    ],
)
def test_a_bad_policy_names_what_to_fix(raw: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match="idle policy for project vision") as raised:
        resolve({"projects": {"vision": raw}}, "vision")
    assert message in str(raised.value)


def test_an_open_jupyterlab_looks_often_enough_to_show_a_short_warning() -> None:
    assert IdlePolicy(idle_timeout_s=20, warn_before_s=6).notice_poll_s == 1.5
    assert IdlePolicy(warn_before_s=600).notice_poll_s == 10.0  # never slower than 10 s
    assert IdlePolicy(warn_before_s=0).notice_poll_s == 1.0  # never faster than 1 s
