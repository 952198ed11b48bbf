"""The processes of ``k8s_inventory.py``'s runs, and the CPU time they use.

``Child``: a process of the bench in a session of its own, its ``@@kind {json}`` lines
(``k8s_churn.say``) kept as messages, killed with the bench. ``CpuWindow``: the CPU time
of named processes and of the machine between two moments, from ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_churn import MARK

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the processes
def _die_with_parent() -> None:
    """In the child before exec: killed if the bench dies without stopping it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Child:
    """A process of the bench in a session of its own: its ``@@kind {json}`` lines kept
    (with ``on_line`` called for each), its stderr in a log file; ``stop`` kills its group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        logdir: Path,
        on_line: Callable[[str, dict[str, Any]], None] | None = None,
    ):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.changed = threading.Condition()
        self._on_line = on_line
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if not line.startswith(MARK):
                continue
            kind, _, data = line[len(MARK) :].partition(" ")
            message = json.loads(data)
            with self.changed:
                self.messages.append((kind, message))
                if self._on_line is not None:
                    self._on_line(kind, message)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(
        self, check: Callable[[], bool], what: str, deadline_s: float, missing_ok: bool = False
    ) -> bool:
        """Until ``check`` (called under the lock) holds; fails with the log's end if the
        process exits first, or if the deadline passes (unless ``missing_ok``: False)."""
        deadline = time.monotonic() + deadline_s
        with self.changed:
            while not check():
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(
                        f"{self.name} exited while waiting for {what}\n{self.tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    if missing_ok:
                        return False
                    raise RuntimeError(f"no {what} within {deadline_s:.0f} s\n{self.tail()}")
                self.changed.wait(min(left, 1.0))
        return True

    def last(self, kind: str) -> dict[str, Any] | None:
        with self.changed:
            return next((m for k, m in reversed(self.messages) if k == kind), None)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self.changed:
            return [m for k, m in self.messages if k == kind]

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return f"--- end of {self.log_path}:\n" + "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: signal.Signals) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL to its group after ``grace_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._reader.join(timeout=5)


# ------------------------------------------------------------------ CPU accounting
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_ticks() -> tuple[int, int, int]:
    """(busy, all, steal) jiffies of every CPU so far."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    steal = values[7] if len(values) > 7 else 0
    total = sum(values[:8])
    return total - idle - steal, total, steal


@dataclass
class CpuWindow:
    """CPU time of named processes (and the machine) between ``start`` and ``stop``."""

    pids: dict[str, list[int]]
    began: dict[str, float] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    machine: tuple[int, int, int] = (0, 0, 0)
    _wall0: float = field(default=0.0, init=False)
    _machine0: tuple[int, int, int] = field(default=(0, 0, 0), init=False)

    def _sample(self) -> dict[str, float]:
        sample = {k: sum(cpu_seconds(p) for p in pids) for k, pids in self.pids.items()}
        times = os.times()
        sample["bench (changes, readers)"] = times.user + times.system
        return sample

    def start(self) -> None:
        self.began = self._sample()
        self._wall0 = time.monotonic()
        self._machine0 = machine_ticks()

    def stop(self) -> None:
        now = self._sample()
        self.wall = time.monotonic() - self._wall0
        self.used = {k: now[k] - self.began[k] for k in now}
        busy, total, steal = machine_ticks()
        self.machine = (
            busy - self._machine0[0],
            total - self._machine0[1],
            steal - self._machine0[2],
        )

    def percent(self, key: str) -> float:
        return 100.0 * self.used[key] / self.wall

    def others(self) -> float:
        """What every other process of the machine used, % of one core."""
        busy, total, _ = self.machine
        mine = sum(self.used.values()) * CLOCK_TICKS
        return 100.0 * (os.cpu_count() or 1) * max(0, busy - mine) / total

    def busy(self) -> float:
        return 100.0 * self.machine[0] / self.machine[1]

    def steal(self) -> float:
        return 100.0 * self.machine[2] / self.machine[1]
