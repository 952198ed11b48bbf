"""How the platform's long-running services (the controller, the node agent) stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any

STOP_GRACE_SECONDS = 3.0


async def until_stopped(main: Coroutine[Any, Any, Any], log: logging.Logger) -> None:
    """Run ``main`` until SIGINT or SIGTERM (JupyterHub stops a managed service with
    SIGINT, and SIGTERM 10 s later), then cancel it. The process exits within
    ``STOP_GRACE_SECONDS`` even if a worker thread is stuck in a blocking call (an NVML
    wait, a sandbox probe, a snapshot scan), which asyncio.run and the interpreter would
    otherwise wait for."""
    task = asyncio.ensure_future(main)

    def stop(received: signal.Signals) -> None:
        log.info("%s: stopping", received.name)
        watchdog = threading.Timer(STOP_GRACE_SECONDS, os._exit, (0,))
        watchdog.daemon = True
        watchdog.start()
        task.cancel()

    loop = asyncio.get_running_loop()
    for received in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(received, stop, received)
    with contextlib.suppress(asyncio.CancelledError):
        await task
