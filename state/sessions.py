"""What the idle culler reads and writes: session activity, keep-alives, warnings, marks.

The session extension reports each running session's kernels and terminals
(``record_activity``); the user may keep a session alive within the project's limit
(``set_keep_alive``); the culler reads every running session with its signals in one
query (``culler_sessions``) and records what it decided (``record_idle_decision``).
Marking a session idle sets ``Workload.idle_since``, the one thing the scheduler reads:
the culler never calls the scheduler, and the scheduler never calls the culler.
The repository is ``store.sessions``; every write is fenced by the controller lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..scheduler.errors import InvalidRequest, NotFound
from .base import Repository, _event
from .models import (
    Allocation,
    Event,
    Gpu,
    Project,
    SessionActivity,
    Workload,
    WorkloadKind,
    WorkloadState,
)

_LIVE = (WorkloadState.admitted, WorkloadState.running)
# The culler's decisions, as the events a user reads.
_DECISION_EVENTS = {
    "warn": EventKind.SESSION_IDLE_WARNING,
    "mark-idle": EventKind.SESSION_MARKED_IDLE,
    "unmark": EventKind.SESSION_ACTIVE_AGAIN,
    "withdraw": EventKind.SESSION_WARNING_WITHDRAWN,
    "cull": EventKind.SESSION_CULL,
}


@dataclass(frozen=True)
class ActivityReport:
    kernels: int
    kernels_busy: bool
    kernel_activity: datetime | None
    terminal_activity: datetime | None
    # What its user last did in JupyterLab ("input", "file"), and when.
    user_activity: datetime | None = None
    user_action: str = ""


@dataclass(frozen=True)
class SessionState:
    """What a session extension is told after each report."""

    notices: list[dict[str, Any]]
    keep_alive_until: datetime | None
    project: str
    profile: str


@dataclass(frozen=True)
class CulledSession:
    """One running session with everything the culler decides on, except the hub's own
    activity (the culler asks the hub for that)."""

    workload_id: int
    username: str
    server_name: str
    project: str
    profile: str
    gpus: int
    started_at: datetime
    idle_since: datetime | None
    reported_at: datetime | None
    kernels_busy: bool
    kernel_activity: datetime | None
    terminal_activity: datetime | None
    user_activity: datetime | None
    user_action: str
    gpu_activity: datetime | None
    keep_alive_until: datetime | None
    warned_at: datetime | None
    warned_stop_at: datetime | None
    snapshot_sources: dict[str, Any] | None


class SessionActivityStore(Repository):
    def record_activity(
        self, now: datetime, workload_id: int, username: str | None, report: ActivityReport
    ) -> SessionState:
        """A session extension's report; ``username``: the caller's, None for a caller that
        may act for anyone. A session that is not running (or not the caller's) is
        ``NotFound``: its extension should stop reporting."""
        with self._write(now) as session:
            workload = _live_session(session, workload_id, username)
            row = _activity(session, workload_id)
            row.reported_at = now
            row.kernels = report.kernels
            row.kernels_busy = report.kernels_busy
            row.kernel_activity = _latest(row.kernel_activity, report.kernel_activity, now)
            row.terminal_activity = _latest(row.terminal_activity, report.terminal_activity, now)
            user_activity = _latest(row.user_activity, report.user_activity, now)
            if user_activity != row.user_activity:
                row.user_activity, row.user_action = user_activity, report.user_action
            idle_since = workload.idle_since
            used = [
                t
                for t in (row.kernel_activity, row.terminal_activity, row.user_activity)
                if t is not None
            ]
            if idle_since is not None and (
                report.kernels_busy or any(t > idle_since for t in used)
            ):
                # In use again: not reclaimable from this moment, not at the culler's next
                # round (the scheduler could take it in between).
                workload.idle_since = None
                workload.version += 1
                row.warned_at = row.warned_stop_at = row.notice = None
                what = "a kernel is running code" if report.kernels_busy else "it was used"
                _event(
                    session,
                    now,
                    EventKind.SESSION_ACTIVE_AGAIN,
                    f"in use again: {what}",
                    cause="session",
                    workload=workload,
                )
            return _state(workload, row)

    def session_state(self, workload_id: int, username: str | None) -> SessionState:
        with self.read() as session:
            workload = _live_session(session, workload_id, username)
            return _state(workload, session.get(SessionActivity, workload_id))

    def set_keep_alive(
        self,
        now: datetime,
        workload_id: int,
        username: str | None,
        until: datetime,
        limit: timedelta,
    ) -> datetime | None:
        """Keep a session from being culled or marked idle until ``until`` (a time in the
        past clears it); beyond ``now + limit`` is refused, saying what is allowed."""
        if until > now + limit:
            raise InvalidRequest(
                f"cannot keep the session alive until {until:%Y-%m-%d %H:%M} UTC: its "
                f"project allows at most {limit.total_seconds() / 3600:g} h ahead, so "
                f"until {now + limit:%Y-%m-%d %H:%M} UTC at the latest"
            )
        with self._write(now) as session:
            workload = _live_session(session, workload_id, username)
            row = _activity(session, workload_id)
            row.keep_alive_until = until if until > now else None
            row.warned_at = row.warned_stop_at = row.notice = None
            if workload.idle_since is not None:
                workload.idle_since = None
                workload.version += 1
            if row.keep_alive_until is not None:
                message = f"kept alive by {username or 'an admin'} until {until:%H:%M} UTC"
            else:
                message = "keep-alive cleared"
            _event(session, now, EventKind.SESSION_KEEP_ALIVE, message, workload=workload)
            return row.keep_alive_until

    def culler_sessions(self) -> list[CulledSession]:
        busy_at = (
            select(Allocation.workload_id, func.max(Gpu.busy_at).label("busy_at"))
            .join(Gpu, Gpu.uuid == Allocation.gpu_uuid)
            .where(Allocation.closed_at.is_(None))
            .group_by(Allocation.workload_id)
            .subquery()
        )
        query = (
            select(Workload, Project.name, SessionActivity, busy_at.c.busy_at)
            .join(Project, Project.id == Workload.project_id)
            .outerjoin(SessionActivity, SessionActivity.workload_id == Workload.id)
            .outerjoin(busy_at, busy_at.c.workload_id == Workload.id)
            .where(Workload.kind == WorkloadKind.session, Workload.state == WorkloadState.running)
            .order_by(Workload.id)
        )
        with self.read() as session:
            rows = session.execute(query).all()
            return [_culled(w, project, a, busy) for w, project, a, busy in rows]

    def post_session_notice(
        self, now: datetime, workload_id: int, level: str, message: str
    ) -> None:
        """What the session's start tells its user, shown for as long as it runs (beside
        any warning of the culler, which neither replaces nor withdraws it)."""
        with self._write(now) as session:
            _activity(session, workload_id).start_notice = _notice(now, level, message, None)

    def is_running(self, workload_id: int) -> bool:
        """Whether the workload is running now (not stopping, not ended)."""
        with self.read() as session:
            workload = session.get(Workload, workload_id)
            return workload is not None and workload.state == WorkloadState.running

    def last_cull(self, workload_id: int) -> tuple[datetime, str] | None:
        """When and why the culler stopped this server's previous session, if it did."""
        with self.read() as session:
            current = session.get(Workload, workload_id)
            if current is None:
                return None
            previous = session.scalars(
                select(Workload.id)
                .where(
                    Workload.username == current.username,
                    Workload.server_name == current.server_name,
                    Workload.id < workload_id,
                )
                .order_by(Workload.id.desc())
                .limit(1)
            ).first()
            if previous is None:
                return None
            cull = session.scalars(
                select(Event)
                .where(Event.workload_id == previous, Event.kind == EventKind.SESSION_CULL)
                .order_by(Event.id.desc())
                .limit(1)
            ).first()
            return (cull.at, cull.message) if cull is not None else None

    def hold_for_snapshot(self, now: datetime, workload_id: int, message: str) -> None:
        """The session stopped but its final snapshot failed: its GPUs stay allocated
        while its spawner retries (``end`` releases them once one commits)."""
        with self._write(now) as session:
            workload = session.get(Workload, workload_id)
            if workload is None or workload.state not in _LIVE:
                raise NotFound(f"no running session {workload_id}")
            if workload.snapshot_pending_since is None:
                workload.snapshot_pending_since = now
            _event(
                session,
                now,
                EventKind.SESSION_FINAL_SNAPSHOT_FAILED,
                f"{message}; its files stay where they are and its GPUs stay allocated "
                "while the snapshot is retried (an admin may release them)",
                reason="snapshot-pending",
                cause="spawner",
                workload=workload,
            )

    def record_session_event(
        self, now: datetime, workload_id: int, kind: EventKind, message: str, reason: str = ""
    ) -> None:
        with self._write(now) as session:
            workload = session.get(Workload, workload_id)
            _event(session, now, kind, message, reason=reason, cause="culler", workload=workload)

    def record_idle_decision(
        self,
        now: datetime,
        workload_id: int,
        action: str,
        reason: str,
        *,
        cause: str = "",
        last_active: datetime | None = None,
        due_at: datetime | None = None,
    ) -> bool:
        """What the culler decided for a session, as state and an event a user can read.
        False when the session is no longer running (nothing is written)."""
        with self._write(now) as session:
            workload = session.get(Workload, workload_id)
            if workload is None or workload.state is not WorkloadState.running:
                return False
            row = _activity(session, workload_id)
            kind = _DECISION_EVENTS.get(action)
            if kind is None:
                raise ValueError(f"unknown idle decision {action!r}")
            if action == "warn":
                row.warned_at, row.warned_stop_at = now, due_at
                row.notice = _notice(now, "warning", reason, due_at)
            elif action == "mark-idle":
                workload.idle_since = last_active or now
                workload.version += 1
                # A warning: it may be stopped at any moment now (keep-alive undoes it).
                row.notice = _notice(now, "warning", reason, None)
            elif action == "cull":
                row.notice = _notice(
                    now, "warning", f"{reason}: being snapshotted and stopped now", None
                )
            else:  # unmark, withdraw: in use again, the warning and notice go
                if action == "unmark":
                    workload.idle_since = None
                    workload.version += 1
                row.warned_at = row.warned_stop_at = row.notice = None
            _event(
                session,
                now,
                kind,
                reason,
                reason=cause,
                cause="culler",
                workload=workload,
                data={
                    "last_active": last_active.isoformat() if last_active else None,
                    "due_at": due_at.isoformat() if due_at else None,
                },
            )
            return True


def _state(workload: Workload, row: SessionActivity | None) -> SessionState:
    return SessionState(
        [n for n in (row.start_notice, row.notice) if n] if row is not None else [],
        row.keep_alive_until if row is not None else None,
        workload.project.name,
        workload.profile or "",
    )


def _live_session(session: Session, workload_id: int, username: str | None) -> Workload:
    workload = session.get(Workload, workload_id)
    if (
        workload is None
        or workload.kind is not WorkloadKind.session
        or workload.state not in _LIVE
        or (username is not None and workload.username != username)
    ):
        raise NotFound(
            f"no running session {workload_id}" + (f" of {username}" if username else "")
        )
    return workload


def _activity(session: Session, workload_id: int) -> SessionActivity:
    row = session.get(SessionActivity, workload_id)
    if row is None:
        row = SessionActivity(workload_id=workload_id, kernels=0, kernels_busy=False)
        session.add(row)
    return row


def _latest(known: datetime | None, reported: datetime | None, now: datetime) -> datetime | None:
    """A reported time, never later than now (a session's clock may run ahead)."""
    if reported is None:
        return known
    reported = min(reported, now)
    return reported if known is None else max(known, reported)


def _notice(now: datetime, level: str, message: str, deadline: datetime | None) -> dict[str, Any]:
    return {
        "id": f"{now.timestamp():.3f}",
        "level": level,
        "message": message[:1].upper() + message[1:],
        "deadline": deadline.isoformat() if deadline is not None else None,
    }


def _culled(
    w: Workload, project: str, a: SessionActivity | None, busy_at: datetime | None
) -> CulledSession:
    return CulledSession(
        workload_id=w.id,
        username=w.username,
        server_name=w.server_name,
        project=project,
        profile=w.profile or "",
        gpus=w.gpus,
        started_at=w.started_at or w.created_at,
        idle_since=w.idle_since,
        reported_at=a.reported_at if a else None,
        kernels_busy=a.kernels_busy if a else False,
        kernel_activity=a.kernel_activity if a else None,
        terminal_activity=a.terminal_activity if a else None,
        user_activity=a.user_activity if a else None,
        user_action=(a.user_action or "") if a else "",
        gpu_activity=busy_at,
        keep_alive_until=a.keep_alive_until if a else None,
        warned_at=a.warned_at if a else None,
        warned_stop_at=a.warned_stop_at if a else None,
        snapshot_sources=w.snapshot_sources,
    )
