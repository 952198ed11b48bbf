"""The trace's jobs as the replay books them (``simulator.py``): which queue entry each
becomes (``shape``), or why it can never fit the fleet, even empty (``NeverFits``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from .errors import InputError
from .inputs import TraceJob
from .model import FleetNode, Project, ProjectTree
from .quota import QuotaLimits
from .simulator_measures import beyond_limits
from .simulator_report import JobRecord, NeverFits, Run
from .snapshot import Mode, Pending

# Priority classes, higher rank first. The projects file names classes but carries no
# ranks today, so the simulator uses these.
PRIORITY_RANKS: Mapping[str, int] = {"critical": 300, "standard": 200, "opportunistic": 100}
# Whether a class may be preempted inside its project for a higher class.
PREEMPTIBLE_CLASSES: Mapping[str, bool] = {
    "critical": False,
    "standard": False,
    "opportunistic": True,
}


class BookedJob:
    """The replay's book on one trace job (mutable; never handed to the core)."""

    __slots__ = (
        "attempt",
        "end",
        "evicted_beyond_need_gpus",
        "evicted_gpus",
        "fault_at",
        "fault_lost_gpu_s",
        "fault_times",
        "faults",
        "gave_up",
        "gpu_type",
        "gpus_per_pod",
        "lost_gpu_s",
        "pending",
        "pods",
        "preemptions",
        "preemptor_of",
        "priority",
        "project",
        "remaining",
        "runs",
        "stop_began",
        "trace",
        "wid",
    )

    def __init__(
        self, wid: int, trace: TraceJob, project: str, priority: str, gpu_type: str, pods: int
    ):
        self.wid = wid
        self.trace = trace
        self.project = project
        self.priority = priority
        self.gpu_type = gpu_type
        self.pods = pods
        self.gpus_per_pod = trace.num_gpus // pods
        self.remaining = trace.duration_s
        self.attempt = 0  # bumped whenever a run ends, so stale events are recognised
        self.runs: list[Run] = []
        self.preemptions = 0
        self.preemptor_of = 0  # preemption decisions made for it
        self.evicted_gpus = 0  # GPUs those decisions evicted
        self.evicted_beyond_need_gpus = 0
        self.lost_gpu_s = 0.0
        self.faults = 0
        self.fault_lost_gpu_s = 0.0
        self.fault_at: float | None = None  # struck, not yet detected
        self.fault_times: list[float] = []  # when each was detected
        self.gave_up: str | None = None  # why its faults ended it
        self.end: float | None = None
        self.stop_began: float | None = None
        self.pending = Pending(
            id=wid,
            project=project,
            user=trace.job_id,
            kind=trace.kind,
            gpu_type=gpu_type,
            gpus_per_pod=self.gpus_per_pod,
            pods=pods,
            priority=priority,
            created_at=trace.submit_s,
        )

    def record(self, waiting_reason: str | None) -> JobRecord:
        """What the report says of the job: its runs, the last one's place, what it lost."""
        last = self.runs[-1] if self.runs else None
        return JobRecord(
            job_id=self.trace.job_id,
            project=self.project,
            kind=self.trace.kind,
            priority=self.priority,
            gpu_type=self.gpu_type,
            num_gpus=self.trace.num_gpus,
            submit_s=self.trace.submit_s,
            start_s=self.runs[0].start_s if self.runs else None,
            end_s=self.end,
            cluster=last.cluster if last else None,
            zone=last.zone if last else None,
            nodes=last.nodes if last else (),
            preemptions=self.preemptions,
            lost_gpu_s=self.lost_gpu_s,
            faults=self.faults,
            fault_lost_gpu_s=self.fault_lost_gpu_s,
            duration_s=self.trace.duration_s,
            runs=tuple(self.runs),
            waiting_reason=waiting_reason,
            preemptor_of=self.preemptor_of,
            evicted_gpus=self.evicted_gpus,
            evicted_beyond_need_gpus=self.evicted_beyond_need_gpus,
        )


class FleetRoom:
    """What the fleet could ever hold, per GPU type (for shaping and never-fits)."""

    def __init__(self, nodes: Sequence[FleetNode]):
        self.zone_nodes: dict[str, dict[tuple[str, str], list[int]]] = defaultdict(
            lambda: defaultdict(list)
        )
        gpus_by_type: Counter[str] = Counter()
        for node in nodes:
            self.zone_nodes[node.gpu_type][(node.cluster, node.zone)].append(node.gpus)
            gpus_by_type[node.gpu_type] += node.gpus
        self.gpus_by_type = dict(sorted(gpus_by_type.items()))
        # The most common type by GPUs; ties go to the first name.
        self.default_type = min(gpus_by_type, key=lambda t: (-gpus_by_type[t], t), default=None)
        self._room: dict[tuple[str, int], int] = {}
        self.largest_node = {t: max(max(s) for s in z.values()) for t, z in self.zone_nodes.items()}

    def pods_in_largest_zone(self, gpu_type: str, per_pod: int) -> int:
        key = (gpu_type, per_pod)
        room = self._room.get(key)
        if room is None:
            zones = self.zone_nodes[gpu_type].values()
            room = self._room[key] = max(sum(size // per_pod for size in s) for s in zones)
        return room


# The replay steps through every checkpoint of every job (a few microseconds each):
# more than this many would keep it busy for minutes (one 1e10 s job at the default
# interval: 5.6e6, some 25 s).
MAX_CHECKPOINTS = 10**7


def check_checkpoints(jobs: Sequence[TraceJob], interval_s: float) -> None:
    """Refuse a trace whose jobs would checkpoint more than ``MAX_CHECKPOINTS`` times."""
    checkpoints = sum(j.duration_s for j in jobs if j.kind == "job") / interval_s
    if checkpoints > MAX_CHECKPOINTS:
        raise InputError(
            f"the trace's jobs run long enough for {checkpoints:,.0f} checkpoints at one "
            f"every {interval_s:g} s, and the replay steps through each: at most "
            f"{MAX_CHECKPOINTS:,}; checkpoint less often (checkpoint_interval_s, "
            "--checkpoint-interval) or shorten the jobs"
        )


class TraceJobError(InputError):
    """A trace job that cannot be used as written; ``job_id`` names it, so whoever read
    the file can point at its line."""

    def __init__(self, job_id: str, message: str):
        super().__init__(f"job {job_id!r}: {message}")
        self.job_id = job_id


def _job_error(job: TraceJob, message: str) -> TraceJobError:
    return TraceJobError(job.job_id, message)


def shape(
    wid: int, job: TraceJob, fleet: FleetRoom, limits: QuotaLimits, mode: Mode
) -> BookedJob | NeverFits:
    """The queue entry a trace job becomes, or why it can never fit, even on an empty
    fleet: a GPU type the fleet lacks, a gang no zone holds, more than its project or a
    user may ever hold under ``mode``. Raises InputError for a line that cannot be used as
    written (the error names the job)."""
    tree = limits.tree
    project = tree.projects[job.group]
    priority = job.priority or project.default_priority
    if priority not in PRIORITY_RANKS:
        source = "its priority" if job.priority else f"project {project.name!r}'s default"
        raise _job_error(job, f"{source} {priority!r} is not one of {', '.join(PRIORITY_RANKS)}")
    if project.allowed_priorities and priority not in project.allowed_priorities:
        raise _job_error(job, f"project {project.name!r} does not allow priority {priority!r}")
    if job.gpus_per_pod is not None and job.num_gpus % job.gpus_per_pod:
        raise _job_error(
            job, f"num_gpus {job.num_gpus} is not a multiple of gpus_per_pod {job.gpus_per_pod}"
        )
    gpu_type = job.gpu_type or fleet.default_type
    if gpu_type is None or gpu_type not in fleet.zone_nodes:
        known = ", ".join(fleet.gpus_by_type) or "none"
        return NeverFits(job.job_id, f"no node has GPU type {gpu_type!r} (the fleet has {known})")
    largest = fleet.largest_node[gpu_type]
    if job.gpus_per_pod is not None:
        per_pod = job.gpus_per_pod
    elif job.num_gpus <= largest:
        per_pod = job.num_gpus
    elif job.num_gpus % largest:
        return NeverFits(
            job.job_id,
            f"{job.num_gpus} {gpu_type} GPUs do not divide into whole {largest}-GPU nodes; "
            "give gpus_per_pod",
        )
    else:
        per_pod = largest
    pods = job.num_gpus // per_pod
    room = fleet.pods_in_largest_zone(gpu_type, per_pod)
    if room < pods:
        return NeverFits(
            job.job_id,
            f"needs {pods} pod(s) of {per_pod} {gpu_type} GPUs in one zone; "
            f"the largest zone holds {room}",
        )
    beyond = beyond_limits(limits, mode, project.name, gpu_type, job.num_gpus)
    if beyond is not None:
        return NeverFits(job.job_id, beyond)
    return BookedJob(wid, job, project.name, priority, gpu_type, pods)


def with_trace_groups(projects: ProjectTree, jobs: Iterable[TraceJob]) -> ProjectTree:
    missing = sorted({j.group for j in jobs} - set(projects.projects))
    if not missing:
        return projects
    added = {g: Project(name=g, default_priority="opportunistic") for g in missing}
    return ProjectTree({**projects.projects, **added})
