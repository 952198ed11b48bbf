"""What begins a job's next attempt in the store, wherever its pods run: the record its
retry policy weighs (``recovery/attempts.py``), the new number and marker, what it avoids
and resumes from, the line that continues each rank's log (``log_bases``), and the
``job-restarting`` event. ``state/attempts.py`` requeues a whole gang with it,
``state/kept_pods.py`` begins one that keeps its pods.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.attempts import AttemptRecord, Resume
from ..recovery.classify import FaultClass, Verdict
from .base import _event
from .models import JobLog, JobPod, JobProgress, Workload


def pods_of(workload_id: int) -> Select[Any]:
    return select(JobPod).where(JobPod.workload_id == workload_id)


def attempt_record(session: Session, now: datetime, workload: Workload) -> AttemptRecord:
    """What ``next_attempt`` weighs of the attempt that ends now."""
    recovery = workload.recovery or {}
    return AttemptRecord(
        attempt=workload.attempt,
        fault_times=tuple(recovery.get("fault_times", ())),
        avoid_nodes=frozenset(recovery.get("avoid_nodes", ())),
        avoid_gpus=frozenset(recovery.get("avoid_gpus", ())),
        checkpoint=_last_checkpoint(session, workload.id),
        gpus=workload.gpus,
        ran_s=(now - workload.started_at).total_seconds() if workload.started_at else 0.0,
        quick_faults=int(recovery.get("quick_faults", 0)),
    )


def begin_next_attempt(
    session: Session, now: datetime, workload: Workload, verdict: Verdict, step: Resume
) -> None:
    """What every next attempt starts with, wherever its pods run: its number, a new
    marker, what it avoids and resumes from, and a line in each rank's log."""
    line = f"--- gpufleet: attempt {step.attempt}: {step.message} ---\n"
    before = workload.recovery or {}
    # Disruptions too: the time to resume counts from whatever ended the attempt.
    fault_at = before.get("fault_at") or now.isoformat()
    progress = session.get(JobProgress, workload.id)
    workload.recovery = {
        "avoid_nodes": sorted(step.avoid_nodes),
        "avoid_gpus": sorted(step.avoid_gpus),
        "resume_from": step.resume_from,
        "log_bases": _continue_logs(session, now, workload.id, line),
        "fault_times": list(step.fault_times),
        "quick_faults": step.quick_faults,
        "fault_at": fault_at,
        # After a fault, not a preemption or a drain: it may use the recovery spares.
        "recovering": verdict.fault is not FaultClass.DISRUPTION,
        "restarted_for": verdict.fault.value,
        **_training_lost(before, progress, datetime.fromisoformat(fault_at)),
    }
    workload.attempt = step.attempt
    workload.faults += 1 if verdict.spends_budget else 0
    workload.outcome = None
    workload.preempted_for_id = None
    # A new marker: whatever is left of the old attempt is never taken for the new one.
    workload.process_marker = uuid.uuid4().hex
    if progress is not None:  # a checkpoint the old attempt began will never be saved
        progress.checkpoint_started_step = progress.checkpoint_started_at = None
    workload.version += 1


def restarting_event(
    session: Session,
    now: datetime,
    workload: Workload,
    verdict: Verdict,
    step: Resume,
    said: str,
    **data: Any,
) -> None:
    _event(
        session,
        now,
        EventKind.JOB_RESTARTING,
        said,
        reason=verdict.fault.value,
        workload=workload,
        data={
            "attempt": step.attempt,
            "fault": verdict.fault.value,
            "spends_budget": verdict.spends_budget,
            "faults": workload.faults,
            "delay_s": step.delay_s,
            "resume_from": step.resume_from,
            "avoid_nodes": sorted(step.avoid_nodes),
            "avoid_gpus": sorted(step.avoid_gpus),
            **data,
        },
    )


def _training_lost(
    before: dict[str, Any], progress: JobProgress | None, fault_at: datetime
) -> dict[str, Any]:
    """What the next attempt carries of the job's effective training time
    (``progress.training_ratio``): when it first stepped, and the time lost so far — now
    also the work this attempt did after its last checkpoint, which is done again."""
    if "trained_since" not in before:
        return {}
    lost = float(before.get("lost_s", 0.0))
    stepped = before.get("attempt_stepped_at")
    if stepped:
        kept = datetime.fromisoformat(stepped)
        if progress is not None and progress.last_checkpoint_at is not None:
            kept = max(kept, progress.last_checkpoint_at)
        lost += max(0.0, (fault_at - kept).total_seconds())
    return {"trained_since": before["trained_since"], "lost_s": lost}


def _last_checkpoint(session: Session, workload_id: int) -> str | None:
    row = session.get(JobProgress, workload_id)
    return row.last_checkpoint_uri or None if row is not None else None


def _continue_logs(session: Session, now: datetime, workload_id: int, line: str) -> dict[str, int]:
    """End each of the job's log streams with ``line``; where each one continues."""
    ends = session.execute(
        select(JobLog.rank, JobLog.stream, func.max(JobLog.offset))
        .where(JobLog.workload_id == workload_id)
        .group_by(JobLog.rank, JobLog.stream)
    ).all()
    bases: dict[str, int] = {}
    for rank, stream, last in ends:
        data = session.scalar(
            select(JobLog.data).where(
                JobLog.workload_id == workload_id,
                JobLog.rank == rank,
                JobLog.stream == stream,
                JobLog.offset == last,
            )
        )
        size = last + len((data or "").encode())
        session.add(
            JobLog(
                workload_id=workload_id, rank=rank, stream=stream, offset=size, data=line, at=now
            )
        )
        bases[f"{rank}:{stream}"] = size + len(line.encode())
    return bases


def log_offset(workload: Workload, attempt: int, rank: int, stream: str, offset: int) -> int | None:
    """Where a chunk an agent sent lands in the job's log; None for one of an earlier
    attempt (stored already: an attempt ends only once its logs were read whole)."""
    if attempt != workload.attempt:
        return None
    bases = (workload.recovery or {}).get("log_bases") or {}
    return int(bases.get(f"{rank}:{stream}", 0)) + offset
