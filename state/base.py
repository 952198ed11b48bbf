"""The store's foundation: sessions, the controller lease and fenced write transactions.

The invariant: the state is changed only through the methods of the store classes, and
every write transaction first re-asserts this controller's lease (``_fence``). A
controller that lost its lease raises :class:`LeaseLost` inside the transaction, which
rolls back, so two controllers can never both commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..scheduler.errors import LeaseLost, NotFound
from . import db
from .models import ControllerLease, Event, PriorityClass, Workload, WorkloadState

LEASE_NAME = "controller"


class StoreBase:
    def __init__(self, engine: Engine, holder: str, lease_ttl: timedelta = timedelta(seconds=15)):
        self.engine = engine
        self.holder = holder
        self.lease_ttl = lease_ttl
        self.epoch: int | None = None
        self._sessions = db.session_factory(engine)

    # ----------------------------------------------------------------- lease
    def try_acquire_lease(self, now: datetime) -> bool:
        """Take the controller lease if it is free, expired or already ours."""
        with db.transaction(self._sessions) as session:
            lease = session.get(ControllerLease, LEASE_NAME, with_for_update=True)
            if lease is None:
                lease = ControllerLease(
                    name=LEASE_NAME,
                    holder=self.holder,
                    epoch=1,
                    acquired_at=now,
                    expires_at=now + self.lease_ttl,
                )
                session.add(lease)
            elif lease.holder == self.holder and lease.epoch == self.epoch:
                lease.expires_at = now + self.lease_ttl
            elif lease.expires_at <= now or lease.holder == self.holder:
                lease.holder = self.holder
                lease.epoch += 1
                lease.acquired_at = now
                lease.expires_at = now + self.lease_ttl
            else:
                return False
            try:
                session.flush()
            except IntegrityError:  # another controller created the row first
                return False
            self.epoch = lease.epoch
            return True

    def _fence(self, session: Session, now: datetime) -> None:
        result = session.execute(
            update(ControllerLease)
            .where(
                ControllerLease.name == LEASE_NAME,
                ControllerLease.holder == self.holder,
                ControllerLease.epoch == self.epoch,
            )
            .values(expires_at=now + self.lease_ttl)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            raise LeaseLost(f"controller {self.holder} no longer holds the database lease")

    @contextmanager
    def _write(self, now: datetime) -> Iterator[Session]:
        """A write transaction that commits only while this controller holds the lease.

        A lost lease raises inside the transaction, which then rolls back and closes.
        """
        with db.transaction(self._sessions) as session:
            self._fence(session, now)
            yield session

    def read(self) -> Session:
        return self._sessions()

    def _end(
        self, session: Session, now: datetime, workload: Workload, outcome: str, message: str
    ) -> None:
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
