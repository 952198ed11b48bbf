"""What the scheduling core reads and returns: plain, frozen values and nothing else.

``plan(snapshot, now) -> Plan`` (``scheduler/plan.py``) reads a ``SchedulingSnapshot``:
the schedulable nodes with their free GPUs, the running workloads with where they run,
the queue, the project tree and the policy. It returns a ``Plan``: admissions with a
placement for every pod, preemptions with the workload they make room for, and for every
workload left waiting its position and a reason a person can act on.

Times are seconds since the epoch (floats): the controller passes wall-clock time, the
simulator its virtual clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from .model import ProjectTree


@dataclass(frozen=True)
class NodeState:
    """The GPUs of one type on one node (a node with MIG slices of several profiles appears
    once per profile, each its own GPU type such as ``A100-80GB:3g.40gb``)."""

    name: str
    cluster: str
    zone: str
    gpu_type: str
    total: int  # usable GPUs: present, not lost
    free: tuple[str, ...]  # ids of the free ones, in device order
    schedulable: bool = True  # false when cordoned, unhealthy or its heartbeat is lost
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Pod:
    node: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Running:
    """A workload holding GPUs: admitted, running, or stopping (GPUs held until it is gone)."""

    id: int
    project: str
    user: str
    kind: str  # "session" or "job"
    gpu_type: str
    cluster: str
    zone: str
    pods: tuple[Pod, ...]
    priority: str = "standard"
    preemptible: bool = True
    started_at: float = 0.0
    # The last checkpoint (job) or snapshot (session): what a stop would not lose.
    last_progress_at: float | None = None
    # Marked idle by the culler and its project's idle policy lets anyone reclaim it.
    idle_reclaimable: bool = False
    stopping: bool = False
    # The waiting workload a preemption stops it for; its GPUs are promised to that one.
    stopping_for: int | None = None
    # How often this workload was preempted before this run, and how often it checkpoints
    # (None: unknown, or a session): after a preemption a workload is protected for
    # longer (``protected_until``), so that nobody loses all of their work over and over.
    preemptions: int = 0
    checkpoint_interval_s: float | None = None
    # When its request was queued (the first time, across preemptions; None: unknown):
    # work that started while an earlier request of its project waited for the
    # project's quota ran as that request's backfill (``PreemptionCause.BACKFILL``).
    created_at: float | None = None

    @cached_property
    def gpus(self) -> int:
        return sum(len(p.gpus) for p in self.pods)


@dataclass(frozen=True)
class Pending:
    """A workload in the queue: ``pods`` × ``gpus_per_pod`` GPUs of one type, all in one
    cluster and zone, or none of them."""

    id: int
    project: str
    user: str
    kind: str
    gpu_type: str
    gpus_per_pod: int
    pods: int = 1
    priority: str = "standard"
    created_at: float = 0.0
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # The placement kept for it since workloads were preempted for it (``Plan.kept``): its
    # victims' GPUs and the free ones it counted on. Producers keep it from the plan until
    # the workload is admitted; the core admits it there as soon as all of it is free.
    promised: tuple[Pod, ...] = ()
    # The workloads it was stopped for: it never stops one of them in turn for its class
    # (``VictimIndex.cause``; only a guarantee reclaims from them), so that two workloads
    # whose borrowing changes with their projects' admissions do not evict each other
    # back and forth.
    preempted_by: frozenset[int] = frozenset()
    # Nodes and GPUs it must not land on: a job's next attempt after a fault blamed them
    # (recovery/attempts.py), until they pass maintenance (state/maintenance.py). Like a
    # node selector, they make the request particular.
    avoid_nodes: frozenset[str] = frozenset()
    avoid_gpus: frozenset[str] = frozenset()
    # A job's next attempt after a fault (not after a preemption or a drain): it may use
    # the recovery spares (``spares.py``).
    recovering: bool = False
    # The zone held for it at the end of the last cycle (``Plan.held``), handed back by
    # the producer: the hold stays there unless another zone becomes clearly closer to
    # holding it (``HeldZones._zone_to_hold``), so the GPUs drained for it are not given
    # up whenever borrowing moves between workloads.
    held_zone: tuple[str, str] | None = None

    @cached_property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod

    @cached_property
    def particular(self) -> bool:
        """Only some nodes or GPUs will do: it takes the slow path (``place_selected``),
        neither holds a zone nor preempts, and no refusal of another request stands for
        it (its chances are its own)."""
        return bool(self.node_selector or self.avoid_nodes or self.avoid_gpus)

    @cached_property
    def shape(self) -> tuple[str, str, int, int, str]:
        """What a decision on it depends on besides the state of the fleet (its user aside,
        under a per-user cap): identical shapes get identical refusals in one cycle."""
        return (self.project, self.gpu_type, self.gpus_per_pod, self.pods, self.priority)


class Mode(enum.StrEnum):
    """What the core enforces: gpufleet's full policy, or the simulator's baselines."""

    GPUFLEET = "gpufleet"  # guarantees, borrowing, fair share, priorities, preemption
    STATIC = "static"  # guarantees only: no borrowing, no preemption
    FIFO = "fifo"  # no quotas: arrival order, no preemption


@dataclass(frozen=True)
class Policy:
    mode: Mode = Mode.GPUFLEET
    # A workload that started less than this long ago is not preempted (idle ones aside,
    # which have been idle longer than that anyway).
    min_run_time_s: float = 300.0
    # Preemption searches per cycle; later candidates try again next cycle. Bounds the
    # cycle's time when thousands of requests could each ask for room.
    max_preemption_searches: int = 64
    # Recovery spares: (``cluster/zone``, ``zone`` or ``*``, spare nodes per GPU type of
    # each zone it names), most specific first (``spares.py``). Only the gpufleet mode.
    spares: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Changes:
    """What a producer changed in ``running`` and ``queue`` since its previous snapshot: a
    hint that lets ``memo.PlanMemo`` follow a stream of snapshots in the time the changes
    take, not the time the queue takes to read. By workload id, the new value, or None
    for one that is gone. It applies only to the snapshot numbered ``serial`` of the
    stream ``stream`` (any object, compared by identity) right after the one numbered
    ``serial - 1``; a memo that saw anything else reads the snapshot whole. The producer
    must list every change (``tracked.TrackedMap`` records them): the plan is then the
    same as without the hint."""

    stream: object
    serial: int
    running: Mapping[int, Running | None]
    queue: Mapping[int, Pending | None]


@dataclass(frozen=True)
class SchedulingSnapshot:
    nodes: tuple[NodeState, ...]
    running: tuple[Running, ...]
    queue: tuple[Pending, ...]
    projects: ProjectTree
    # Priority class name -> rank, higher first; a class not named here ranks 0.
    priorities: Mapping[str, int] = field(default_factory=dict)
    # Class name -> whether its workloads may be preempted inside their project.
    preemptible: Mapping[str, bool] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)
    changes: Changes | None = field(default=None, compare=False, repr=False)


class WaitCause(enum.StrEnum):
    """Why a workload waits; a metric label and the key of the reason's wording."""

    QUOTA = "quota"  # its project (or an enclosing team) is at its limit
    USER_CAP = "user-cap"  # the user is at the project's per-user cap
    CAPACITY = "capacity"  # no zone has room, and nothing may be preempted for it
    RESERVED = "reserved"  # first in line for its GPU type: a zone is held for it
    BEHIND = "behind"  # an earlier request of its project holds its place
    PREEMPTING = "preempting"  # victims are stopping to make room for it
    NEVER_FITS = "never-fits"  # larger than any zone of the fleet could ever hold


class PreemptionCause(enum.StrEnum):
    IDLE = "idle-reclaim"  # an idle session, reclaimed by whoever needs its GPUs
    GUARANTEE = "guarantee-reclaim"  # a borrower, reclaimed for a project within guarantee
    PRIORITY = "priority"  # a lower class of the same project
    BORROWER_PRIORITY = "borrower-priority"  # a lower-class borrower, for a higher-class one
    # A borrower that started while an earlier request of its project (ahead of it in the
    # queue) waited for the project's quota, for that request once it can start.
    BACKFILL = "backfill"
    # Preemptible work lent a recovery spare, taken back for a job restarting after a
    # fault (``spares.py``).
    SPARE = "spare-reclaim"


@dataclass(frozen=True)
class Admission:
    workload_id: int
    cluster: str
    zone: str
    pods: tuple[Pod, ...]
    borrowed: int = 0  # GPUs above the project's guarantee: reclaimable when it needs them


@dataclass(frozen=True)
class Preemption:
    victim_id: int
    for_workload_id: int
    cause: PreemptionCause
    reason: str


class Waiting(NamedTuple):
    # A named tuple, not a frozen dataclass: a plan makes one for every waiting workload,
    # 10,000 a cycle at scale, and a tuple is built several times faster.
    workload_id: int
    # 1-based, in its project's queue for its GPU type, in the order they would start.
    # Not a place in the whole fleet's queue: with fair sharing that one changes with every
    # admission anywhere, while this one moves only when the project's own work does.
    position: int
    cause: WaitCause
    reason: str


@dataclass(frozen=True)
class Kept:
    """The placement kept for a workload whose victims are stopping: their GPUs and the
    free ones it counted on, which no other workload may take meanwhile. The producer
    hands it back as ``Pending.promised`` until the workload is admitted."""

    workload_id: int
    pods: tuple[Pod, ...]


@dataclass(frozen=True)
class Plan:
    admissions: tuple[Admission, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    # A tuple, or from ``plan`` a ``waits.Waits``: equal to the tuple of its rows, which
    # it builds only when read.
    waiting: Sequence[Waiting] = ()
    kept: tuple[Kept, ...] = ()
    # The zones held at the end of the cycle: (cluster, zone, GPU type) -> the workload
    # it is kept for (docs/scheduler.md, "Held zones"). What the waiting reasons already
    # say, for measures: not one of the plan's decisions, so plans compare without it.
    held: Mapping[tuple[str, str, str], int] = field(default_factory=dict, compare=False)
    # The recovery spares set aside this cycle: (cluster, zone, GPU type) -> node names.
    spares: Mapping[tuple[str, str, str], tuple[str, ...]] = field(
        default_factory=dict, compare=False
    )
