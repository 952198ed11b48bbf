"""XIDs reach the agent's loop from a thread of their own, however busy the loop's shared
pool is."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from gpufleet.agent.xid_watch import XidWatch
from gpufleet.recovery.nvml import NvmlError, XidEvent


class Waits:
    """NVML's event wait: the XIDs queued for it, one per wait; a failure first."""

    def __init__(self, *xids: int) -> None:
        self.pending = [XidEvent(f"GPU-{code}", 0, code, 0.0) for code in xids]
        self.failed_once = False

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        if not self.failed_once:
            self.failed_once = True
            raise NvmlError("NVML failed while waiting for events: Unknown Error")
        if self.pending:
            return self.pending.pop(0)
        time.sleep(timeout_ms / 1000)
        return None


async def test_xids_arrive_in_order_while_the_shared_pool_is_busy() -> None:
    waits = Waits(79, 48)
    watch = XidWatch(waits, logging.getLogger("test"))  # type: ignore[arg-type]
    release = threading.Event()
    # Every worker of the loop's shared pool is taken (jobs' environments being pinned).
    busy = [asyncio.to_thread(release.wait, 30) for _ in range(64)]
    got: list[Any] = []
    try:
        async with asyncio.timeout(10):
            async for event in watch.events():
                got.append(event.xid)
                if len(got) == 2:
                    break
    finally:
        release.set()
        await asyncio.gather(*busy)
    assert got == [79, 48]  # after a failed wait, which the watch outlived
    deadline = time.monotonic() + 5
    while any(t.name == "xid-watch" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the watch's thread did not stop"
        await asyncio.sleep(0.05)
