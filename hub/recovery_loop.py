"""The recovery loop (docs/recovery.md) as a component of the controller: while the
controller holds the database lease, it stops the jobs that stopped progressing (they
come back as their next attempt) and asks the node agents for the maintenance that became
possible. Its option is ``c.RecoveryLoop.hang_check_interval``; what counts as a hang
is the store's recovery policy (``c.FleetController.job_hang_*``, hub/recovery_options.py)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from logging import Logger
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float

from ..scheduler.errors import SchedulerError
from ..state.jobs import JobStore
from ..state.maintenance import MaintenanceStore
from ..state.traces import TraceStore
from .components import LoopComponent
from .notifier import Notifier


class RecoveryState(Protocol):
    """The repositories this loop uses (hung jobs, due maintenance; ``FleetStore``'s)."""

    jobs: JobStore
    maintenance: MaintenanceStore
    traces: TraceStore


class RecoveringController(Protocol):
    """What the recovery loop uses of the controller (``app.FleetController``)."""

    notifier: Notifier
    is_leader: bool
    log: Logger

    def now(self) -> datetime: ...

    @property
    def store(self) -> RecoveryState: ...


class RecoveryLoop(LoopComponent):
    hang_check_interval = Float(
        5.0, min=0.1, help="Seconds between the recovery loop's looks for hung jobs."
    ).tag(config=True)

    def __init__(self, controller: RecoveringController, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.controller = controller

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.hang_check_interval)
            if self.controller.is_leader:
                self.run_once()

    def run_once(self) -> None:
        c = self.controller
        try:
            stopped = c.store.jobs.stop_hung_jobs(c.now())
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("recovery: looking for hung jobs failed; retrying")
            return
        if stopped:
            self.log.warning("recovery: stopping hung job(s) %s after their stacks", stopped)
            c.notifier.changed(stopped)  # the node agents take their stacks, then stop them
        try:
            traced = c.store.traces.close_expired(c.now())
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("recovery: closing expired traces failed; retrying")
            return
        if traced:
            c.notifier.changed(traced)  # a hung gang waiting for its stacks is stopped now
        try:
            asked = c.store.maintenance.start_due_maintenance(c.now())
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("recovery: starting due maintenance failed; retrying")
            return
        if asked:
            self.log.info("recovery: maintenance asked of the node agents: %s", asked)
            c.notifier.wake_agents()
