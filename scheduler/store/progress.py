"""Job progress as the ranks report it through their node agents (agent/progress.py).

``record_progress`` runs inside the agent's sync transaction (``JobStore.agent_sync``):
one ``JobProgress`` row per job, the pods' reports merged. A saved checkpoint is also the
workload's ``last_checkpoint_at`` (the scheduler's protection of a preempted job counts
from it) and a ``job-checkpoint-saved`` event on the job's timeline. Only a job that is
running or stopping records anything: a late report of an ended attempt changes
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from .base import _event
from .models import JobProgress, Workload, WorkloadKind, WorkloadState

KEEP_STEP_TIMES = 512
CHECKPOINT_SAVED = "job-checkpoint-saved"


@dataclass(frozen=True)
class Saved:
    uri: str
    step: int
    at: datetime


@dataclass(frozen=True)
class ProgressReport:
    """One pod's progress since the agent's last sync."""

    workload_id: int
    pod_index: int
    step: int | None = None
    step_at: datetime | None = None
    step_times_s: Sequence[float] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_started: tuple[int, datetime] | None = None
    checkpoints_saved: Sequence[Saved] = ()


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
            row = JobProgress(workload_id=workload.id, step_times=[], metrics={}, updated_at=now)
            session.add(row)
        # The first step of a new attempt counts whatever its number: the attempt resumed
        # from a checkpoint older than the steps its predecessor reported.
        started = workload.started_at
        first = report.step is not None and (
            row.last_step_at is None or (started is not None and row.last_step_at < started)
        )
        if first:
            _first_step(workload, report.step_at or now, resumed)
        _apply(session, now, workload, row, report, first)
        changed.add(workload.id)
    return changed


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


def _apply(
    session: Session,
    now: datetime,
    workload: Workload,
    row: JobProgress,
    report: ProgressReport,
    first: bool,
) -> None:
    if report.step is not None and (first or row.last_step is None or report.step >= row.last_step):
        row.last_step = report.step
        row.last_step_at = report.step_at or now
    if report.step_times_s:
        row.step_times = [*row.step_times, *report.step_times_s][-KEEP_STEP_TIMES:]
    if report.metrics:
        row.metrics = {**row.metrics, **report.metrics}
    for saved in sorted(report.checkpoints_saved, key=lambda c: c.step):
        if row.last_checkpoint_step is not None and saved.step <= row.last_checkpoint_step:
            continue  # an older one reported late, or another pod's word on the same one
        row.last_checkpoint_uri, row.last_checkpoint_step = saved.uri, saved.step
        row.last_checkpoint_at = saved.at
        workload.last_checkpoint_at = saved.at
        _event(
            session,
            now,
            CHECKPOINT_SAVED,
            f"job {workload.name or workload.id}: the checkpoint of step {saved.step} is "
            f"saved ({saved.uri})",
            workload=workload,
            data={"uri": saved.uri, "step": saved.step},
        )
    if report.checkpoint_started is not None:
        row.checkpoint_started_step, row.checkpoint_started_at = report.checkpoint_started
    elif report.checkpoints_saved and (
        row.checkpoint_started_step is None
        or max(c.step for c in report.checkpoints_saved) >= row.checkpoint_started_step
    ):
        row.checkpoint_started_step = row.checkpoint_started_at = None
    row.updated_at = now


def percentile(values: Sequence[float], share: float) -> float | None:
    """The nearest-rank percentile (``share`` in 0-1); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-int(share * 1000) * len(ordered) // 1000)))
    return ordered[rank - 1]


def progress_json(row: JobProgress) -> dict[str, Any]:
    """A job's progress as the API shows it."""
    return {
        "last_step": row.last_step,
        "last_step_at": row.last_step_at,
        "step_time_p50_s": percentile(row.step_times, 0.5),
        "step_time_p99_s": percentile(row.step_times, 0.99),
        "metrics": dict(row.metrics),
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
                "at": row.last_checkpoint_at,
            }
        ),
        "updated_at": row.updated_at,
    }
