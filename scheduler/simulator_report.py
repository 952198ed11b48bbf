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

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .idle import IdleCause
from .model import FleetNode, ProjectTree
from .simulator_measures import PreemptionDecision
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
    faulted: bool = False  # ended by a fault's detection (simulator_faults.py)


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
    # As a preemptor: the decisions made for it, the GPUs they evicted, and how many of
    # those were beyond what it needed (``PreemptionDecision``).
    preemptor_of: int = 0
    evicted_gpus: int = 0
    evicted_beyond_need_gpus: int = 0
    # Faults met (simulator_faults.py) and the GPU-seconds they cost: work redone since the
    # last checkpoint, and the GPUs held between each fault and its detection.
    faults: int = 0
    fault_lost_gpu_s: float = 0.0
    duration_s: float = 0.0  # its work in the trace

    @property
    def effective_training_ratio(self) -> float | None:
        """Its work over the time from its first start to its end: what faults, preemptions
        and the waits after them cost it. None until it finished."""
        if self.start_s is None or self.end_s is None or self.end_s <= self.start_s:
            return None
        return min(1.0, self.duration_s / (self.end_s - self.start_s))


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
    # GPU-hours held over GPU-hours of the fleet, counted only while a job was waiting and
    # only for the GPU types waiting jobs ask for: 1.0 means no GPU idled while work queued.
    allocation_while_waiting: float | None
    # The most the quota tree permits of the same (``QuotaCeiling``), same denominator: a
    # shortfall of the achieved figure below it is the scheduler's, the rest the quotas'.
    allocation_ceiling_while_waiting: float | None
    # The same less what lend limits keep idle for projects that do not ask for it.
    allocation_ceiling_within_lend_limits_while_waiting: float | None
    # The ceiling with each project's waiting requests counted whole (not in part) under
    # its own limit (``QuotaCeiling.permitted_whole``).
    allocation_ceiling_whole_requests_while_waiting: float | None
    # Both at once, lend limits counted with waiting requests whole
    # (``QuotaCeiling.permitted_by_quotas``): the tightest bound of the quotas alone.
    allocation_ceiling_whole_within_lend_limits_while_waiting: float | None
    waiting_s: float  # how long (virtual clock) some job was waiting
    mean_jct_s: float | None  # end - submit, over the finished jobs
    preemptions: int
    lost_gpu_hours: float
    # Per preemption decision (``PreemptionDecision``): GPUs evicted beyond need, summed;
    # decisions; decisions that evicted more than twice the need; decisions taken while
    # the preemptor's gang already fitted some zone's free GPUs.
    evicted_beyond_need_gpus: int
    preemptors: int
    preemptors_over_twice_need: int
    preempted_while_fitting: int
    max_preemptions_per_job: int
    admissions: int
    plan_calls: int
    waits: Waits
    faults: int = 0
    fault_lost_gpu_hours: float = 0.0
    # Over the finished training jobs: the mean of their ratios, and weighted by GPUs.
    mean_effective_training_ratio: float | None = None
    gpu_weighted_effective_training_ratio: float | None = None
    waits_by_project: Mapping[str, Waits] = field(default_factory=dict)
    waits_by_priority: Mapping[str, Waits] = field(default_factory=dict)
    mean_jct_by_project: Mapping[str, float | None] = field(default_factory=dict)
    # While work waited, the free GPUs of the types it asked for by why they were idle
    # (``simulator_measures.IdleCause``), as fractions of those types' GPUs (the
    # denominator of ``allocation_while_waiting``, which they add up to 1 with); gpufleet.
    idle_while_waiting_by_cause: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SimulationResult:
    policy: Mode
    records: tuple[JobRecord, ...]
    never_fits: tuple[NeverFits, ...]
    allocation: Mapping[str, tuple[tuple[float, int], ...]]
    summary: Summary
    capacity: Mapping[str, int] = field(default_factory=dict)  # GPU type -> GPUs
    options: Mapping[str, float] = field(default_factory=dict)
    preemption_decisions: tuple[PreemptionDecision, ...] = ()


@dataclass(frozen=True)
class ClockTotals:
    """Integrals the replay keeps as its clock advances (GPU-seconds and seconds)."""

    start_s: float = 0.0
    end_s: float = 0.0
    held_gpu_s: float = 0.0
    held_while_waiting_gpu_s: float = 0.0  # of the types some waiting job asks for
    capacity_while_waiting_gpu_s: float = 0.0  # the fleet's GPUs of those types
    ceiling_while_waiting_gpu_s: float = 0.0  # what the quota tree permits of those types
    ceiling_within_lend_limits_while_waiting_gpu_s: float = 0.0  # less lend-limit reserves
    ceiling_whole_requests_while_waiting_gpu_s: float = 0.0  # requests counted whole
    ceiling_whole_within_lend_limits_while_waiting_gpu_s: float = 0.0  # both
    # Free GPUs of those types by why they were idle (``simulator_measures.IdleCause``).
    idle_while_waiting_gpu_s: Mapping[str, float] = field(default_factory=dict)
    waiting_s: float = 0.0
    admissions: int = 0
    plan_calls: int = 0


class ClockIntegrals:
    """The integrals of ``ClockTotals`` as the replay's clock advances: GPUs held always;
    while some job waits, over the GPU types waiting jobs ask for, GPUs held, the fleet's
    GPUs, the quota tree's four ceilings and the free GPUs by why they are idle."""

    def __init__(self) -> None:
        self.held_s = self.held_waiting_s = self.waiting_s = 0.0
        self.capacity_s = self.ceiling_s = self.ceiling_lend_s = 0.0
        self.ceiling_whole_s = self.ceiling_quotas_s = 0.0
        self.idle_s: dict[IdleCause, float] = defaultdict(float)

    def advance(
        self,
        elapsed: float,
        held: int,
        while_waiting: tuple[int, int, float, float, float, float] | None,
        idle: Mapping[IdleCause, int],
    ) -> None:
        """``elapsed`` seconds with ``held`` GPUs held and, when some job waited (else
        ``while_waiting`` is None), its measures and ``idle`` GPUs by cause."""
        self.held_s += held * elapsed
        if while_waiting is None:
            return
        held_types, capacity, ceiling, ceiling_lend, ceiling_whole, ceiling_quotas = while_waiting
        self.held_waiting_s += held_types * elapsed
        self.capacity_s += capacity * elapsed
        self.ceiling_s += ceiling * elapsed
        self.ceiling_lend_s += ceiling_lend * elapsed
        self.ceiling_whole_s += ceiling_whole * elapsed
        self.ceiling_quotas_s += ceiling_quotas * elapsed
        self.waiting_s += elapsed
        for cause, gpus in idle.items():
            self.idle_s[cause] += gpus * elapsed

    def totals(self, start_s: float, end_s: float, admissions: int, plan_calls: int) -> ClockTotals:
        return ClockTotals(
            start_s=start_s,
            end_s=end_s,
            held_gpu_s=self.held_s,
            held_while_waiting_gpu_s=self.held_waiting_s,
            capacity_while_waiting_gpu_s=self.capacity_s,
            ceiling_while_waiting_gpu_s=self.ceiling_s,
            ceiling_within_lend_limits_while_waiting_gpu_s=self.ceiling_lend_s,
            ceiling_whole_requests_while_waiting_gpu_s=self.ceiling_whole_s,
            ceiling_whole_within_lend_limits_while_waiting_gpu_s=self.ceiling_quotas_s,
            idle_while_waiting_gpu_s={cause.value: gpu_s for cause, gpu_s in self.idle_s.items()},
            waiting_s=self.waiting_s,
            admissions=admissions,
            plan_calls=plan_calls,
        )


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
    decisions: Sequence[PreemptionDecision] = (),
) -> Summary:
    started = [r for r in records if r.start_s is not None]
    finished = [r for r in records if r.end_s is not None]
    waits_by_project, waits_by_priority, jct_by_project = _waits_and_jcts(started, finished)
    mean_ratio, weighted_ratio = _training_ratios(finished)
    makespan = totals.end_s - totals.start_s
    # While waiting, the GPUs of the types waiting jobs asked for are the denominator.
    waiting = totals.capacity_while_waiting_gpu_s
    return Summary(
        jobs=len(records) + len(never_fits),
        started=len(started),
        finished=len(finished),
        never_fits=len(never_fits),
        never_started=len(records) - len(started),
        gpus=gpus,
        makespan_s=makespan,
        gpu_utilisation=_share(totals.held_gpu_s, gpus * makespan),
        allocation_while_waiting=_share(totals.held_while_waiting_gpu_s, waiting),
        allocation_ceiling_while_waiting=_share(totals.ceiling_while_waiting_gpu_s, waiting),
        allocation_ceiling_within_lend_limits_while_waiting=_share(
            totals.ceiling_within_lend_limits_while_waiting_gpu_s, waiting
        ),
        allocation_ceiling_whole_requests_while_waiting=_share(
            totals.ceiling_whole_requests_while_waiting_gpu_s, waiting
        ),
        allocation_ceiling_whole_within_lend_limits_while_waiting=_share(
            totals.ceiling_whole_within_lend_limits_while_waiting_gpu_s, waiting
        ),
        waiting_s=totals.waiting_s,
        mean_jct_s=_mean([r.end_s - r.submit_s for r in finished if r.end_s is not None]),
        preemptions=sum(r.preemptions for r in records),
        lost_gpu_hours=sum(r.lost_gpu_s for r in records) / 3600,
        evicted_beyond_need_gpus=sum(d.beyond_need_gpus for d in decisions),
        preemptors=len(decisions),
        preemptors_over_twice_need=sum(1 for d in decisions if d.evicted_gpus > 2 * d.need_gpus),
        preempted_while_fitting=sum(1 for d in decisions if d.fitted),
        max_preemptions_per_job=max((r.preemptions for r in records), default=0),
        admissions=totals.admissions,
        plan_calls=totals.plan_calls,
        waits=waits_of(w for ws in waits_by_project.values() for w in ws),
        faults=sum(r.faults for r in records),
        fault_lost_gpu_hours=sum(r.fault_lost_gpu_s for r in records) / 3600,
        mean_effective_training_ratio=mean_ratio,
        gpu_weighted_effective_training_ratio=weighted_ratio,
        waits_by_project={p: waits_of(w) for p, w in sorted(waits_by_project.items())},
        waits_by_priority={p: waits_of(w) for p, w in sorted(waits_by_priority.items())},
        mean_jct_by_project={p: _mean(j) for p, j in sorted(jct_by_project.items())},
        idle_while_waiting_by_cause={
            cause: gpu_s / waiting
            for cause, gpu_s in sorted(totals.idle_while_waiting_gpu_s.items())
        }
        if waiting > 0
        else {},
    )


def _share(part: float, whole: float) -> float | None:
    """``part`` as a fraction of ``whole``; None when there is no whole."""
    return part / whole if whole > 0 else None


def _waits_and_jcts(
    started: Sequence[JobRecord], finished: Sequence[JobRecord]
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """The waits of the started jobs by project and by priority, and the completion times
    of the finished ones by project."""
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
    return waits_by_project, waits_by_priority, jct_by_project


def _training_ratios(finished: Sequence[JobRecord]) -> tuple[float | None, float | None]:
    """Over the finished training jobs: the mean effective training ratio, and the mean
    weighted by GPUs."""
    ratios = [
        (r.num_gpus, ratio)
        for r in finished
        if r.kind == "job" and (ratio := r.effective_training_ratio) is not None
    ]
    weighted = sum(g * ratio for g, ratio in ratios) / sum(g for g, _ in ratios) if ratios else None
    return _mean([ratio for _, ratio in ratios]), weighted


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
        "faulted": run.faulted,
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
        "preemptor_of": r.preemptor_of,
        "evicted_gpus": r.evicted_gpus,
        "evicted_beyond_need_gpus": r.evicted_beyond_need_gpus,
        "faults": r.faults,
        "fault_lost_gpu_s": r.fault_lost_gpu_s,
        "effective_training_ratio": r.effective_training_ratio,
    }


def decision_json(d: PreemptionDecision) -> dict[str, Any]:
    return {
        "at_s": d.at_s,
        "job_id": d.job_id,
        "victims": list(d.victims),
        "cluster": d.cluster,
        "zone": d.zone,
        "gpus": d.gpus,
        "free_gpus": d.free_gpus,
        "need_gpus": d.need_gpus,
        "evicted_gpus": d.evicted_gpus,
        "fitted": d.fitted,
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
        "allocation_ceiling_while_waiting": s.allocation_ceiling_while_waiting,
        "allocation_ceiling_within_lend_limits_while_waiting": (
            s.allocation_ceiling_within_lend_limits_while_waiting
        ),
        "allocation_ceiling_whole_requests_while_waiting": (
            s.allocation_ceiling_whole_requests_while_waiting
        ),
        "allocation_ceiling_whole_within_lend_limits_while_waiting": (
            s.allocation_ceiling_whole_within_lend_limits_while_waiting
        ),
        "idle_while_waiting_by_cause": dict(s.idle_while_waiting_by_cause),
        "waiting_s": s.waiting_s,
        "mean_jct_s": s.mean_jct_s,
        "preemptions": s.preemptions,
        "lost_gpu_hours": s.lost_gpu_hours,
        "faults": s.faults,
        "fault_lost_gpu_hours": s.fault_lost_gpu_hours,
        "mean_effective_training_ratio": s.mean_effective_training_ratio,
        "gpu_weighted_effective_training_ratio": s.gpu_weighted_effective_training_ratio,
        "evicted_beyond_need_gpus": s.evicted_beyond_need_gpus,
        "preemptors": s.preemptors,
        "preemptors_over_twice_need": s.preemptors_over_twice_need,
        "preempted_while_fitting": s.preempted_while_fitting,
        "max_preemptions_per_job": s.max_preemptions_per_job,
        "admissions": s.admissions,
        "plan_calls": s.plan_calls,
        "wait": _waits_json(s.waits),
        "wait_by_project": {p: _waits_json(w) for p, w in s.waits_by_project.items()},
        "wait_by_priority": {p: _waits_json(w) for p, w in s.waits_by_priority.items()},
        "mean_jct_s_by_project": dict(s.mean_jct_by_project),
    }


def result_json(result: SimulationResult) -> dict[str, Any]:
    """The result as JSON-ready data: ``jobs`` (one record per job that could fit),
    ``never_fits``, ``allocation`` (project -> [[time, GPUs], ...] steps), ``summary`` and
    ``preemption_decisions`` (one per preemptor and plan, in time order)."""
    return {
        "policy": str(result.policy),
        "options": dict(result.options),
        "capacity": dict(result.capacity),
        "summary": summary_json(result.summary),
        "never_fits": [{"job_id": n.job_id, "reason": n.reason} for n in result.never_fits],
        "allocation": {p: [[t, g] for t, g in steps] for p, steps in result.allocation.items()},
        "jobs": [record_json(r) for r in result.records],
        "preemption_decisions": [decision_json(d) for d in result.preemption_decisions],
    }


# ------------------------------------------------------------ within guarantee
@dataclass(frozen=True)
class GuaranteedWait:
    """The wait of a started job that asked within its project's guarantee: its project
    held (``allocation``, every type) plus the job no more than the project's own
    guarantee of the job's type at submission.

    ``blocked``: at submission no zone of its type could have held the gang even had every
    borrower been evicted, because other projects' within-guarantee work filled every zone
    (an approximation, below). ``blocked_s``: how long that lasted from submission (up to
    the start); ``wait_s - blocked_s`` is the wait the scheduler owes once room could be
    made."""

    job_id: str
    project: str
    gpus: int
    wait_s: float
    blocked: bool
    blocked_s: float


def _zone_holdings(
    records: Sequence[JobRecord], gpu_type: str
) -> tuple[list[float], list[dict[tuple[str, str], dict[str, int]]]]:
    """GPUs of the type each project held in each zone, as steps: after all changes at
    ``times[i]``, ``states[i]``[(cluster, zone)][project] (runs hold until their end)."""
    changes: dict[float, list[tuple[tuple[str, str], str, int]]] = defaultdict(list)
    for r in records:
        if r.gpu_type != gpu_type:
            continue
        for run in r.runs:
            zone = (run.cluster, run.zone)
            changes[run.start_s].append((zone, r.project, len(run.gpus)))
            changes[run.end_s].append((zone, r.project, -len(run.gpus)))
    held: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    times, states = [], []
    for at in sorted(changes):
        for zone, project, gpus in changes[at]:
            held[zone][project] += gpus
        times.append(at)
        states.append({z: {p: g for p, g in by.items() if g} for z, by in held.items()})
    return times, states


def _room_beside_guarantees(
    state: Mapping[tuple[str, str], Mapping[str, int]],
    zone_sizes: Mapping[tuple[str, str], int],
    guarantee: Mapping[str, int],
    project: str,
) -> int:
    """The most GPUs one zone could give ``project`` if every borrower were evicted: a
    zone's size less the within-guarantee work of the other projects in it. A project's
    within-guarantee GPUs are min(held, guarantee) over all zones, spread over its zones
    in proportion to what it holds in each (the approximation: which of its GPUs are the
    borrowed ones is not recorded)."""
    total: dict[str, int] = defaultdict(int)
    for by in state.values():
        for p, gpus in by.items():
            total[p] += gpus
    room = 0
    for zone, size in zone_sizes.items():
        others = sum(
            gpus * min(1.0, guarantee.get(p, 0) / total[p])
            for p, gpus in state.get(zone, {}).items()
            if p != project
        )
        room = max(room, size - math.ceil(others - 1e-9))
    return room


def _queued_ahead(
    record: JobRecord, same_queue: Sequence[JobRecord], ranks: Mapping[str, int]
) -> int:
    """GPUs of the project's requests of the type that waited, ahead of ``record`` in
    its queue (a higher class, or the same class and submitted earlier), when it was
    submitted: they come first for the project's guarantee."""
    at, rank = record.submit_s, ranks.get(record.priority, 0)
    ahead = 0
    for other in same_queue:
        if other is record or other.submit_s > at:
            continue
        other_rank = ranks.get(other.priority, 0)
        if other_rank < rank or (other_rank == rank and other.submit_s == at):
            continue
        running = any(run.start_s <= at < run.end_s for run in other.runs)
        done = other.end_s is not None and other.end_s <= at
        if not running and not done:
            ahead += other.num_gpus
    return ahead


def within_guarantee_waits(
    result: SimulationResult,
    tree: ProjectTree,
    nodes: Sequence[FleetNode],
    ranks: Mapping[str, int] | None = None,
) -> list[GuaranteedWait]:
    """``GuaranteedWait`` for every started job that asked within its project's
    guarantee, in record order: what its project held when it was submitted, plus what
    its project's requests ahead of it in the queue asked for (``ranks``: priority class
    ranks; without them only what the project held), plus its own GPUs, is within the
    guarantee. ``blocked`` is approximate (``_room_beside_guarantees``): whole pods and
    lend limits are not counted; a job is blocked while no zone's room beside other
    projects' within-guarantee work reaches its GPUs."""
    queues: dict[tuple[str, str], list[JobRecord]] = defaultdict(list)
    for record in result.records:
        queues[(record.project, record.gpu_type)].append(record)
    zone_sizes: dict[str, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
    for n in nodes:
        zone_sizes[n.gpu_type][(n.cluster, n.zone)] += n.gpus
    holdings = {t: _zone_holdings(result.records, t) for t in zone_sizes}
    step_times = {p: [t for t, _ in steps] for p, steps in result.allocation.items()}
    out = []
    for r in result.records:
        if r.start_s is None or r.project not in tree.projects:
            continue
        quota = tree.projects[r.project].quotas.get(r.gpu_type)
        series = result.allocation.get(r.project, ())
        i = bisect.bisect_right(step_times.get(r.project, []), r.submit_s) - 1
        held = series[i][1] if i >= 0 else 0
        if r.start_s == r.submit_s:  # the step at its submission counts its own start
            held -= r.num_gpus
        if ranks is not None:
            held += _queued_ahead(r, queues[(r.project, r.gpu_type)], ranks)
        if quota is None or held + r.num_gpus > quota.guaranteed:
            continue
        guarantee = {
            p.name: p.quotas[r.gpu_type].guaranteed for p in tree if r.gpu_type in p.quotas
        }
        times, states = holdings[r.gpu_type]
        blocked_until = r.submit_s
        k = bisect.bisect_right(times, r.submit_s) - 1
        while blocked_until < r.start_s:
            state = states[k] if k >= 0 else {}
            room = _room_beside_guarantees(state, zone_sizes[r.gpu_type], guarantee, r.project)
            if room >= r.num_gpus:
                break
            k += 1
            blocked_until = min(times[k], r.start_s) if k < len(times) else r.start_s
        out.append(
            GuaranteedWait(
                job_id=r.job_id,
                project=r.project,
                gpus=r.num_gpus,
                wait_s=r.start_s - r.submit_s,
                blocked=blocked_until > r.submit_s,
                blocked_s=blocked_until - r.submit_s,
            )
        )
    return out
