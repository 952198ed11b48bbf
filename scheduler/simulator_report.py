"""What a simulation returns: one record per job, the jobs that never fit, the GPUs each
project held over time, and a summary; and the JSON form of all of it.

Pure functions over plain values; ``simulator.py`` fills these in, the CLI writes them out.

Invariants of a ``SimulationResult``:
- every trace job appears exactly once: as a ``JobRecord`` or as a ``NeverFits`` entry;
- a record's runs are in time order and do not overlap; every run but the last was
  preempted; ``start_s`` is the first run's start, ``end_s`` the last run's end when the
  job finished, and both are ``None`` for a job that never started;
- ``allocation`` holds, per project, ``(time, GPUs held)`` steps: a value holds until the
  next step; consecutive steps differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .snapshot import Mode


@dataclass(frozen=True)
class Run:
    """One stretch of a job holding GPUs, from admission to completion or to the end of
    its stop (a preempted run holds its GPUs while it snapshots or checkpoints)."""

    start_s: float
    end_s: float
    cluster: str
    zone: str
    nodes: tuple[str, ...]  # distinct, in pod order
    gpus: tuple[str, ...]  # GPU ids, ``node/index``
    preempted: bool = False


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    project: str
    kind: str
    priority: str
    gpu_type: str
    num_gpus: int
    submit_s: float
    start_s: float | None  # the first start
    end_s: float | None  # when it finished; None if it never finished
    cluster: str | None  # where its last run was
    zone: str | None
    nodes: tuple[str, ...]
    preemptions: int
    lost_gpu_s: float  # GPU-seconds of work redone after preemptions
    runs: tuple[Run, ...] = ()
    # For a job still waiting when the trace ran out: the core's last word on why.
    waiting_reason: str | None = None


@dataclass(frozen=True)
class NeverFits:
    job_id: str
    reason: str


@dataclass(frozen=True)
class Waits:
    """Wait (first start - submit) percentiles in seconds, over the jobs that started."""

    count: int
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass(frozen=True)
class Summary:
    jobs: int
    started: int
    finished: int
    never_fits: int
    never_started: int
    gpus: int  # the fleet's GPUs, every type
    makespan_s: float  # first submission to the last event
    gpu_utilisation: float | None  # GPU-seconds held / GPU-seconds of the fleet, makespan
    # GPU-hours held over GPU-hours of the fleet, counted only while a job was waiting:
    # 1.0 means no GPU idled while work queued.
    allocation_while_waiting: float | None
    waiting_s: float  # how long (virtual clock) some job was waiting
    mean_jct_s: float | None  # end - submit, over the finished jobs
    preemptions: int
    lost_gpu_hours: float
    admissions: int
    plan_calls: int
    waits: Waits
    waits_by_project: Mapping[str, Waits] = field(default_factory=dict)
    waits_by_priority: Mapping[str, Waits] = field(default_factory=dict)
    mean_jct_by_project: Mapping[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class SimulationResult:
    policy: Mode
    records: tuple[JobRecord, ...]
    never_fits: tuple[NeverFits, ...]
    allocation: Mapping[str, tuple[tuple[float, int], ...]]
    summary: Summary
    capacity: Mapping[str, int] = field(default_factory=dict)  # GPU type -> GPUs
    options: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClockTotals:
    """Integrals the replay keeps as its clock advances (GPU-seconds and seconds)."""

    start_s: float = 0.0
    end_s: float = 0.0
    held_gpu_s: float = 0.0
    held_while_waiting_gpu_s: float = 0.0
    waiting_s: float = 0.0
    admissions: int = 0
    plan_calls: int = 0


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def waits_of(values: Iterable[float]) -> Waits:
    ordered = sorted(values)
    return Waits(
        len(ordered), percentile(ordered, 0.5), percentile(ordered, 0.95), percentile(ordered, 0.99)
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(
    records: Sequence[JobRecord],
    never_fits: Sequence[NeverFits],
    gpus: int,
    totals: ClockTotals,
) -> Summary:
    started = [r for r in records if r.start_s is not None]
    finished = [r for r in records if r.end_s is not None]
    waits_by_project: dict[str, list[float]] = defaultdict(list)
    waits_by_priority: dict[str, list[float]] = defaultdict(list)
    for r in started:
        assert r.start_s is not None
        waits_by_project[r.project].append(r.start_s - r.submit_s)
        waits_by_priority[r.priority].append(r.start_s - r.submit_s)
    jct_by_project: dict[str, list[float]] = defaultdict(list)
    for r in finished:
        assert r.end_s is not None
        jct_by_project[r.project].append(r.end_s - r.submit_s)
    makespan = totals.end_s - totals.start_s
    fleet_gpu_s = gpus * makespan
    waiting_fleet_gpu_s = gpus * totals.waiting_s
    return Summary(
        jobs=len(records) + len(never_fits),
        started=len(started),
        finished=len(finished),
        never_fits=len(never_fits),
        never_started=len(records) - len(started),
        gpus=gpus,
        makespan_s=makespan,
        gpu_utilisation=totals.held_gpu_s / fleet_gpu_s if fleet_gpu_s > 0 else None,
        allocation_while_waiting=totals.held_while_waiting_gpu_s / waiting_fleet_gpu_s
        if waiting_fleet_gpu_s > 0
        else None,
        waiting_s=totals.waiting_s,
        mean_jct_s=_mean([r.end_s - r.submit_s for r in finished if r.end_s is not None]),
        preemptions=sum(r.preemptions for r in records),
        lost_gpu_hours=sum(r.lost_gpu_s for r in records) / 3600,
        admissions=totals.admissions,
        plan_calls=totals.plan_calls,
        waits=waits_of(w for ws in waits_by_project.values() for w in ws),
        waits_by_project={p: waits_of(w) for p, w in sorted(waits_by_project.items())},
        waits_by_priority={p: waits_of(w) for p, w in sorted(waits_by_priority.items())},
        mean_jct_by_project={p: _mean(j) for p, j in sorted(jct_by_project.items())},
    )


# ------------------------------------------------------------------------- JSON
def _waits_json(w: Waits) -> dict[str, Any]:
    return {"count": w.count, "p50_s": w.p50, "p95_s": w.p95, "p99_s": w.p99}


def _run_json(run: Run) -> dict[str, Any]:
    return {
        "start_s": run.start_s,
        "end_s": run.end_s,
        "cluster": run.cluster,
        "zone": run.zone,
        "nodes": list(run.nodes),
        "gpus": list(run.gpus),
        "preempted": run.preempted,
    }


def record_json(r: JobRecord) -> dict[str, Any]:
    return {
        "job_id": r.job_id,
        "project": r.project,
        "kind": r.kind,
        "priority": r.priority,
        "gpu_type": r.gpu_type,
        "num_gpus": r.num_gpus,
        "submit_s": r.submit_s,
        "start_s": r.start_s,
        "end_s": r.end_s,
        "cluster": r.cluster,
        "zone": r.zone,
        "nodes": list(r.nodes),
        "preemptions": r.preemptions,
        "lost_gpu_s": r.lost_gpu_s,
        "runs": [_run_json(run) for run in r.runs],
        "waiting_reason": r.waiting_reason,
    }


def summary_json(s: Summary) -> dict[str, Any]:
    return {
        "jobs": s.jobs,
        "started": s.started,
        "finished": s.finished,
        "never_fits": s.never_fits,
        "never_started": s.never_started,
        "gpus": s.gpus,
        "makespan_s": s.makespan_s,
        "gpu_utilisation": s.gpu_utilisation,
        "allocation_while_waiting": s.allocation_while_waiting,
        "waiting_s": s.waiting_s,
        "mean_jct_s": s.mean_jct_s,
        "preemptions": s.preemptions,
        "lost_gpu_hours": s.lost_gpu_hours,
        "admissions": s.admissions,
        "plan_calls": s.plan_calls,
        "wait": _waits_json(s.waits),
        "wait_by_project": {p: _waits_json(w) for p, w in s.waits_by_project.items()},
        "wait_by_priority": {p: _waits_json(w) for p, w in s.waits_by_priority.items()},
        "mean_jct_s_by_project": dict(s.mean_jct_by_project),
    }


def result_json(result: SimulationResult) -> dict[str, Any]:
    """The result as JSON-ready data: ``jobs`` (one record per job that could fit),
    ``never_fits``, ``allocation`` (project -> [[time, GPUs], ...] steps) and ``summary``."""
    return {
        "policy": str(result.policy),
        "options": dict(result.options),
        "capacity": dict(result.capacity),
        "summary": summary_json(result.summary),
        "never_fits": [{"job_id": n.job_id, "reason": n.reason} for n in result.never_fits],
        "allocation": {p: [[t, g] for t, g in steps] for p, steps in result.allocation.items()},
        "jobs": [record_json(r) for r in result.records],
    }
