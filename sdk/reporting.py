"""Progress from inside training: ``gpufleet.progress(step, **metrics)``,
``gpufleet.checkpoint_started(step)`` and ``gpufleet.checkpoint_saved(uri, step)``.

Cheap enough to call every step: a call records the step under a lock and returns; a
daemon thread sends what is new every ``GPUFLEET_PROGRESS_INTERVAL`` seconds (5), at once
for a checkpoint, and once more when the process exits. The step is never held up: a
report that cannot be sent is dropped (the next one carries the latest step; a saved
checkpoint is kept until it is sent).

Only local rank 0 of each pod reports (``LOCAL_RANK``, as torchrun sets it): one report
per pod. Reports go to the node agent on the rank's own machine
(``GPUFLEET_PROGRESS_URL``, set by the agent), carrying the rank's process marker
(``GPUFLEET_SESSION_MARKER``), which the agent knows as that pod's: ranks hold no platform
token. Outside a gpufleet job (no URL in the environment) the calls do nothing, so a
script runs the same on a laptop.

Standard library only: this is the light SDK, installed without the server extras.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

URL_VARIABLE = "GPUFLEET_PROGRESS_URL"
MARKER_VARIABLE = "GPUFLEET_SESSION_MARKER"
INTERVAL_VARIABLE = "GPUFLEET_PROGRESS_INTERVAL"
RESUME_VARIABLE = "GPUFLEET_RESUME_FROM"  # set by the node agent for a job's later attempts
ATTEMPT_VARIABLE = "GPUFLEET_ATTEMPT"
MARKER_HEADER = "X-Gpufleet-Marker"
MAX_STEP_TIMES = 256  # per report: the most recent steps' durations
MAX_METRICS = 32


class Reporter:
    """What one pod has to say, and the thread that says it."""

    def __init__(self, url: str, marker: str, interval: float, timeout: float = 5.0):
        self.url, self.marker, self.interval, self.timeout = url, marker, interval, timeout
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._step: int | None = None
        self._step_at: float | None = None  # time.monotonic() of the latest step
        self._step_times: list[float] = []
        self._metrics: dict[str, float] = {}
        self._in_flight: tuple[int, float] | None = None  # a checkpoint started, not saved
        self._saved: list[tuple[str, int, float]] = []
        self._dirty = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the rank's calls
    def progress(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            if self._step is not None and self._step_at is not None and step > self._step:
                per_step = (now - self._step_at) / (step - self._step)
                self._step_times.append(per_step)
                del self._step_times[:-MAX_STEP_TIMES]
            self._step, self._step_at = int(step), now
            for name, value in list(metrics.items())[:MAX_METRICS]:
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._metrics[str(name)[:64]] = float(value)
            self._dirty = True
        self._started()

    def checkpoint_started(self, step: int) -> None:
        with self._lock:
            self._in_flight = (int(step), time.monotonic())
            self._dirty = True
        self._started()
        self._wake.set()

    def checkpoint_saved(self, uri: str, step: int) -> None:
        with self._lock:
            self._in_flight = None
            self._saved.append((str(uri)[:2000], int(step), time.monotonic()))
            self._dirty = True
        self._started()
        self._wake.set()

    # ------------------------------------------------------------ sending
    def _started(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="gpufleet-progress", daemon=True
                    )
                    self._thread.start()
                    atexit.register(self.flush)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            self.flush()

    def take(self) -> dict[str, Any] | None:
        """What is new since the last report, as its body (ages in seconds before now,
        so the rank's and the agent's clocks need not agree); None when nothing is."""
        now = time.monotonic()
        with self._lock:
            if not self._dirty:
                return None
            body: dict[str, Any] = {
                "step": self._step,
                "step_age_s": None if self._step_at is None else now - self._step_at,
                "step_times_s": self._step_times,
                "metrics": dict(self._metrics),
                "checkpoint_started": (
                    None
                    if self._in_flight is None
                    else {"step": self._in_flight[0], "age_s": now - self._in_flight[1]}
                ),
                "checkpoints_saved": [
                    {"uri": uri, "step": step, "age_s": now - at} for uri, step, at in self._saved
                ],
            }
            self._step_times, self._saved, self._dirty = [], [], False
            return body

    def flush(self) -> bool:
        """Send what is new now; whether it arrived (or there was nothing)."""
        body = self.take()
        if body is None:
            return True
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", MARKER_HEADER: self.marker},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                answer.read()
            return True
        except OSError:
            # Dropped, but a saved checkpoint is said again with the next report.
            with self._lock:
                saved = [
                    (c["uri"], c["step"], time.monotonic() - c["age_s"])
                    for c in body["checkpoints_saved"]
                ]
                self._saved[:0] = saved
                self._dirty = self._dirty or bool(saved)
            return False


class _Silent:
    """Outside a gpufleet job, or on a rank other than a pod's first: nothing to do."""

    def progress(self, step: int, metrics: Mapping[str, Any]) -> None:
        return

    def checkpoint_started(self, step: int) -> None:
        return

    def checkpoint_saved(self, uri: str, step: int) -> None:
        return


_reporter: Reporter | _Silent | None = None
_reporter_lock = threading.Lock()


def _the_reporter() -> Reporter | _Silent:
    global _reporter
    if _reporter is None:
        with _reporter_lock:
            if _reporter is None:
                url = os.environ.get(URL_VARIABLE, "")
                marker = os.environ.get(MARKER_VARIABLE, "")
                first = os.environ.get("LOCAL_RANK", "0") in ("", "0")
                if url and marker and first:
                    interval = float(os.environ.get(INTERVAL_VARIABLE, "5") or 5)
                    _reporter = Reporter(url, marker, interval)
                else:
                    _reporter = _Silent()
    return _reporter


def progress(step: int, **metrics: Any) -> None:
    """Training reached ``step`` (numeric ``metrics`` go along: loss, tokens/s...)."""
    _the_reporter().progress(step, metrics)


def checkpoint_started(step: int) -> None:
    """A checkpoint of ``step`` is being written (it gets a longer limit than a step)."""
    _the_reporter().checkpoint_started(step)


def checkpoint_saved(uri: str, step: int) -> None:
    """The checkpoint of ``step`` is complete at ``uri``: a restart resumes from it."""
    _the_reporter().checkpoint_saved(uri, step)


def resume_from() -> str | None:
    """The checkpoint this attempt of the job should load (the newest any earlier attempt
    saved: ``GPUFLEET_RESUME_FROM``), or None for a fresh start and outside gpufleet."""
    return os.environ.get(RESUME_VARIABLE) or None


def attempt() -> int:
    """Which run of the job this is: 1, and one more after each restart."""
    try:
        return max(1, int(os.environ.get(ATTEMPT_VARIABLE, "1")))
    except ValueError:
        return 1
