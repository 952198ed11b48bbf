"""The controller's admission cycles: one at a time, planned away from the event loop.

Every ``c.AdmissionCycles.interval`` seconds, or at once when kicked (a request arrived, GPUs
were released), the controller that holds the lease runs a scheduling cycle
(``state/cycle.py``). At 16,000 GPUs and 10,000 waiting a cycle takes up to
100-470 ms (p99, ``bench/scheduler_cycle.py``), nearly all of it refreshing the mirror
and planning; run on the event loop, every API request, agent heartbeat and spawner
long poll would wait for it.

So a cycle is planned elsewhere (``c.AdmissionCycles.planner``) and only committed here:

- ``process`` (the default): in a child process of its own, with its own mirror and
  memo (``state/planners.py``), at niceness 5 so that where the two compete
  for a core the API comes first. The event loop keeps its CPU and its GIL.
- ``thread``: on a worker thread of the controller. It holds Python's GIL while it
  plans; the event loop gets it back only every switch interval (5 ms), after each
  database call and socket read of a request, so a request's CPU time is shared with
  the plan.
- ``loop``: all of it on the event loop, as before; for comparison.

Measured with ``bench/api_during_cycles.py`` (the 16,000-GPU world planned cycle after
cycle while 40 writes a second come in; the real handlers and store in-process; the
client in another process): p99 of the queue (``GET /workloads?state=pending``) and of
a researcher's own sessions while cycling, over the same with no cycle running, rounds
of the three interleaved. 2026-12-05 on the 2-core development machine, shared with
other work (load average 5-7):

    planner    queue p99 ratio   sessions p99 ratio   sessions p50 ratio   cycle p50
    loop            3.34               3.48                 7.6             42 ms
    thread          1.91               3.70                 2.6             84 ms
    process         1.45               1.36                 1.3            158 ms

A shorter switch interval (0.5 ms) brings the thread's queue to 1.06 but its sessions
stay at 1.78: the GIL is shared, not yielded. The process pays for the read it makes of
the database on its own (a full one at start, 1.2-2.6 s at this scale) and for its
second copy of the mirror; its cycles take longer where it yields the CPU to the API.

The commit stays on the event loop, beside the handlers' writes: the decisions in one
fenced transaction (``commit_cycle``, which drops a plan that something committed since
its read made stale: a node cordoned, a request withdrawn, another controller's
writes; the next cycle plans again at once), then the rest of the waiting
rows' reasons and positions, ``WAITS_PER_TRANSACTION`` at a time with the loop free in
between (after a full read that is the whole queue: 10,000 rows, 100-250 ms at once).

Stopping the controller while a cycle is planned cancels the wait for it: nothing was
written, the child process is stopped, and the next controller reads everything afresh.
A commit is synchronous on the loop, so a stop cannot cut it in half; it can fall
between two transactions of waits rows, which the next full read rewrites.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from datetime import datetime
from logging import Logger
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Enum, Float, Integer
from traitlets.config import Configurable

from ..scheduler.errors import LeaseLost, SchedulerError
from ..scheduler.snapshot import Plan, Policy, Running
from ..state.collector import collect_all
from ..state.cycle import CycleResult, Outcome, PlannedCycle, SchedulingStore, Stop
from ..state.planners import ProcessPlanner, ThreadPlanner
from ..state.workloads import WorkloadStore
from .components import LoopComponent
from .metrics import ControllerMetrics
from .notifier import Notifier

PLANNERS = ("process", "thread", "loop")
# Waiting rows' reasons and positions written per transaction after the decisions: at
# 16,000 GPUs, 15-25 ms of the event loop each.
WAITS_PER_TRANSACTION = 1000


class Victims(Protocol):
    """Who asks the backends to stop preempted workloads (``victims.VictimStopper``)."""

    def stop(self, stops: Iterable[Stop]) -> None: ...

    def retry(self, running: Iterable[Running], server_names: dict[int, str]) -> None: ...


class AdmissionState(Protocol):
    """The repositories the admission cycles use (``state.fleet.FleetStore`` holds them):
    the cycle's, and the waiting requests' leases it expires first."""

    scheduling: SchedulingStore
    workloads: WorkloadStore


class SchedulingController(Protocol):
    """What the admission cycles use of the controller (``app.FleetController``)."""

    log: Logger
    metrics: ControllerMetrics
    notifier: Notifier
    is_leader: bool
    spare_nodes: frozenset[str]

    def now(self) -> datetime: ...

    @property
    def victims(self) -> Victims: ...

    @property
    def store(self) -> AdmissionState: ...

    # Nodes kept free per zone for restarting jobs (``c.FleetController.recovery_spares``).
    recovery_spares: dict[str, int]


class AdmissionCycles(LoopComponent):
    interval = Float(
        1.0, help="Seconds between admission cycles when nothing else triggers one."
    ).tag(config=True)

    planner = Enum(
        PLANNERS,
        "process",
        help="Where admission cycles are planned (hub/scheduling.py): 'process', a child "
        "process (the API answers as fast while a cycle is planned); 'thread', a worker "
        "thread (needs no second process, but shares Python's GIL with the API); 'loop', "
        "the event loop itself (the API waits for every cycle).",
    ).tag(config=True)

    min_run_time_seconds = Float(
        300.0,
        help="A workload that started less than this long ago is not preempted to make room "
        "(idle sessions aside): a researcher gets at least this much of what was admitted.",
    ).tag(config=True)

    max_preemption_searches = Integer(
        64,
        help="Waiting workloads that may look for victims in one scheduling cycle; the rest "
        "look in later cycles. Bounds a cycle's time when thousands could ask at once.",
    ).tag(config=True)

    preemption_retry_seconds = Float(
        30.0,
        help="A preempted session the hub has not stopped yet is asked again this often.",
    ).tag(config=True)

    full_collection_interval = Float(
        600.0,
        help="Seconds between full garbage collections of the controller's memory, run "
        "after an admission cycle. Cycles run with the collector paused and freeze what "
        "survives them (state/collector.py); this returns what became cyclic "
        "garbage after being frozen. At 16,000 GPUs one takes 80-90 ms.",
    ).tag(config=True)

    def __init__(
        self, controller: SchedulingController, parent: Configurable | None = None, **kwargs: Any
    ) -> None:
        super().__init__(parent=parent, **kwargs)
        self.controller = controller
        # Where cycles are planned away from the event loop; None: on it.
        self.worker: ProcessPlanner | ThreadPlanner | None = None
        if self.planner == "process":
            self.worker = ProcessPlanner(controller.store.scheduling)
        elif self.planner == "thread":
            self.worker = ThreadPlanner(controller.store.scheduling)
        self._kicked = asyncio.Event()
        self._last_full_collection = time.monotonic()

    @property
    def policy(self) -> Policy:
        spares = self.controller.recovery_spares
        return Policy(
            min_run_time_s=self.min_run_time_seconds,
            max_preemption_searches=self.max_preemption_searches,
            spares=tuple(sorted(spares.items())),
        )

    def kick(self) -> None:
        """Run a cycle soon."""
        self._kicked.set()

    async def run(self) -> None:
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kicked.wait(), self.interval)
                self._kicked.clear()
                if self.controller.is_leader:
                    await self.run_cycle()
        finally:
            self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    async def run_cycle(self) -> CycleResult | None:
        """One admission cycle and what follows from it: metrics, the victims' stops,
        the watchers woken. None when it failed (logged; the next one retries)."""
        c = self.controller
        started = time.perf_counter()
        now = c.now()
        try:
            expired = c.store.workloads.expire_leases(now)
            result = await self._cycle(now)
        except LeaseLost:
            c.is_leader = False
            c.log.warning("lost the database lease during an admission cycle; standing by")
            return None
        except (SQLAlchemyError, SchedulerError):
            c.log.exception("admission cycle failed; retrying next cycle")
            return None
        c.metrics.cycle_duration.observe(time.perf_counter() - started)
        if time.monotonic() - self._last_full_collection >= self.full_collection_interval:
            freed = collect_all()
            if self.worker is not None:
                self.worker.collect()
            self._last_full_collection = time.monotonic()
            c.log.debug("full garbage collection freed %d objects", freed)
        for admitted in result.admitted:
            c.metrics.admissions.labels(admitted.gpu_type).inc()
            c.metrics.wait_time.labels(admitted.project).observe(admitted.waited_seconds)
        for preemption in result.plan.preemptions:
            c.metrics.preemptions.labels(preemption.cause.value).inc()
        for _ in expired:
            c.metrics.ended.labels("session", "expired").inc()
        if result.dropped:
            c.log.info("a cycle's plan went stale while it was made; planning again")
            self.kick()
        else:
            c.spare_nodes = frozenset(n for names in result.plan.spares.values() for n in names)
            c.victims.stop(result.stops)  # before the retries: these were just asked
            c.victims.retry(result.stopping, result.server_names)
        c.notifier.changed([*expired, *result.changed])
        if result.admitted or expired or result.stops:
            c.log.info(
                "admission cycle",
                extra={
                    "admitted": [a.workload_id for a in result.admitted],
                    "preempted": [s.workload_id for s in result.stops],
                    "expired": expired,
                },
            )
        return result

    async def _cycle(self, now: datetime) -> CycleResult:
        store = self.controller.store
        policy = self.policy
        if self.worker is None:
            return store.scheduling.scheduling_cycle(now, policy)
        planned = await self.worker.plan(now, policy)
        outcome = Outcome.FAILED
        try:
            committed = store.scheduling.commit_cycle(planned, WAITS_PER_TRANSACTION)
            outcome = await self._write_waits(planned) if committed else Outcome.DROPPED
        finally:
            self.worker.settle(outcome)
        if outcome is Outcome.DROPPED:
            return CycleResult((), (), (), Plan(), dropped=True)
        if planned.idle is not None:
            store.scheduling.last_idle = planned.idle
        return planned.result

    async def _write_waits(self, planned: PlannedCycle) -> Outcome:
        """The waits rows the commit left, a transaction at a time with the event loop
        free in between. FAILED when some could not be written: the mirror is then read
        afresh, which writes them all again."""
        rows = planned.waits
        try:
            for first in range(WAITS_PER_TRANSACTION, len(rows), WAITS_PER_TRANSACTION):
                await asyncio.sleep(0)  # the requests that came meanwhile first
                self.controller.store.scheduling.write_waits(
                    planned.now, rows[first : first + WAITS_PER_TRANSACTION]
                )
        except (SQLAlchemyError, SchedulerError):
            self.controller.log.exception("could not write why workloads wait; next cycle will")
            return Outcome.FAILED
        return Outcome.COMMITTED
