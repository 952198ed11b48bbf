"""What the session extension reports its user did in JupyterLab (a file saved, typing), as
the store keeps it for the culler: the latest action with its own time, never a time ahead
of the controller's clock, and use that unmarks an idle session in the same request."""

from __future__ import annotations

from sqlalchemy import Engine

from gpufleet.state.fleet import FleetStore
from gpufleet.state.sessions import ActivityReport

from .test_store import events, make_store, running_session, t, workload


def report(at: float | None, action: str = "") -> ActivityReport:
    return ActivityReport(
        kernels=0,
        kernels_busy=False,
        kernel_activity=None,
        terminal_activity=None,
        user_activity=t(at) if at is not None else None,
        user_action=action,
    )


def culled(store: FleetStore, workload_id: int) -> tuple[object, str]:
    (session,) = [s for s in store.sessions.culler_sessions() if s.workload_id == workload_id]
    return session.user_activity, session.user_action


def test_the_latest_action_is_kept_with_its_own_time(engine: Engine) -> None:
    store = make_store(engine)
    wid = running_session(store)
    assert culled(store, wid) == (None, "")
    store.sessions.record_activity(t(20), wid, "alice", report(18, "file"))
    assert culled(store, wid) == (t(18), "file")
    # An older action, reported late, changes neither the time nor what was done.
    store.sessions.record_activity(t(21), wid, "alice", report(17, "input"))
    store.sessions.record_activity(t(22), wid, "alice", report(None))
    assert culled(store, wid) == (t(18), "file")
    store.sessions.record_activity(t(30), wid, "alice", report(29, "input"))
    assert culled(store, wid) == (t(29), "input")
    # A session's clock ahead of the controller's vouches for no later than now.
    store.sessions.record_activity(t(40), wid, "alice", report(95, "file"))
    assert culled(store, wid) == (t(40), "file")


def test_an_action_after_the_mark_unmarks_an_idle_session_at_once(engine: Engine) -> None:
    store = make_store(engine)
    wid = running_session(store)
    assert store.sessions.record_idle_decision(
        t(10), wid, "mark-idle", "idle for 60 min", last_active=t(3)
    )
    store.sessions.record_activity(t(11), wid, "alice", report(2, "file"))
    assert workload(store, wid).idle_since == t(3)  # from before the mark: still reclaimable
    state = store.sessions.record_activity(t(12), wid, "alice", report(12, "input"))
    assert workload(store, wid).idle_since is None
    assert state.notices == []
    assert events(store, "session-active-again") == ["in use again: it was used"]
