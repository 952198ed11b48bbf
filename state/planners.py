"""Where a scheduling cycle is planned when it is not on the event loop: a thread, or a
process of its own (the controller's choice, ``AdmissionCycles.planner``; the figures
that made it are in ``hub/scheduling.py``).

Both plan through ``SchedulingStore.plan_cycle`` and ``settle_cycle`` and hand back a
``PlannedCycle`` for the controller to commit on its event loop (``commit_cycle``). One
cycle at a time: the controller awaits each plan, and a planner runs its calls in order
on one worker thread, so a settle always lands before the next plan.

- ``ThreadPlanner`` plans with the controller's own store, mirror and memo, on that
  thread. Python's GIL is shared with the event loop while it plans.
- ``ProcessPlanner`` plans in a child process (``python -m
  gpufleet.state.planners``) with a store, a mirror and a memo of its own over
  the same database, which it only reads. The controller's change tracker stays in the
  controller: each plan request carries what it noted since the last one. The child
  ends when the controller closes the connection or dies (it reads end-of-file), and is
  started again, reading everything afresh, when it died.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from ..scheduler.errors import SchedulerError
from ..scheduler.snapshot import Plan, Policy
from . import db
from .collector import collect_all, collector_paused
from .cycle import Change, Outcome, PlannedCycle, SchedulingStore
from .database import Database

T = TypeVar("T")
# How long a child that does not stop when asked may take before it is killed.
STOP_GRACE_S = 2.0
# The planning process's niceness: where the two compete for the CPU, the controller's
# API comes first, and the cycles take longer.
NICENESS = 5


class PlanningFailed(SchedulerError):
    """The planning process failed to plan a cycle, or died; the next cycle reads the
    database afresh."""


class _OneThread:
    """Calls run one after another on one thread of their own, away from the event loop."""

    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn`` after the calls before it; nobody waits for it."""
        self._executor.submit(fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class ThreadPlanner:
    """Plans with ``store`` itself, on a worker thread."""

    def __init__(self, store: SchedulingStore):
        self.store = store
        self._thread = _OneThread("gpufleet-planner")

    async def plan(self, now: datetime, policy: Policy) -> PlannedCycle:
        return await self._thread.call(self._plan, now, policy)

    def _plan(self, now: datetime, policy: Policy) -> PlannedCycle:
        with collector_paused():
            return self.store.plan_cycle(now, policy)

    def settle(self, outcome: Outcome) -> None:
        self._thread.post(self.store.settle_cycle, outcome)

    def collect(self) -> None:
        """Nothing: the controller's own full collection covers this thread's memory."""

    def close(self) -> None:
        self._thread.close()


class ProcessPlanner:
    """Plans in a child process over ``store``'s database (see the module docstring)."""

    def __init__(self, store: SchedulingStore, niceness: int = NICENESS):
        url = store.database.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            raise ValueError(
                "the planning process cannot open an in-memory SQLite database; give "
                "c.FleetController.db_url a file, or set c.AdmissionCycles.planner = 'thread'"
            )
        self.store = store
        self._url = url.render_as_string(hide_password=False)
        self._niceness = niceness
        self._thread = _OneThread("gpufleet-planner")
        self._child: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        # When the plan being made was asked for (time.monotonic()); None between plans.
        self.asked_at: float | None = None

    @property
    def pid(self) -> int | None:
        """The planning process's, while one runs (it starts with the first plan)."""
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    async def plan(self, now: datetime, policy: Policy) -> PlannedCycle:
        # Taken on the event loop, where the tracker's other readers are; what was taken
        # is lost with a failed plan, after which the child reads everything anyway.
        dirty = self.store.tracker.take()
        return await self._thread.call(self._plan, now, policy, dirty)

    def settle(self, outcome: Outcome) -> None:
        self._thread.post(self._send, ("settle", outcome))

    def collect(self) -> None:
        """A full garbage collection in the planning process (``collector.collect_all``),
        between two plans."""
        self._thread.post(self._send, ("collect", None))

    def close(self) -> None:
        """Stop the child (at once: a plan it is making is of no use now)."""
        self._thread.close()
        self._stop()

    # -------------------------------------------------------- the worker thread
    def _plan(self, now: datetime, policy: Policy, dirty: set[Change]) -> PlannedCycle:
        if self._child is None or self._child.poll() is not None:
            try:
                self._start()
            except OSError as e:
                self._stop()
                raise PlanningFailed(f"could not start the planning process: {e}") from e
        assert self._connection is not None
        try:
            self._connection.send(("plan", now, policy, dirty))
            self.asked_at = time.monotonic()
            kind, answer = self._connection.recv()
        except (EOFError, OSError) as e:
            status = self._child.poll() if self._child else None
            self._stop()
            raise PlanningFailed(f"the planning process ended (exit status {status})") from e
        finally:
            self.asked_at = None
        if kind == "error":
            raise PlanningFailed(f"the planning process could not plan: {answer}")
        planned: PlannedCycle = answer
        return planned

    def _send(self, message: tuple[str, Any]) -> None:
        if self._connection is None:
            return
        try:
            self._connection.send(message)
        except OSError:
            self._stop()  # it died: the next plan starts another

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair()
        with ours, theirs:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
            self._connection = Connection(os.dup(ours.fileno()))
        # The database's address goes through the connection: a password in it must not
        # be on a command line that anyone can list.
        self._connection.send(("open", self._url, self._niceness))

    def _stop(self) -> None:
        connection, child = self._connection, self._child
        self._connection = self._child = None
        if connection is not None:
            connection.close()  # the child reads end-of-file and exits
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


# ------------------------------------------------------------- the child's side
def serve(connection: Connection) -> None:
    """Answer plan and settle requests until the controller closes the connection."""
    _, url, niceness = connection.recv()
    os.nice(niceness)
    store = SchedulingStore(Database(db.make_engine(url), "planner"))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message[0] == "settle":
            with collector_paused():
                store.settle_cycle(message[1])
            continue
        if message[0] == "collect":
            collect_all()
            continue
        _, now, policy, dirty = message
        try:
            with collector_paused():
                planned = store.plan_cycle(now, policy, dirty, idle=True)
        except (SQLAlchemyError, SchedulerError) as e:
            connection.send(("error", f"{type(e).__name__}: {e}"))
            continue
        connection.send(("planned", _for_the_controller(planned)))


def _for_the_controller(planned: PlannedCycle) -> PlannedCycle:
    """``planned`` without the plan's waits, which the controller does not read (and
    which would cost more to send than anything else)."""
    decided = planned.result.plan
    decisions = Plan(
        admissions=decided.admissions,
        preemptions=decided.preemptions,
        kept=decided.kept,
        held=decided.held,
        spares=decided.spares,
    )
    return replace(planned, result=replace(planned.result, plan=decisions))


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the controller stops this child itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(int(argv[0]))
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        serve(connection)  # until the controller is gone


if __name__ == "__main__":
    main(sys.argv[1:])
