"""XIDs as NVML delivers them, waited for on a thread of the agent's own.

NVML's event wait blocks. On the event loop's shared pool it would queue behind whatever
else runs there (an environment pinned for a job's ranks takes seconds, and several jobs
may start at once), and an XID would reach the recovery loop late: the thread here does
nothing but wait, so an XID is handed to the loop as soon as NVML has it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from ..recovery.nvml import Nvml, NvmlError, XidEvent

WAIT_MS = 500  # one wait; the thread checks between waits whether it should stop


class XidWatch:
    def __init__(self, nvml: Nvml, log: logging.Logger | logging.LoggerAdapter[logging.Logger]):
        self.nvml = nvml
        self.log = log
        self._stop = threading.Event()

    async def events(self) -> AsyncIterator[XidEvent]:
        """Every XID from now on, in order, for as long as the caller iterates."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[XidEvent] = asyncio.Queue()
        thread = threading.Thread(
            target=self._wait, args=(loop, queue), name="xid-watch", daemon=True
        )
        thread.start()
        try:
            while True:
                yield await queue.get()
        finally:
            self._stop.set()

    def _wait(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[XidEvent]) -> None:
        while not self._stop.is_set():
            try:
                event = self.nvml.wait_xid(WAIT_MS)
            except NvmlError as e:
                self.log.error("%s; trying again", e)
                time.sleep(1)
                continue
            if event is not None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                except RuntimeError:  # the loop has closed: the agent is stopping
                    return
