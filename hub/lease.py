"""The database lease, the fence of every loop of the controller: the one controller that
holds it writes and runs the loops; another stands by and takes over
``c.FleetController.db_lease_seconds`` after the holder stops renewing it (rolling
updates, crashes). A loop acts only while ``is_leader`` (each store write is fenced by
the lease besides, so a controller that lost it mid-way commits nothing)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from logging import Logger
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from ..scheduler.errors import LeaseLost
from ..state.cycle import SchedulingStore
from ..state.workloads import WorkloadStore
from .timed import TimedWork


class LeaseState(Protocol):
    """What the lease holder uses of the database (``state.fleet.FleetStore``)."""

    scheduling: SchedulingStore
    workloads: WorkloadStore

    @property
    def holder(self) -> str: ...

    def try_acquire_lease(self, now: datetime) -> bool: ...

    def release_lease(self, now: datetime) -> bool: ...


class LeasingController(Protocol):
    """What the lease holder sets and uses of the controller (``app.FleetController``)."""

    log: Logger
    timed: TimedWork
    is_leader: bool
    leading_since: datetime | None
    db_lease_seconds: float

    def now(self) -> datetime: ...

    def kick(self) -> None: ...

    @property
    def request_lease(self) -> timedelta: ...

    @property
    def store(self) -> LeaseState: ...


class LeaseHolder:
    def __init__(self, controller: LeasingController):
        self.controller = controller
        self.became_leader = asyncio.Event()  # set the first time this one leads

    async def run(self) -> None:
        while True:
            self.renew()
            await asyncio.sleep(self.controller.db_lease_seconds / 3)

    def release(self) -> None:
        """Give the lease up on a clean stop, once every loop has stopped: the controller
        that replaces this one leads at once instead of a lease's length later."""
        c = self.controller
        if not c.is_leader:
            return
        c.is_leader = False
        try:
            if c.store.release_lease(c.now()):
                c.log.info("gave up the database lease")
        except SQLAlchemyError:
            c.log.exception("could not give up the database lease; it lapses by itself")

    def renew(self) -> None:
        """Take or renew the lease; lead or stand by according to the answer."""
        c = self.controller
        was_leader = c.is_leader
        try:
            held = c.store.try_acquire_lease(c.now())
            if held and not was_leader:
                c.store.scheduling.forget_mirror()  # another controller may have written
                extended = c.store.workloads.extend_leases(c.now(), c.request_lease)
                c.log.info(
                    "holding the database lease as %s; renewed %d waiting request(s)",
                    c.store.holder,
                    extended,
                )
        except (SQLAlchemyError, LeaseLost):
            c.log.exception("could not take or renew the database lease")
            held = False
        if not held and was_leader:
            c.log.warning("lost the database lease; standing by")
        elif not held:
            c.log.info("another controller holds the database lease; standing by")
        c.is_leader = held
        if not held:
            c.leading_since = None
        elif not was_leader:
            c.leading_since = c.now()
        if held != was_leader:
            (c.timed.lead if held else c.timed.follow)()
        if held:
            self.became_leader.set()
            if not was_leader:
                c.kick()
