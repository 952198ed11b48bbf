"""Job progress as the ranks report it through their node agents (agent/progress.py).

``record_progress`` runs inside the agent's sync transaction (``JobStore.agent_sync``):
one ``JobProgress`` row per job, the pods' reports merged (``merge_report``). Only a job
that is running or stopping records anything: a late report of an ended attempt changes
nothing.

The invariants:

- reports are ordered by when they were made, never by their step number: a training
  loop's counter may restart every epoch, and a new attempt resumes from a checkpoint
  older than the steps its predecessor reported. Any ``gpufleet.progress`` call, with a
  number or without, moves ``last_step_at``, the hang rule's clock;
- a saved checkpoint is progress, not an event: the last one (``last_checkpoint_*``,
  also the workload's ``last_checkpoint_at``, from which the scheduler protects a
  preempted job) and a count per attempt. The checkpoint an attempt resumes from is named
  in its ``job-restarting`` event;
- ``history`` keeps at most ``HISTORY_POINTS`` points (time, step, epoch, loss) over the
  job's whole life for the job page's charts (``add_point``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from ..recovery.checkpoints import within as checkpoint_within
from .models import JobProgress, Workload, WorkloadKind, WorkloadState

KEEP_STEP_TIMES = 512
HISTORY_POINTS = 256  # the job page's charts are 560 pixels wide
LOSS_METRIC = "loss"  # the metric the job page charts beside the steps


@dataclass(frozen=True)
class Saved:
    uri: str
    step: int
    at: datetime
    epoch: int | None = None


@dataclass(frozen=True)
class ProgressReport:
    """One pod's progress since the agent's last sync. ``step_at`` is when it last called
    ``gpufleet.progress`` (with or without a number); ``step`` and ``epoch`` are the
    numbers that call gave, None where it gave none."""

    workload_id: int
    pod_index: int
    step: int | None = None
    step_at: datetime | None = None
    step_times_s: Sequence[float] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_started: tuple[int, datetime] | None = None
    checkpoints_saved: Sequence[Saved] = ()
    epoch: int | None = None

    @property
    def stepped(self) -> bool:
        """Whether the pod called ``gpufleet.progress`` since the last sync."""
        return self.step_at is not None or self.step is not None


@dataclass(frozen=True)
class ProgressPoint:
    """One point of a job's history, as the job page charts it."""

    at: datetime
    step: int | None
    epoch: int | None
    loss: float | None


def record_progress(
    session: Session, now: datetime, reports: Iterable[ProgressReport], resumed: list[float]
) -> set[int]:
    """Record the reports; the jobs whose progress changed. For each attempt that steps for
    the first time after a fault, the seconds from the fault are appended to ``resumed``."""
    changed: set[int] = set()
    for report in reports:
        workload = session.get(Workload, report.workload_id)
        if (
            workload is None
            or workload.kind is not WorkloadKind.job
            # A stopping attempt still counts: its ranks save a checkpoint on SIGTERM,
            # and its next attempt resumes from it.
            or workload.state not in (WorkloadState.running, WorkloadState.stopping)
        ):
            continue
        row = session.get(JobProgress, workload.id)
        if row is None:
            row = new_progress(workload.id, now)
            session.add(row)
        # An attempt's first step, whatever its number and its agent's clock: the attempt
        # resumed from a checkpoint older than the steps its predecessor reported.
        started = workload.started_at
        first = report.stepped and (
            row.last_step_at is None or (started is not None and row.last_step_at < started)
        )
        if first:
            _first_step(workload, report.step_at or now, resumed)
        merge_report(workload, row, report, now, first)
        changed.add(workload.id)
    return changed


def new_progress(workload_id: int, now: datetime) -> JobProgress:
    """A job's progress before any report."""
    return JobProgress(
        workload_id=workload_id,
        step_times=[],
        metrics={},
        history={},
        checkpoints_saved={},
        last_checkpoint_uri="",
        updated_at=now,
    )


def _first_step(workload: Workload, at: datetime, resumed: list[float]) -> None:
    """An attempt's first step: when training (re)started, and, after a fault, the time
    from the fault to it, which is lost to the job (``training_ratio``)."""
    recovery = dict(workload.recovery or {})
    recovery.setdefault("trained_since", at.isoformat())
    recovery["attempt_stepped_at"] = at.isoformat()
    fault_at = recovery.pop("fault_at", None)
    if fault_at and workload.attempt > 1:
        seconds = max(0.0, (at - datetime.fromisoformat(fault_at)).total_seconds())
        resumed.append(seconds)
        recovery["lost_s"] = float(recovery.get("lost_s", 0.0)) + seconds
    elif fault_at:
        recovery["fault_at"] = fault_at  # the first attempt's own fault, still stopping
    workload.recovery = recovery


def training_ratio(recovery: dict[str, Any] | None, now: datetime) -> float | None:
    """The job's effective training time ratio (ETTR) so far: the share of the time since
    its first step not lost to faults, preemptions and drains — the work redone since the
    last checkpoint before each, and the time from each to the next attempt's first step
    (still running while it waits). None before its first step."""
    recovery = recovery or {}
    since = recovery.get("trained_since")
    if not since:
        return None
    elapsed = (now - datetime.fromisoformat(since)).total_seconds()
    if elapsed <= 0:
        return 1.0
    lost = float(recovery.get("lost_s", 0.0))
    if recovery.get("fault_at"):
        lost += max(0.0, (now - datetime.fromisoformat(recovery["fault_at"])).total_seconds())
    return max(0.0, min(1.0, 1.0 - lost / elapsed))


def merge_report(
    workload: Workload, row: JobProgress, report: ProgressReport, now: datetime, first: bool
) -> None:
    """Merge one pod's report into the job's progress (no I/O: ``row`` may be detached).
    ``first``: the report is the attempt's first step."""
    if report.stepped:
        at = report.step_at or now
        if first or _later(row, at, report):
            row.last_step, row.last_epoch, row.last_step_at = report.step, report.epoch, at
        loss = report.metrics.get(LOSS_METRIC)
        point = [
            round(at.timestamp(), 3),
            report.step,
            report.epoch,
            loss if loss is not None and math.isfinite(loss) else None,
        ]
        row.history = add_point(row.history or {}, point)
    if report.step_times_s:
        row.step_times = [*row.step_times, *report.step_times_s][-KEEP_STEP_TIMES:]
    if report.metrics:
        # JSON has no NaN (PostgreSQL refuses the whole sync): a loss gone NaN is kept as
        # its text, and shown as a number again (``progress_json``).
        finite = {k: v if math.isfinite(v) else str(v) for k, v in report.metrics.items()}
        row.metrics = {**row.metrics, **finite}
    location = str((workload.spec or {}).get("checkpoint_uri") or "")
    for saved in sorted(report.checkpoints_saved, key=lambda c: c.at):
        # Only the job's own may be resumed from: its agent refuses any other (a rank's
        # report of a path elsewhere), and so does the store, whatever an agent sends.
        if _known_checkpoint(row, saved) or not checkpoint_within(saved.uri, location):
            continue
        row.last_checkpoint_uri, row.last_checkpoint_step = saved.uri, saved.step
        row.last_checkpoint_epoch, row.last_checkpoint_at = saved.epoch, saved.at
        workload.last_checkpoint_at = saved.at
        counts = dict(row.checkpoints_saved or {})
        counts[str(workload.attempt)] = int(counts.get(str(workload.attempt), 0)) + 1
        row.checkpoints_saved = counts
    if report.checkpoint_started is not None:
        row.checkpoint_started_step, row.checkpoint_started_at = report.checkpoint_started
    elif row.checkpoint_started_at is not None and any(
        _ends_in_flight(row.checkpoint_started_step, row.checkpoint_started_at, saved)
        for saved in report.checkpoints_saved
    ):
        row.checkpoint_started_step = row.checkpoint_started_at = None
    row.updated_at = now


def _later(row: JobProgress, at: datetime, report: ProgressReport) -> bool:
    """Whether a report made at ``at`` is the job's latest. Of two made at one moment (two
    pods in step), the one further on is kept."""
    if row.last_step_at is None or at > row.last_step_at:
        return True
    if at < row.last_step_at:
        return False
    return (report.epoch or 0, report.step or 0) >= (row.last_epoch or 0, row.last_step or 0)


def _known_checkpoint(row: JobProgress, saved: Saved) -> bool:
    """An older checkpoint reported late, or another pod's word on the last one (the same
    epoch and step: the step number alone may come back every epoch)."""
    if row.last_checkpoint_at is None:
        return False
    return saved.at < row.last_checkpoint_at or (saved.epoch, saved.step) == (
        row.last_checkpoint_epoch,
        row.last_checkpoint_step,
    )


def _ends_in_flight(step: int | None, since: datetime, saved: Saved) -> bool:
    """Whether a saved checkpoint ends the one in flight (of ``step``, begun ``since``):
    saved after it began, or of its step or later (another node's clock may run a little
    behind)."""
    return saved.at >= since or (step is not None and saved.step >= step)


def add_point(
    history: Mapping[str, Any], point: Sequence[Any], keep: int = HISTORY_POINTS
) -> dict[str, Any]:
    """``history`` with ``point`` (``[unix time, ...]``) added. Points stay in time order
    and at least ``every_s`` apart, but for the latest, which stands for the newest report
    until one comes ``every_s`` after the point before it. When there are more than
    ``keep``, the spacing doubles (at least) and the points are thinned to it: at most
    ``keep`` points, spread evenly over the job's whole life however long it runs."""
    every = float(history.get("every_s", 0.0))
    points = [list(p) for p in history.get("points", ())]
    new = list(point)
    if points and new[0] < points[-1][0]:
        bisect.insort(points, new, key=lambda p: p[0])  # another node's report, late
    else:
        if len(points) >= 2 and points[-1][0] - points[-2][0] < every:
            points.pop()  # the latest stood for its interval; the new one does now
        points.append(new)
    if len(points) > keep:
        every = max(2 * every, (points[-1][0] - points[0][0]) / max(1, keep // 2))
        points = _spaced(points, every)
    return {"every_s": every, "points": points}


def _spaced(points: Sequence[list[Any]], every: float) -> list[list[Any]]:
    """The first point, each next one at least ``every`` after the last kept, and the
    latest."""
    kept = [points[0]]
    for p in points[1:-1]:
        if p[0] - kept[-1][0] >= every:
            kept.append(p)
    return [*kept, points[-1]] if len(points) > 1 else kept


def history_points(row: JobProgress) -> list[ProgressPoint]:
    """The job's history as the job page charts it, oldest first."""
    return [
        ProgressPoint(datetime.fromtimestamp(float(t), UTC), step, epoch, loss)
        for t, step, epoch, loss in (row.history or {}).get("points", ())
    ]


def percentile(values: Sequence[float], share: float) -> float | None:
    """The nearest-rank percentile (``share`` in 0-1); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-int(share * 1000) * len(ordered) // 1000)))
    return ordered[rank - 1]


def progress_json(row: JobProgress) -> dict[str, Any]:
    """A job's progress as the API shows it."""
    by_attempt = {int(k): int(v) for k, v in (row.checkpoints_saved or {}).items()}
    return {
        "last_step": row.last_step,
        "last_epoch": row.last_epoch,
        "last_step_at": row.last_step_at,
        "step_time_p50_s": percentile(row.step_times, 0.5),
        "step_time_p99_s": percentile(row.step_times, 0.99),
        "metrics": {name: float(value) for name, value in row.metrics.items()},
        "checkpoint_in_flight": (
            None
            if row.checkpoint_started_step is None
            else {"step": row.checkpoint_started_step, "since": row.checkpoint_started_at}
        ),
        "last_checkpoint": (
            None
            if row.last_checkpoint_step is None
            else {
                "uri": row.last_checkpoint_uri,
                "step": row.last_checkpoint_step,
                "epoch": row.last_checkpoint_epoch,
                "at": row.last_checkpoint_at,
            }
        ),
        "checkpoints_saved": sum(by_attempt.values()),
        "checkpoints_saved_by_attempt": dict(sorted(by_attempt.items())),
        "updated_at": row.updated_at,
    }
