"""The watch over the node agents' heartbeats as a component of the controller: a node
whose agent has not reported for ``c.NodeWatch.heartbeat_timeout`` seconds becomes
unknown and takes no new work; once the silence passes ``job_agent_lost_seconds`` its
jobs resume elsewhere (docs/recovery.md, "A silent node agent"). Kubernetes nodes come
from each cluster's watch instead (kube_inventory.py)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float

from ..scheduler.errors import SchedulerError
from ..state.jobs import JobStore
from .components import LoopComponent
from .metrics import ControllerMetrics
from .notifier import Notifier


class SilenceState(Protocol):
    """The repositories this loop uses (the jobs of silent nodes; ``FleetStore`` holds them all)."""

    jobs: JobStore


class WatchingController(Protocol):
    """What the watch uses of the controller (``app.FleetController``)."""

    metrics: ControllerMetrics
    notifier: Notifier
    is_leader: bool
    leading_since: datetime | None
    job_agent_lost_seconds: float

    def now(self) -> datetime: ...

    def kick(self) -> None: ...

    @property
    def store(self) -> SilenceState: ...


class NodeWatch(LoopComponent):
    heartbeat_timeout = Float(
        30.0,
        help="A node whose agent has not reported for this many seconds is marked unknown and "
        "receives no new work.",
    ).tag(config=True)

    def __init__(self, controller: WatchingController, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.controller = controller
        self._previous: datetime | None = None  # this leader's last pass: each silence acts once

    async def run(self) -> None:
        while True:
            await asyncio.sleep(max(self.heartbeat_timeout / 3, 0.2))
            self.run_once()

    def run_once(self) -> None:
        c = self.controller
        timeout = timedelta(seconds=self.heartbeat_timeout)
        jobs_after = timedelta(seconds=c.job_agent_lost_seconds)
        now = c.now()
        # Agents could not report while no controller held the lease: silence counts
        # only once this one has led for the whole timeout.
        since = c.leading_since
        if not c.is_leader or since is None or now - since < timeout:
            self._previous = None
            return
        try:
            lost = c.store.jobs.lose_silent_nodes(now, timeout, jobs_after, self._previous)
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("could not check node heartbeats")
            return
        self._previous = now
        if lost.nodes:
            self.log.warning("nodes stopped reporting", extra={"nodes": lost.nodes})
        for fault in lost.restarted:
            c.metrics.job_restarts.labels(fault).inc()
        if lost.changed:
            c.notifier.changed(lost.changed)
            c.kick()
