"""Stopping the workloads the scheduler preempted, by the stop protocol of DESIGN.md.

A preempted workload is ``stopping`` in the database from the cycle that chose it; its
GPUs stay allocated until its backend has observed every process gone and ended it. For a
session that backend is the spawner: the controller asks the hub to stop the server, the
spawner ends every process carrying the session's marker, then releases the GPUs (the
snapshot before the stop comes with the snapshotter). The waiting workload is admitted by
the first cycle after that. A job's node agents learn from their next sync that it is
stopping, and end its ranks (SIGTERM, the grace period, SIGKILL) before reporting it gone.

The stop itself is ``ServerStopper``'s (``hub/stopper.py``), as for the culler and the
reconciler. The hub may be down or busy with that server: a victim still stopping is
asked again every ``retry_after`` seconds, so a controller restart or a failed call
delays a preemption but never loses it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from ..scheduler.snapshot import Running
from ..state.cycle import Stop
from .stopper import ServerStopper


class VictimStopper:
    def __init__(self, servers: ServerStopper, log: logging.Logger, retry_after: float):
        self.servers = servers
        self.log = log
        self.retry_after = retry_after
        self._asked: dict[int, float] = {}  # workload -> monotonic time of the last request
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self, stops: Iterable[Stop]) -> None:
        for victim in stops:
            self._asked[victim.workload_id] = time.monotonic()
            task = asyncio.create_task(self._stop(victim))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def retry(self, running: Iterable[Running], server_names: dict[int, str]) -> None:
        """Ask again for victims that are still stopping after ``retry_after``."""
        now = time.monotonic()
        again = [
            Stop(r.id, r.kind, r.user, server_names.get(r.id, ""), "still stopping")
            for r in running
            if r.stopping
            and r.stopping_for is not None
            and now - self._asked.get(r.id, 0.0) >= self.retry_after
        ]
        if again:
            self.stop(again)
        live = {r.id for r in running}
        for workload_id in list(self._asked):
            if workload_id not in live:
                del self._asked[workload_id]

    async def _stop(self, victim: Stop) -> None:
        if victim.kind != "session":
            return  # a job: its node agents see it stopping and stop its ranks
        # The reason the user reads was recorded when the stop was decided (a
        # ``preempting``, ``session-drained`` or ``node-lost-session`` event), once.
        await self.servers.stop(
            victim.user,
            victim.server_name,
            workload_id=victim.workload_id,
            message=victim.reason,
            by="scheduler",
        )
