"""Wakes long-polling callers when a workload's visible state changes (in-process only)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable


class Notifier:
    def __init__(self) -> None:
        self._waiters: dict[int, set[asyncio.Event]] = defaultdict(set)
        self._any: set[asyncio.Event] = set()  # node agents: any workload changed
        self.stopping = False

    def changed(self, workload_ids: Iterable[int]) -> None:
        woken = False
        for workload_id in workload_ids:
            woken = True
            for waiter in self._waiters.pop(workload_id, ()):
                waiter.set()
        if woken:
            for waiter in self._any:
                waiter.set()
            self._any.clear()

    def wake_agents(self) -> None:
        """Answer every node agent's long poll now (new work for them that is no
        workload's change: a maintenance operation)."""
        for waiter in self._any:
            waiter.set()
        self._any.clear()

    def stop(self) -> None:
        """Answer every long poll now, and every later one at once: the controller is
        stopping, and each caller gets an answer of what is rather than an error."""
        self.stopping = True
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.set()
        self.wake_agents()

    async def wait_for_any_change(self, within: float) -> None:
        """Return when any workload changes or after ``within`` seconds (same guarantee
        as ``wait_for_change``)."""
        if self.stopping:
            return
        waiter = asyncio.Event()
        self._any.add(waiter)
        try:
            await asyncio.wait_for(waiter.wait(), within)
        except TimeoutError:
            pass
        finally:
            self._any.discard(waiter)

    async def wait_for_change(self, workload_id: int, within: float) -> None:
        """Return when ``workload_id`` changes or after ``within`` seconds.

        Every write to the store happens on this event loop, and the waiter is registered
        before this coroutine first yields: a caller that read the row and then awaits this
        without yielding in between cannot miss a change.
        """
        if self.stopping:
            return
        waiter = asyncio.Event()
        self._waiters[workload_id].add(waiter)
        try:
            await asyncio.wait_for(waiter.wait(), within)
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(workload_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[workload_id]
