"""The tier's server processes: each in a process group of its own, its output in a log
file, stopped by killing the group; and polling with a deadline that fails early, with the
log's end, when a server it waits on has exited."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

STOP_DEADLINE_S = 10.0


class TierStartError(RuntimeError):
    """A server of the tier did not come up; the message carries the end of its log."""


def die_with_parent() -> None:
    """In the child before exec: be killed if the test process dies without stopping us
    (PR_SET_PDEATHSIG). Only for processes started from a thread that lives as long as the
    test process (the main thread; the test kubelet's launcher thread), since the signal
    follows the starting thread."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class ManagedProcess:
    """One server process in a process group of its own, its output in ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(
                    die_with_parent
                    if threading.current_thread() is threading.main_thread()
                    else None
                ),
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after ``STOP_DEADLINE_S``, then to any leftover."""
        if self.process is None:
            return
        pgid = self.process.pid
        if self.process.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.process.wait(timeout=STOP_DEADLINE_S)
        _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_until(
    check: Callable[[], bool],
    what: str,
    deadline_s: float,
    watched: Sequence[ManagedProcess] = (),
    interval_s: float = 0.1,
) -> None:
    """Poll ``check`` until it holds; fail at the deadline, or at once when a watched
    process has exited (with the end of its log)."""
    deadline = time.monotonic() + deadline_s
    while True:
        if check():
            return
        for proc in watched:
            if not proc.alive:
                code = proc.process.returncode if proc.process else None
                raise TierStartError(
                    f"{proc.name} exited (status {code}) while waiting for {what}; "
                    f"end of {proc.log_path}:\n{proc.log_tail()}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}:\n{p.log_tail(15)}" for p in watched)
            raise TierStartError(f"timed out after {deadline_s:.0f} s waiting for {what}\n{logs}")
        time.sleep(interval_s)
