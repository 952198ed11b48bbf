"""One database as the controller holds it: its sessions, the controller lease, and the
fenced write transactions every repository writes through.

The invariant: every write transaction first re-asserts this controller's lease
(``fence``). A controller that lost its lease raises :class:`LeaseLost` inside the
transaction, which rolls back, so two controllers can never both commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from sqlalchemy import Engine, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..scheduler.errors import LeaseLost
from . import db
from .models import ControllerLease

LEASE_NAME = "controller"


class Database:
    def __init__(self, engine: Engine, holder: str, lease_ttl: timedelta = timedelta(seconds=15)):
        self.engine = engine
        self.holder = holder
        self.lease_ttl = lease_ttl
        self.epoch: int | None = None
        self.sessions = db.session_factory(engine)

    def try_acquire_lease(self, now: datetime) -> bool:
        """Take the controller lease if it is free, expired or already ours."""
        with db.transaction(self.sessions) as session:
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

    def release_lease(self, now: datetime) -> bool:
        """Give the lease up, if this controller holds it: a standby takes it at its next
        try rather than a lease's length after the last renewal (a controller that stops
        cleanly, as in a rolling update). Whether it was held."""
        with db.transaction(self.sessions) as session:
            held = self._expire_ours(session, now)
        self.epoch = None
        return held

    def fence(self, session: Session, now: datetime) -> None:
        if not self._expire_ours(session, now + self.lease_ttl):
            raise LeaseLost(f"controller {self.holder} no longer holds the database lease")

    def _expire_ours(self, session: Session, expires_at: datetime) -> bool:
        """Set the lease's expiry if this controller holds it (this holder, this epoch);
        whether it did."""
        result = session.execute(
            update(ControllerLease)
            .where(
                ControllerLease.name == LEASE_NAME,
                ControllerLease.holder == self.holder,
                ControllerLease.epoch == self.epoch,
            )
            .values(expires_at=expires_at)
        )
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    @contextmanager
    def write(self, now: datetime) -> Iterator[Session]:
        """A write transaction that commits only while this controller holds the lease.

        A lost lease raises inside the transaction, which then rolls back and closes.
        """
        with db.transaction(self.sessions) as session:
            self.fence(session, now)
            yield session

    def read(self) -> Session:
        return self.sessions()
