"""What every repository builds on: the database it reads and writes through, and the
row helpers more than one capability uses within a transaction.

The invariant: the state is changed only through the repositories' methods, and every write
goes through ``Database.write``, which re-asserts this controller's lease first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..scheduler.errors import NotFound
from .database import Database
from .models import Event, PriorityClass, Workload, WorkloadState


class Repository:
    """One capability's reads and writes (``state/fleet.py`` lists them all)."""

    def __init__(self, database: Database):
        self.database = database

    @contextmanager
    def _write(self, now: datetime) -> Iterator[Session]:
        with self.database.write(now) as session:
            yield session

    def read(self) -> Session:
        return self.database.read()


def end_workload(
    session: Session, now: datetime, workload: Workload, outcome: str, message: str
) -> None:
    """End ``workload`` in this transaction: its allocations close, its event is written."""
    for allocation in workload.allocations:
        if allocation.closed_at is None:
            allocation.closed_at = now
    if workload.preempted_for_id is not None and workload.state == WorkloadState.stopping:
        # However its backend ends it, a preempted workload ended for being preempted.
        message = f"{workload.reason}; {message}" if message else workload.reason
        outcome = "preempted"
    workload.state = WorkloadState.ended
    workload.queue_position = None
    workload.outcome = outcome
    workload.ended_at = now
    workload.lease_expires_at = None
    workload.reason = message
    workload.version += 1
    _event(
        session,
        now,
        EventKind.ENDED,
        f"workload {workload.id} ended ({outcome}): {message}",
        reason=outcome,
        workload=workload,
    )


def _event(
    session: Session,
    now: datetime,
    kind: EventKind,
    message: str,
    *,
    reason: str = "",
    cause: str = "",
    workload: Workload | None = None,
    node: str | None = None,
    data: dict[str, Any] | None = None,
    username: str | None = None,
) -> None:
    session.add(
        Event(
            at=now,
            kind=kind,
            message=message,
            reason=reason,
            cause=cause,
            workload_id=workload.id if workload is not None else None,
            project=workload.project.name if workload is not None else None,
            username=workload.username if workload is not None else username,
            node=node,
            data=data or {},
        )
    )


def _get_workload(session: Session, workload_id: int) -> Workload:
    workload = session.get(Workload, workload_id)
    if workload is None:
        raise NotFound(f"there is no workload {workload_id}")
    return workload


def _preemptible(session: Session, priority_class: str) -> bool:
    known = session.get(PriorityClass, priority_class)
    return bool(known and known.preemptible_by_default)
