"""Fault injection for crash tests: named points where a test can make this process die.

A failpoint fires when ``$GPUFLEET_FAILPOINTS_DIR/<name>`` exists. It removes the file
first (so a restarted process does not die again) and then SIGKILLs the process: no
``finally`` block, no rollback, exactly like a power cut. Without the variable set,
reaching a failpoint costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def reach(name: str) -> None:
    directory = os.environ.get("GPUFLEET_FAILPOINTS_DIR")
    if not directory:
        return
    try:
        (Path(directory) / name).unlink()
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
