"""The what-if simulator: replay a job trace through the scheduling core on a virtual clock.

``simulate(jobs, nodes, projects, policy, options) -> SimulationResult`` is pure: it reads
plain values (``inputs.read_trace`` / ``read_fleet`` / ``read_projects`` give them) and
returns plain values (``simulator_report``); the CLI reads the files and writes the JSON.

The replay is event driven. Events are arrivals, completions, the end of a preempted
workload's stop (its snapshot or checkpoint grace), checkpoints, and wake-ups once a new
workload has run ``min_run_time_s`` (it may be preempted from then on). All events of one
timestamp are applied together, then the core is asked once — ``plan(snapshot, now, memo)``,
with one ``PlanMemo`` for the whole replay —
and its decisions are applied: admissions start at once and end ``remaining`` seconds
later; a preempted workload keeps its GPUs, marked stopping, until its stop delay has
passed, then goes back to the queue with its original submission time (so it keeps its
place) and the work it has not checkpointed to do again. The core is asked only when
something happened and the queue is not empty: a workload waits for the next event,
never for a busy loop.

Invariants, between two events:
- every GPU of the fleet is either in its node's ``free`` tuple or held by exactly one
  running (or stopping) workload, and ``free`` lists ids in device order;
- a workload is in exactly one of: not yet arrived, the queue, running, finished;
- the state is changed only by the event handlers and ``_apply`` of ``_Replay``, and
  each frozen value (NodeState, Running, Pending) is replaced, never rebuilt wholesale:
  a cycle costs the core's work plus three ``tuple(dict.values())``.

Modelling choices (``docs/simulator.md`` explains them):
- jobs checkpoint every ``checkpoint_interval_s`` from each start; a preempted job loses
  (and redoes) the work since its last checkpoint, counted in ``lost_gpu_s`` as GPUs x
  (end of its stop - last checkpoint); sessions snapshot everything and lose nothing;
- GPU ids are ``node/index``; a trace job without ``gpus_per_pod`` takes one pod when it
  fits on the largest node of its type, else whole nodes (``num_gpus`` must divide);
- a job without ``gpu_type`` asks for the fleet's most common type (by GPUs); without
  ``priority`` its project's ``default_priority``; a trace group that names no project
  is added as a top-level project without quotas whose default priority is opportunistic;
- priority ranks are ``PRIORITY_RANKS`` (the projects file carries none today); only
  opportunistic work may be preempted by a higher class of its own project;
- the trace has no users: each job is its own user, so a per-user cap bounds a job;
- a job the configuration could never admit, even on an empty fleet (``_shape``: a GPU
  type the fleet lacks, a gang no zone holds, more than its project or a user may ever
  hold under the policy), is never queued: it is in ``never_fits`` and never waits.

Measurements (``simulator_measures``): while some job waits, the replay integrates, over
the GPU types waiting jobs ask for, the GPUs held, the fleet's GPUs and the ceiling the
quota tree permits (``QuotaCeiling``, recomputed only at timestamps where something
changed), in ``simulator_report.ClockIntegrals``; each preemption decision is measured as
its plan is applied (``simulator_preemptions``).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial

from .errors import InputError, SchedulerError
from .holds import hand_back_holds
from .idle import IdleCause, WaitingShape, idle_by_cause, kept_gpus, waiting_shape
from .inputs import MAX_SECONDS, TraceJob
from .memo import PlanMemo
from .model import FleetNode, ProjectTree
from .plan import plan
from .quota import QuotaLimits
from .simulator_faults import RecoveringReplay
from .simulator_jobs import (
    PREEMPTIBLE_CLASSES,
    PRIORITY_RANKS,
    BookedJob,
    FleetRoom,
    TraceJobError,
    check_checkpoints,
    shape,
    with_trace_groups,
)
from .simulator_measures import PreemptionDecision, QuotaCeiling
from .simulator_preemptions import MeasuredPreemptions
from .simulator_report import (
    ClockIntegrals,
    ClockTotals,
    JobRecord,
    NeverFits,
    Run,
    SimulationResult,
    summarise,
)
from .snapshot import (
    Mode,
    NodeState,
    Plan,
    Pod,
    Policy,
    PreemptionCause,
    Running,
    SchedulingSnapshot,
)
from .tracked import ChangeStream

__all__ = [
    "PREEMPTIBLE_CLASSES",
    "PRIORITY_RANKS",
    "JobRecord",
    "NeverFits",
    "PlanConflict",
    "Planner",
    "Run",
    "SimulationOptions",
    "SimulationResult",
    "TraceJobError",
    "simulate",
]

Planner = Callable[[SchedulingSnapshot, float], Plan]


@dataclass(frozen=True)
class SimulationOptions:
    session_snapshot_s: float = 20.0  # a preempted session holds its GPUs this long
    job_checkpoint_grace_s: float = 30.0  # a preempted job holds its GPUs this long
    checkpoint_interval_s: float = 1800.0  # jobs checkpoint this often from each start
    min_run_time_s: float = 300.0  # Policy.min_run_time_s
    max_preemption_searches: int = 64  # Policy.max_preemption_searches
    # Faults (simulator_faults.py): per GPU-hour of a running job; 0: none.
    fault_rate_per_gpu_hour: float = 0.0
    fault_detect_s: float = 60.0  # the fault to the stop
    fault_restart_s: float = 60.0  # the next run's start and checkpoint load
    # How long the faulty node stays out of service once the fault is found (one node of
    # the job, as cordoned: other work there runs on); 0: repaired at once.
    fault_repair_s: float = 0.0
    fault_seed: int = 0
    # The controller's retry budget: this many faults per 1,024 GPUs within a day end it.
    fault_budget: int = 3
    # Recovery spares (``spares.py``): nodes held back per zone and GPU type for jobs
    # restarting after a fault, lent to preemptible work meanwhile; 0: none.
    spare_nodes_per_zone: int = 0

    def __post_init__(self) -> None:
        # Each check says what must hold: NaN fails every comparison. Past MAX_SECONDS
        # (infinity too) the virtual clock would run on for ever.
        if not 0 < self.checkpoint_interval_s <= MAX_SECONDS:
            raise InputError(
                "checkpoint_interval_s must be a number of seconds more than 0 up to 1e10, "
                f"not {self.checkpoint_interval_s}"
            )
        for name in (
            "session_snapshot_s",
            "job_checkpoint_grace_s",
            "min_run_time_s",
            "fault_detect_s",
            "fault_restart_s",
            "fault_repair_s",
        ):
            if not 0 <= (value := getattr(self, name)) <= MAX_SECONDS:
                raise InputError(
                    f"{name} must be a number of seconds from 0 up to 1e10, not {value}"
                )
        if not 0 <= self.fault_rate_per_gpu_hour < math.inf:
            raise InputError(
                f"fault_rate_per_gpu_hour must be a finite number, 0 or more, not "
                f"{self.fault_rate_per_gpu_hour}"
            )
        if self.fault_budget < 0:
            raise InputError("fault_budget must be zero or more")
        if self.spare_nodes_per_zone < 0:
            raise InputError("spare_nodes_per_zone must be zero or more")
        if self.max_preemption_searches < 0:
            raise InputError("max_preemption_searches must be zero or more")


class PlanConflict(SchedulerError):
    """The core returned a decision the simulated fleet cannot carry out (a GPU that is
    not free, a workload that is not queued or not running): a bug in the core."""


# Event kinds, in the order they are applied within one timestamp: a job that completes
# at the moment its stop would end has completed; a checkpoint taken at that moment counts.
# A fault, and its detection, come last: a job that finishes or stops then has done so.
# A repaired node comes back last of all, for the next cycle's snapshot.
FINISH, CHECKPOINT, STOPPED, ARRIVE, WAKE, FAULT, FAULT_DETECTED, REPAIRED = range(8)


def _with_free(node: NodeState, free: tuple[str, ...]) -> NodeState:
    # Spelled out: dataclasses.replace costs several times more, and this runs per pod.
    return NodeState(
        name=node.name,
        cluster=node.cluster,
        zone=node.zone,
        gpu_type=node.gpu_type,
        total=node.total,
        free=free,
        schedulable=node.schedulable,
        labels=node.labels,
    )


def _checkpointed(r: Running, at: float) -> Running:
    return Running(
        id=r.id,
        project=r.project,
        user=r.user,
        kind=r.kind,
        gpu_type=r.gpu_type,
        cluster=r.cluster,
        zone=r.zone,
        pods=r.pods,
        priority=r.priority,
        preemptible=r.preemptible,
        started_at=r.started_at,
        last_progress_at=at,
        idle_reclaimable=r.idle_reclaimable,
        stopping=r.stopping,
        stopping_for=r.stopping_for,
        preemptions=r.preemptions,
        checkpoint_interval_s=r.checkpoint_interval_s,
        created_at=r.created_at,
    )


class _Replay(RecoveringReplay, MeasuredPreemptions):
    """The replay's state and its event loop (see the module docstring's invariants)."""

    def __init__(
        self,
        jobs: Sequence[BookedJob],
        nodes: Sequence[FleetNode],
        tree: ProjectTree,
        policy: Policy,
        options: SimulationOptions,
        planner: Planner,
    ):
        self.jobs = {j.wid: j for j in jobs}
        self.tree = tree
        self.policy = policy
        self.options = options
        self.planner = planner
        self.all_gpus = {n.name: tuple(f"{n.name}/{i}" for i in range(n.gpus)) for n in nodes}
        self.free = {name: set(ids) for name, ids in self.all_gpus.items()}
        self.nodes = {
            n.name: NodeState(
                name=n.name,
                cluster=n.cluster,
                zone=n.zone,
                gpu_type=n.gpu_type,
                total=n.gpus,
                free=self.all_gpus[n.name],
                labels=n.labels,
            )
            for n in nodes
        }
        self.node_names = sorted(self.nodes)  # a REPAIRED event names one by its index
        self.repairing: dict[str, float] = {}
        self.capacity = sum(n.gpus for n in nodes)
        self.free_by_type: dict[str, int] = defaultdict(int)
        self.zone_nodes: dict[tuple[str, str, str], list[str]] = defaultdict(list)
        for n in nodes:
            self.free_by_type[n.gpu_type] += n.gpus
            self.zone_nodes[(n.gpu_type, n.cluster, n.zone)].append(n.name)
        self.gpus_by_type = dict(self.free_by_type)
        self.held_by_type: dict[str, int] = defaultdict(int)
        self.ceiling = QuotaCeiling(tree, policy.mode, self.gpus_by_type)
        # While some job waits, per moment, over the GPU types the waiting jobs ask for:
        # GPUs held, the fleet's GPUs, and the four ceilings. Stale once anything changed.
        self.while_waiting = (0, 0, 0.0, 0.0, 0.0, 0.0)
        # The same moments' free GPUs by why they are idle (gpufleet only: the causes are
        # its quotas').
        self.idle: Counter[IdleCause] = Counter()
        self.quota_limits = QuotaLimits(tree)
        self.measures_stale = False
        self.decisions: list[PreemptionDecision] = []
        # Every change to these is recorded and handed to the core with the next snapshot.
        self.stream = ChangeStream()
        self.running = self.stream.running
        self.queue = self.stream.queue
        # The shapes of the queued requests (project, type, GPUs per pod, pods) -> how
        # many: what could start at all, and what the idle GPUs are measured against.
        self.queued_shapes: Counter[WaitingShape] = Counter()
        self.events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.held = 0
        self.held_by_project: dict[str, int] = defaultdict(int)
        self.allocation: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.changed: set[str] = set()
        self.last_plan = Plan()
        self.holding: dict[int, tuple[str, str]] = {}  # workload -> the zone held for it
        self.reasons_stale = False  # a cycle was skipped since last_plan
        self.admissions = 0
        self.plan_calls = 0
        self.rng = random.Random(options.fault_seed)
        for job in sorted(jobs, key=lambda j: (j.trace.submit_s, j.wid)):
            self._push(job.trace.submit_s, ARRIVE, job.wid, 0)

    def _push(self, at: float, kind: int, wid: int, attempt: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, kind, self._seq, wid, attempt))

    # ------------------------------------------------------------------ the loop
    def run(self) -> ClockTotals:
        events = self.events
        start = clock = events[0][0] if events else 0.0
        integrals = ClockIntegrals()
        while events:
            now = events[0][0]
            if now > clock:
                integrals.advance(
                    now - clock, self.held, self.while_waiting if self.queue else None, self.idle
                )
                clock = now
            if self._apply_events(now) and self.queue:
                self._cycle(now)
            self._record_allocations(now)
            if self.measures_stale:
                self._measure_while_waiting()
        if self.queue and self.reasons_stale:
            # Only for the waiting reasons of what never started: nothing can start now.
            self.last_plan = self.planner(self._snapshot(), clock)
            if self.last_plan.admissions or self.last_plan.preemptions:
                raise PlanConflict("the core acted on a fleet where nothing queued fits")
        return integrals.totals(start, clock, self.admissions, self.plan_calls)

    def _apply_events(self, now: float) -> bool:
        """Apply every event of timestamp ``now``, in the order of their kinds; whether
        the core must be asked again."""
        events = self.events
        replan = False
        while events and events[0][0] == now:
            _, kind, _, wid, attempt = heapq.heappop(events)
            if kind == REPAIRED:  # ``wid`` numbers a node here
                replan |= self._repaired(wid, now)
                continue
            job = self.jobs[wid]
            if kind == ARRIVE:
                self._enqueue(job)
                replan = True
            elif job.attempt != attempt:
                continue  # the run this event belongs to is over
            elif kind == FINISH:
                if job.fault_at is None:  # one struck by a fault does not finish
                    self._finish(job, now)
                    replan = True
            elif kind == CHECKPOINT:
                self._checkpoint(job, now)
            elif kind == STOPPED:
                self._stopped(job, now)
                replan = True
            elif kind == FAULT:
                self._faulted(job, now, FAULT_DETECTED)
            elif kind == FAULT_DETECTED:
                self._fault_detected(job, now, REPAIRED)
                replan = True
            else:  # WAKE: the workload may now be preempted
                replan = True
        return replan

    def _cycle(self, now: float) -> None:
        """Ask the core and apply its plan; under fifo and static, only when something
        queued could fit the free GPUs (else the waiting reasons are left stale)."""
        if self.policy.mode is Mode.GPUFLEET or self._could_admit():
            self._apply(self.planner(self._snapshot(), now), now)
        else:
            self.reasons_stale = True

    def _record_allocations(self, now: float) -> None:
        """A step in the allocation series of each project whose holding changed."""
        for project in self.changed:
            steps = self.allocation[project]
            held = self.held_by_project[project]
            if not steps or steps[-1][1] != held:
                steps.append((now, held))
        self.changed.clear()

    def _measure_while_waiting(self) -> None:
        """Only the GPU types some queued request asks for count: GPUs of a type nobody
        waits for are not idle while work waits, however many are free."""
        self.measures_stale = False
        types = list(dict.fromkeys(shape[1] for shape in self.queued_shapes))
        self.while_waiting = (
            sum(self.held_by_type[t] for t in types),
            sum(self.gpus_by_type[t] for t in types),
            sum(self.ceiling.permitted(t) for t in types),
            sum(self.ceiling.permitted_within_lend_limits(t) for t in types),
            sum(self.ceiling.permitted_whole(t) for t in types),
            sum(self.ceiling.permitted_by_quotas(t) for t in types),
        )
        if self.policy.mode is Mode.GPUFLEET and self.queue:
            held = set(self.last_plan.held)
            self.idle = idle_by_cause(
                self.nodes.values(),
                self.queued_shapes,
                ((r.project, r.gpu_type, r.gpus) for r in self.running.values()),
                kept_gpus(self.queue.values()),
                held,
                self.tree,
                self.quota_limits,
            )

    def _could_admit(self) -> bool:
        """Whether some queued request is no larger than the free GPUs of its type. When
        none is, a cycle without preemption (fifo, static) cannot change anything."""
        return any(
            self.free_by_type[gpu_type] >= per_pod * pods
            for _, gpu_type, per_pod, pods in self.queued_shapes
        )

    def _snapshot(self) -> SchedulingSnapshot:
        self.plan_calls += 1
        self.reasons_stale = False
        return SchedulingSnapshot(
            nodes=tuple(self.nodes.values()),
            running=tuple(self.running.values()),
            queue=tuple(self.queue.values()),
            projects=self.tree,
            priorities=PRIORITY_RANKS,
            preemptible=PREEMPTIBLE_CLASSES,
            policy=self.policy,
            changes=self.stream.changes(),
        )

    def _enqueue(self, job: BookedJob) -> None:
        self.queue[job.wid] = job.pending
        self.queued_shapes[waiting_shape(job.pending)] += 1
        self.ceiling.enqueue(job.project, job.gpu_type, job.trace.num_gpus)
        self.measures_stale = True

    # ------------------------------------------------------------ the decisions
    def _apply(self, plan: Plan, now: float) -> None:
        self.last_plan = plan
        for admission in plan.admissions:
            job = self.jobs[admission.workload_id]
            if self.queue.pop(job.wid, None) is None:
                raise PlanConflict(f"admitted workload {job.wid} is not in the queue")
            shape = waiting_shape(job.pending)
            self.queued_shapes[shape] -= 1
            if not self.queued_shapes[shape]:
                del self.queued_shapes[shape]
            self.ceiling.dequeue(job.project, job.gpu_type, job.trace.num_gpus)
            self._start(job, admission.cluster, admission.zone, admission.pods, now)
        for kept in plan.kept:  # a preemptor's placement, until it is admitted
            waiting = self.queue.get(kept.workload_id)
            if waiting is None:
                raise PlanConflict(f"kept workload {kept.workload_id} is not in the queue")
            self.queue[kept.workload_id] = replace(waiting, promised=kept.pods)
        self.holding = hand_back_holds(self.queue, self.holding, plan)
        victims_for: dict[int, list[Running]] = defaultdict(list)
        for_caps: set[int] = set()  # preemptors a cap asked victims of (their backfill)
        for preemption in plan.preemptions:
            victim = self.running.get(preemption.victim_id)
            if victim is None:
                raise PlanConflict(f"preempted workload {preemption.victim_id} is not running")
            if victim.stopping:
                continue
            job = self.jobs[victim.id]
            self.running[victim.id] = replace(
                victim, stopping=True, stopping_for=preemption.for_workload_id
            )
            victims_for[preemption.for_workload_id].append(victim)
            if preemption.cause is PreemptionCause.BACKFILL:
                for_caps.add(preemption.for_workload_id)
            job.stop_began = now
            delay = (
                self.options.session_snapshot_s
                if job.trace.kind == "session"
                else self.options.job_checkpoint_grace_s
            )
            self._push(now + delay, STOPPED, job.wid, job.attempt)
        for preemptor, victims in victims_for.items():
            self._measure_preemption(
                self.jobs[preemptor], victims, plan, now, for_a_cap=preemptor in for_caps
            )

    def _start(
        self, job: BookedJob, cluster: str, zone: str, pods: tuple[Pod, ...], now: float
    ) -> None:
        for pod in pods:
            node = self.nodes.get(pod.node)
            if node is None or node.cluster != cluster or node.zone != zone:
                raise PlanConflict(f"workload {job.wid}: node {pod.node!r} is not in {zone}")
            if node.gpu_type != job.gpu_type:
                raise PlanConflict(f"workload {job.wid}: node {pod.node!r} has no {job.gpu_type}")
            free = self.free[pod.node]
            taken = set(pod.gpus)
            if not taken <= free or len(taken) != len(pod.gpus):
                raise PlanConflict(f"workload {job.wid}: GPUs {pod.gpus} are not all free")
            free -= taken
            self.nodes[pod.node] = _with_free(node, tuple(g for g in node.free if g not in taken))
            self.free_by_type[node.gpu_type] -= len(taken)
        gpus = sum(len(p.gpus) for p in pods)
        if gpus != job.trace.num_gpus:
            raise PlanConflict(f"workload {job.wid} asked for {job.trace.num_gpus}, got {gpus}")
        self.running[job.wid] = Running(
            id=job.wid,
            project=job.project,
            user=job.trace.job_id,
            kind=job.trace.kind,
            gpu_type=job.gpu_type,
            cluster=cluster,
            zone=zone,
            pods=pods,
            priority=job.priority,
            preemptible=PREEMPTIBLE_CLASSES[job.priority],
            started_at=now,
            # A job resumes from its checkpoint; a session has no snapshot until it stops.
            last_progress_at=now if job.trace.kind == "job" else None,
            preemptions=job.preemptions,
            checkpoint_interval_s=self.options.checkpoint_interval_s
            if job.trace.kind == "job"
            else None,
            created_at=job.trace.submit_s,
        )
        self._hold(job.project, job.gpu_type, gpus)
        self.admissions += 1
        self._push(now + job.remaining, FINISH, job.wid, job.attempt)
        self._maybe_fault(job, now, FAULT)
        if self.policy.mode is Mode.GPUFLEET:
            # Only gpufleet preempts, so only it reads checkpoints and needs waking up
            # when a workload becomes preemptible.
            interval = self.options.checkpoint_interval_s
            if job.trace.kind == "job" and interval < job.remaining:
                self._push(now + interval, CHECKPOINT, job.wid, job.attempt)
            if self.policy.min_run_time_s > 0:
                self._push(now + self.policy.min_run_time_s, WAKE, job.wid, job.attempt)

    def _hold(self, project: str, gpu_type: str, gpus: int) -> None:
        self.held += gpus
        self.held_by_project[project] += gpus
        self.held_by_type[gpu_type] += gpus
        self.ceiling.add(project, gpu_type, gpus)
        self.changed.add(project)
        self.measures_stale = True

    # --------------------------------------------------------------- the events
    def _release(
        self, job: BookedJob, now: float, preempted: bool, faulted: bool = False
    ) -> Running:
        running = self.running.pop(job.wid)
        for pod in running.pods:
            free = self.free[pod.node]
            free.update(pod.gpus)
            node = self.nodes[pod.node]
            self.nodes[pod.node] = _with_free(
                node, tuple(g for g in self.all_gpus[pod.node] if g in free)
            )
            self.free_by_type[node.gpu_type] += len(pod.gpus)
        self._hold(job.project, job.gpu_type, -running.gpus)
        job.runs.append(
            Run(
                start_s=running.started_at,
                end_s=now,
                cluster=running.cluster,
                zone=running.zone,
                nodes=tuple(dict.fromkeys(p.node for p in running.pods)),
                gpus=tuple(g for p in running.pods for g in p.gpus),
                preempted=preempted,
                faulted=faulted,
            )
        )
        job.attempt += 1
        job.stop_began = None
        return running

    def _finish(self, job: BookedJob, now: float) -> None:
        self._release(job, now, preempted=False)
        job.remaining = 0.0
        job.end = now

    def _checkpoint(self, job: BookedJob, now: float) -> None:
        running = self.running[job.wid]
        self.running[job.wid] = _checkpointed(running, now)
        next_at = now + self.options.checkpoint_interval_s
        if next_at < running.started_at + job.remaining:
            self._push(next_at, CHECKPOINT, job.wid, job.attempt)

    def _stopped(self, job: BookedJob, now: float) -> None:
        if job.fault_at is not None:  # struck while stopping for a preemption: a fault
            self._fault_detected(job, now, REPAIRED)
            return
        stop_began = job.stop_began if job.stop_began is not None else now
        running = self._release(job, now, preempted=True)
        if job.trace.kind == "session":
            done = stop_began - running.started_at  # the snapshot keeps everything
        else:
            # Checkpoints fall every interval from the start; the job is still short of
            # its end (it would have finished first), so the last one is short of it too.
            interval = self.options.checkpoint_interval_s
            done = math.floor((now - running.started_at) / interval) * interval
            job.lost_gpu_s += running.gpus * (now - running.started_at - done)
        job.remaining -= done
        job.preemptions += 1
        stopped_for = () if running.stopping_for is None else (running.stopping_for,)
        job.pending = replace(
            job.pending,
            preempted_by=job.pending.preempted_by.union(stopped_for),
            recovering=False,
        )
        self._enqueue(job)

    # ----------------------------------------------------------------- results
    def records(self) -> list[JobRecord]:
        waiting = {w.workload_id: w for w in self.last_plan.waiting}
        records = []
        for job in self.jobs.values():
            reason = job.gave_up
            if job.wid in self.queue:
                # Never-fitting jobs were never queued (``_shape``): this one could start.
                why = waiting.get(job.wid)
                reason = f"{why.cause}: {why.reason}" if why is not None else "not planned"
            records.append(job.record(reason))
        return records


@contextmanager
def _rare_full_collections() -> Iterator[None]:
    """A replay keeps its whole history alive while each cycle's plan allocates anew; the
    plans' short-lived objects that outlive a young collection made Python run a full
    collection every hundred cycles or so, over an ever larger heap, finding nothing (the
    core leaves no reference cycles): a fifth of the replay. Rare for its duration."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, 1000))
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)


def simulate(
    jobs: Sequence[TraceJob],
    nodes: Sequence[FleetNode],
    projects: ProjectTree,
    policy: Mode | str = Mode.GPUFLEET,
    options: SimulationOptions | None = None,
    *,
    planner: Planner | None = None,
) -> SimulationResult:
    """Replay ``jobs`` on ``nodes`` under ``projects`` and ``policy``; see the module doc.

    Raises InputError naming the job for a trace line that cannot be used as written (an
    unknown priority class, ``num_gpus`` not a multiple of ``gpus_per_pod``); a job that
    could never fit the fleet is reported in ``never_fits`` instead. ``planner`` replaces
    the scheduling core (tests script decisions with it).
    """
    options = options or SimulationOptions()
    try:
        mode = Mode(policy)
    except ValueError:
        raise InputError(
            f"policy must be one of {', '.join(m.value for m in Mode)}, not {policy!r}"
        ) from None
    if mode is Mode.GPUFLEET:
        check_checkpoints(jobs, options.checkpoint_interval_s)
    tree = with_trace_groups(projects, jobs)
    fleet = FleetRoom(nodes)
    limits = QuotaLimits(tree)
    shaped: list[BookedJob] = []
    never_fits: list[NeverFits] = []
    for wid, job in enumerate(jobs, start=1):
        outcome = shape(wid, job, fleet, limits, mode)
        if isinstance(outcome, NeverFits):
            never_fits.append(outcome)
        else:
            shaped.append(outcome)
    replay = _Replay(
        shaped,
        nodes,
        tree,
        Policy(
            mode=mode,
            min_run_time_s=options.min_run_time_s,
            max_preemption_searches=options.max_preemption_searches,
            spares=(("*", options.spare_nodes_per_zone),) if options.spare_nodes_per_zone else (),
        ),
        options,
        planner or partial(plan, memo=PlanMemo()),
    )
    with _rare_full_collections():
        totals = replay.run()
    records = replay.records()
    decisions = tuple(replay.decisions)
    return SimulationResult(
        policy=mode,
        records=tuple(records),
        never_fits=tuple(never_fits),
        allocation={p: tuple(s) for p, s in sorted(replay.allocation.items())},
        summary=summarise(records, never_fits, replay.capacity, totals, decisions),
        capacity=fleet.gpus_by_type,
        options=asdict(options),
        preemption_decisions=decisions,
    )
