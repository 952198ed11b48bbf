"""Progress from inside training: ``gpufleet.progress(step, epoch=..., **metrics)``,
``gpufleet.checkpoint_started(step)`` and ``gpufleet.checkpoint_saved(uri, step)``.

A step is any call of ``progress``: its number may be global, may restart every epoch
(then pass ``epoch``), or may be left out; the controller counts every call as a sign of
life (its hang check reads when the last came, never the number).

Cheap enough to call every step: a call records the step under a lock and returns; a
daemon thread sends what is new every ``GPUFLEET_PROGRESS_INTERVAL`` seconds (5), at once
for a checkpoint, and once more when the process exits. The step is never held up: a
report that cannot be sent is dropped (the next one carries the latest step; a saved
checkpoint is kept until it is sent). A report the agent refuses, or a checkpoint it leaves
out (one outside ``GPUFLEET_CHECKPOINT_URI``: only those are resumed from), is said once on
the rank's stderr and not sent again. A checkpoint's path is made absolute here.

Only local rank 0 of each pod reports (``LOCAL_RANK``, as torchrun sets it): one report
per pod. Reports go to the node agent on the rank's own machine
(``GPUFLEET_PROGRESS_URL``, set by the agent), naming the rank's pod by its process marker
(``GPUFLEET_SESSION_MARKER``); the agent asks the kernel which process is calling: ranks
hold no platform token. Outside a gpufleet job (no URL in the environment) the calls do
nothing, so a script runs the same on a laptop.

Standard library only: this is the light SDK, installed without the server extras.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import urllib.error
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
MAX_NUMBER = 2**53  # what the node agent takes as a step or an epoch


class Reporter:
    """What one pod has to say, and the thread that says it."""

    def __init__(self, url: str, marker: str, interval: float, timeout: float = 5.0):
        self.url, self.marker, self.interval, self.timeout = url, marker, interval, timeout
        self._lock = threading.Lock()
        # Held from taking a report until it is answered: the flush at exit waits for the
        # thread's report in flight (the last step, a checkpoint) instead of finding
        # nothing new and letting the interpreter end that thread mid-send.
        self._sending = threading.Lock()
        self._wake = threading.Event()
        self._step: int | None = None
        self._epoch: int | None = None
        self._step_at: float | None = None  # time.monotonic() of the latest call
        self._numbered_at: float | None = None  # ... of the latest call with a number
        self._step_times: list[float] = []
        self._metrics: dict[str, float] = {}
        self._in_flight: tuple[int, float] | None = None  # a checkpoint started, not saved
        self._saved: list[tuple[str, int, int | None, float]] = []
        self._dirty = False
        self._thread: threading.Thread | None = None
        self._told: set[str] = set()

    # ------------------------------------------------------------ the rank's calls
    def progress(
        self, step: int | None, metrics: Mapping[str, Any], epoch: int | None = None
    ) -> None:
        now = time.monotonic()
        with self._lock:
            # A call without numbers keeps the last ones; a step time is taken only
            # between two steps of one epoch: a counter that restarts (a new epoch, a
            # resumed attempt) says nothing of the time.
            if step is not None or epoch is not None:
                if (
                    step is not None
                    and self._step is not None
                    and self._numbered_at is not None
                    and epoch == self._epoch
                    and step > self._step
                ):
                    per_step = (now - self._numbered_at) / (step - self._step)
                    self._step_times.append(per_step)
                    del self._step_times[:-MAX_STEP_TIMES]
                self._step, self._epoch, self._numbered_at = step, epoch, now
            self._step_at = now
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

    def checkpoint_saved(self, uri: str, step: int, epoch: int | None = None) -> None:
        where = str(uri)
        if "://" not in where:
            where = os.path.abspath(where)  # the next attempt may start elsewhere
        with self._lock:
            self._in_flight = None
            self._saved.append((where[:2000], int(step), epoch, time.monotonic()))
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
                # An epoch only where there is one: an agent older than it refuses the key.
                **({} if self._epoch is None else {"epoch": self._epoch}),
                "step_age_s": None if self._step_at is None else now - self._step_at,
                "step_times_s": self._step_times,
                "metrics": dict(self._metrics),
                "checkpoint_started": (
                    None
                    if self._in_flight is None
                    else {"step": self._in_flight[0], "age_s": now - self._in_flight[1]}
                ),
                "checkpoints_saved": [
                    {
                        "uri": uri,
                        "step": step,
                        **({} if epoch is None else {"epoch": epoch}),
                        "age_s": now - at,
                    }
                    for uri, step, epoch, at in self._saved
                ],
            }
            self._step_times, self._saved, self._dirty = [], [], False
            return body

    def flush(self) -> bool:
        """Send what is new now; whether it arrived (or there was nothing). Waits for a
        report in flight (at most ``timeout``) before looking for what is new."""
        with self._sending:
            return self._send_new()

    def _send_new(self) -> bool:
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
                said = answer.read(4096).decode(errors="replace").strip()
            if said:  # what the agent left out, e.g. a checkpoint outside the job's location
                self._tell(said)
            return True
        except urllib.error.HTTPError as e:
            if e.code < 500:
                # Refused as it is: sending it again would be refused again (and hold up
                # every later step), so it is dropped, and said once.
                self._tell(f"progress report refused ({e.code}): {_text(e)}")
                return False
            return self._keep_saved(body)
        except OSError:
            return self._keep_saved(body)

    def _keep_saved(self, body: dict[str, Any]) -> bool:
        """The report did not arrive: a saved checkpoint is said again with the next one."""
        with self._lock:
            saved = [
                (c["uri"], c["step"], c.get("epoch"), time.monotonic() - c["age_s"])
                for c in body["checkpoints_saved"]
            ]
            self._saved[:0] = saved
            self._dirty = self._dirty or bool(saved)
        return False

    def _tell(self, message: str) -> None:
        """Say ``message`` on the rank's stderr (its log), once."""
        if message not in self._told:
            self._told.add(message)
            print(f"gpufleet: {message}", file=sys.stderr, flush=True)


def _text(error: urllib.error.HTTPError) -> str:
    try:
        return error.read(4096).decode(errors="replace").strip() or str(error.reason)
    except OSError:
        return str(error.reason)


class _Silent:
    """Outside a gpufleet job, or on a rank other than a pod's first: nothing to do."""

    def progress(
        self, step: int | None, metrics: Mapping[str, Any], epoch: int | None = None
    ) -> None:
        return

    def checkpoint_started(self, step: int) -> None:
        return

    def checkpoint_saved(self, uri: str, step: int, epoch: int | None = None) -> None:
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


def progress(step: int | None = None, *, epoch: int | None = None, **metrics: Any) -> None:
    """Training took a step: ``step`` is its number — a global step, or the step within
    ``epoch`` when the counter restarts every epoch — or None where the loop does not
    number its steps; every call counts as progress. Numeric ``metrics`` go along (loss,
    tokens/s...; the job page charts ``loss``). A step or epoch that is not a whole
    number from 0 raises ValueError or TypeError, inside a job and out."""
    step, epoch = _number(step, "step"), _number(epoch, "epoch")
    _the_reporter().progress(step, metrics, epoch)


def checkpoint_started(step: int) -> None:
    """A checkpoint of ``step`` is being written (it gets a longer limit than a step)."""
    _the_reporter().checkpoint_started(_whole(step, "step"))


def checkpoint_saved(uri: str, step: int, epoch: int | None = None) -> None:
    """The checkpoint of ``step`` (of ``epoch``, with a counter that restarts every epoch)
    is complete at ``uri``: a restart resumes from it."""
    _the_reporter().checkpoint_saved(uri, _whole(step, "step"), _number(epoch, "epoch"))


def _number(value: Any, what: str) -> int | None:
    return None if value is None else _whole(value, what)


def _whole(value: Any, what: str) -> int:
    """``value`` as a step or epoch number (a numpy integer or a whole float will do)."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"gpufleet: the {what} must be a whole number, not {value!r}") from None
    if isinstance(value, bool) or number != value or not 0 <= number <= MAX_NUMBER:
        raise ValueError(
            f"gpufleet: the {what} must be a whole number from 0 to 2**53, not {value!r}"
        )
    return number


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
