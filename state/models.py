"""SQLAlchemy 2 models of the fleet: the controller's single state of the world.

Invariants the schema itself enforces:
- an allocation is never edited in place: it is opened once and closed once (``closed_at``),
  so GPU-hours per project and user can always be reported from this table;
- a GPU has at most one open allocation (a partial unique index on ``gpu_uuid`` where
  ``closed_at`` is null), so no bug above this layer can hand a GPU out twice;
- events are append-only.

Every change to these tables comes with an Alembic revision in ``migrations/versions``.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    Unicode,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps stored as naive UTC (SQLite has no time zones) and read back as aware UTC."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware UTC datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[str]: JSON}


class ProjectKind(enum.StrEnum):
    organisation = "organisation"
    team = "team"
    project = "project"


class WorkloadKind(enum.StrEnum):
    session = "session"
    job = "job"


# How an ended workload ended (``Workload.outcome``), as docs/api.md lists them.
WORKLOAD_OUTCOMES = (
    "stopped",
    "withdrawn",
    "expired",
    "failed",
    "preempted",
    "superseded",
    "succeeded",
    "cancelled",
)


class WorkloadState(enum.StrEnum):
    """Where a workload is in its life. GPUs are held from ``admitted`` until ``ended``."""

    pending = "pending"  # waiting in the queue; holds nothing
    admitted = "admitted"  # GPUs allocated; the backend is starting it
    running = "running"  # the backend reported it up
    stopping = "stopping"  # stop decided; GPUs held until its processes are observed gone
    ended = "ended"  # terminal; every allocation is closed


class NodeHealth(enum.StrEnum):
    ok = "ok"
    degraded = "degraded"
    unhealthy = "unhealthy"
    unknown = "unknown"  # heartbeat lost: receives no new work


def _enum(cls: type[enum.Enum]) -> Enum:
    # Stored as plain strings (no native enum type) so a new member needs no ALTER TYPE.
    return Enum(cls, native_enum=False, length=32, validate_strings=True)


class Project(Base):
    """A node of the project tree: organisation → team → project.

    Any node may carry quotas (per GPU type); quotas of inner nodes cap their subtree.
    Members come from the JupyterHub group named ``hub_group``.
    """

    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    display_name: Mapped[str] = mapped_column(String(200), default="")
    kind: Mapped[ProjectKind] = mapped_column(_enum(ProjectKind), default=ProjectKind.project)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    hub_group: Mapped[str | None] = mapped_column(String(255), default=None)
    default_priority: Mapped[str] = mapped_column(String(32), default="standard")
    allowed_priorities: Mapped[list[str]] = mapped_column(default=list)
    fair_share_weight: Mapped[float] = mapped_column(Float, default=1.0)
    per_user_gpu_cap: Mapped[int | None] = mapped_column(Integer, default=None)
    # Set when an admin changed the weight, default priority or per-user cap in the admin
    # panel: from then on the config file no longer overwrites them (docs/admin.md).
    edited_by: Mapped[str | None] = mapped_column(String(255), default=None)
    edited_at: Mapped[datetime | None] = mapped_column(default=None)

    parent: Mapped[Project | None] = relationship(remote_side=[id])
    quotas: Mapped[list[ProjectQuota]] = relationship(
        back_populates="project", cascade="all, delete-orphan"
    )
    members: Mapped[list[Membership]] = relationship(
        back_populates="project", cascade="all, delete-orphan"
    )


class ProjectQuota(Base):
    """Per GPU type: a guaranteed amount, how much more may be borrowed, how much may be lent.

    ``None`` for borrow or lend limit means "no limit".
    """

    __tablename__ = "project_quotas"
    __table_args__ = (UniqueConstraint("project_id", "gpu_type"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    gpu_type: Mapped[str] = mapped_column(String(64))
    guaranteed: Mapped[int] = mapped_column(Integer, default=0)
    borrow_limit: Mapped[int | None] = mapped_column(Integer, default=None)
    lend_limit: Mapped[int | None] = mapped_column(Integer, default=None)
    # As Project.edited_*: an admin's edit in the panel wins over the config file.
    edited_by: Mapped[str | None] = mapped_column(String(255), default=None)
    edited_at: Mapped[datetime | None] = mapped_column(default=None)

    project: Mapped[Project] = relationship(back_populates="quotas")


class Membership(Base):
    """A user's membership of a project, synced from the project's JupyterHub group."""

    __tablename__ = "memberships"
    __table_args__ = (UniqueConstraint("project_id", "username"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    username: Mapped[str] = mapped_column(String(255), index=True)
    source: Mapped[str] = mapped_column(String(32), default="hub-group")

    project: Mapped[Project] = relationship(back_populates="members")


class PriorityClass(Base):
    """Orders work inside a project (higher ``rank`` first); preemptibility is set apart."""

    __tablename__ = "priority_classes"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    preemptible_by_default: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str] = mapped_column(String(200), default="")


class Profile(Base):
    """What a researcher picks on the spawn page: an environment and its GPU options."""

    __tablename__ = "profiles"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    display_name: Mapped[str] = mapped_column(String(200), default="")
    description: Mapped[str] = mapped_column(Text, default="")
    environment: Mapped[str] = mapped_column(String(500), default="")
    cpu_per_gpu: Mapped[float] = mapped_column(Float, default=4.0)
    memory_per_gpu_bytes: Mapped[int] = mapped_column(BigInteger, default=32 * 2**30)
    allowed_gpu_types: Mapped[list[str]] = mapped_column(default=list)  # empty: any
    allowed_projects: Mapped[list[str]] = mapped_column(default=list)  # empty: any
    is_default: Mapped[bool] = mapped_column(Boolean, default=False)


class Cluster(Base):
    __tablename__ = "clusters"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    backend: Mapped[str] = mapped_column(String(32), default="local")
    kube_context: Mapped[str | None] = mapped_column(String(255), default=None)
    # A Kubernetes cluster whose API server does not answer: its nodes are unknown (no new
    # work) until it answers again. ``status_message`` says what failed, since when.
    reachable: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    status_message: Mapped[str] = mapped_column(Text, default="", server_default="")
    status_since: Mapped[datetime | None] = mapped_column(default=None)
    # The recovery loop's breaker on automated cordons opened then (recovery/breaker.py):
    # it cordons no node of this cluster until an admin resets it (None: closed).
    breaker_tripped_at: Mapped[datetime | None] = mapped_column(default=None)

    zones: Mapped[list[Zone]] = relationship(back_populates="cluster")


class Zone(Base):
    __tablename__ = "zones"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"))
    name: Mapped[str] = mapped_column(String(64))

    cluster: Mapped[Cluster] = relationship(back_populates="zones")
    nodes: Mapped[list[Node]] = relationship(back_populates="zone")


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    zone_id: Mapped[int] = mapped_column(ForeignKey("zones.id"))
    gpu_type: Mapped[str] = mapped_column(String(64))
    cpus: Mapped[float] = mapped_column(Float, default=0.0)
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    health: Mapped[NodeHealth] = mapped_column(_enum(NodeHealth), default=NodeHealth.unknown)
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    # When the recovery loop cordoned it (None: it did not, or the node was uncordoned).
    recovery_cordoned_at: Mapped[datetime | None] = mapped_column(default=None)
    # recycle or diagnose while due (once the node is empty); recycling or diagnosing
    # while its agent runs it; who asked (``recovery`` or an admin).
    maintenance: Mapped[str | None] = mapped_column(String(32), default=None)
    maintenance_by: Mapped[str | None] = mapped_column(String(255), default=None)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    agent: Mapped[str | None] = mapped_column(String(255), default=None)

    zone: Mapped[Zone] = relationship(back_populates="nodes")
    gpus: Mapped[list[Gpu]] = relationship(back_populates="node", order_by="Gpu.index")


class Gpu(Base):
    """One schedulable device: a whole GPU or a MIG slice (its ``gpu_type`` says which)."""

    __tablename__ = "gpus"

    uuid: Mapped[str] = mapped_column(String(96), primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str] = mapped_column(String(64))
    pci_bus_id: Mapped[str] = mapped_column(String(32), default="")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    present: Mapped[bool] = mapped_column(Boolean, default=True)
    # NVML says the GPU fell off the bus: it receives no new work until it is back.
    lost: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The recovery loop blamed it for a fault: no new work until its node is uncordoned.
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # On the lemon list (repeated hardware faults): cordoned until an admin clears it,
    # whatever happens to its node.
    lemon: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Held for what may be left of a job pod whose node agent went silent (the pod's
    # process marker, ``<marker>.<pod>``): no new work until an agent of its node reports
    # that no process carries it. The allocation itself is closed when the attempt ends.
    leftover_marker: Mapped[str | None] = mapped_column(String(80), default=None)
    leftover_workload_id: Mapped[int | None] = mapped_column(Integer, default=None)
    leftover_since: Mapped[datetime | None] = mapped_column(default=None)
    # Maintenance the recovery loop wants for it (``state/maintenance.py``): reset,
    # reset-at-idle or diagnose while due; resetting or diagnosing while the agent runs it.
    maintenance: Mapped[str | None] = mapped_column(String(32), default=None)
    sampled_at: Mapped[datetime | None] = mapped_column(default=None)
    # The latest sample as the node agent sent it (utilisation, memory, ECC, processes...).
    last_sample: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}")
    # The latest sample that showed it working (utilisation at or over the busy threshold):
    # the culler's "its GPUs did work" signal.
    busy_at: Mapped[datetime | None] = mapped_column(default=None)

    node: Mapped[Node] = relationship(back_populates="gpus")


class Workload(Base):
    """A session or a training job: ``pods`` × ``gpus_per_pod`` GPUs of one type."""

    __tablename__ = "workloads"
    __table_args__ = (Index("ix_workloads_state_created", "state", "created_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[WorkloadKind] = mapped_column(_enum(WorkloadKind))
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"))
    username: Mapped[str] = mapped_column(String(255), index=True)
    server_name: Mapped[str] = mapped_column(String(255), default="")
    name: Mapped[str] = mapped_column(String(255), default="")
    profile: Mapped[str | None] = mapped_column(String(64), default=None)
    gpu_type: Mapped[str] = mapped_column(String(64))
    pods: Mapped[int] = mapped_column(Integer, default=1)
    gpus_per_pod: Mapped[int] = mapped_column(Integer)
    priority_class: Mapped[str] = mapped_column(String(32), default="standard")
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[WorkloadState] = mapped_column(
        _enum(WorkloadState), default=WorkloadState.pending
    )
    outcome: Mapped[str | None] = mapped_column(String(32), default=None)
    reason: Mapped[str] = mapped_column(Text, default="")
    queue_position: Mapped[int | None] = mapped_column(Integer, default=None)
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime]
    admitted_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    ended_at: Mapped[datetime | None] = mapped_column(default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    idle_since: Mapped[datetime | None] = mapped_column(default=None)
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(default=None)
    last_snapshot_at: Mapped[datetime | None] = mapped_column(default=None)
    # Set when the scheduler stops this workload to make room: the waiting workload its
    # GPUs are promised to. That one asks for no more victims while this one stops.
    preempted_for_id: Mapped[int | None] = mapped_column(Integer, default=None)
    # For a waiting preemptor: the placement kept for it ({"pods": [[node, [uuid, ...]]]}),
    # its victims' GPUs and the free ones it counted on, until it is admitted.
    promised: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # For a waiting workload: the zone the last cycle held for it (``Plan.held``), read
    # back as ``Pending.held_zone`` so that a restarted controller keeps holding the zone
    # that has been draining for it rather than picking afresh. Cleared once it is admitted.
    held_cluster: Mapped[str | None] = mapped_column(String(255), default=None)
    held_zone: Mapped[str | None] = mapped_column(String(255), default=None)
    # The random marker every process of the workload inherits (recovery/processes.py),
    # sent by the backend with the request, before any process starts: the reconciler
    # tells by it which live processes belong to which workload.
    process_marker: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    # What a snapshot of this session holds, as its spawner reported when it started:
    # {"paths": [...], "prefixes": [...], "overlays": ["upper[:merged]"], "exclude": [...]}.
    snapshot_sources: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # The session stopped but its final snapshot has not committed yet: its GPUs stay
    # allocated (the reconciler leaves it alone) until a retry commits or an admin releases.
    snapshot_pending_since: Mapped[datetime | None] = mapped_column(default=None)
    # A job's launch: {"script", "script_name", "args", "python", "cwd", "env",
    # "checkpoint_uri"} (``state.jobs.JobSpec``); None for a session.
    spec: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # A job runs as attempts (recovery/attempts.py): the one running or waiting now, the
    # infrastructure faults spent so far, and no admission before ``not_before`` (the
    # back-off after a fault).
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    faults: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    not_before: Mapped[datetime | None] = mapped_column(default=None)
    # {"avoid_nodes": [...], "avoid_gpus": [...]} (blamed by earlier faults),
    # "resume_from" (the checkpoint this attempt resumes from), "fault" (the verdict that
    # stops the running attempt, when the recovery loop stopped it), "log_bases" (where
    # each rank stream of this attempt starts in the job's log: {"rank:stream": bytes}).
    recovery: Mapped[dict[str, Any] | None] = mapped_column(default=None)

    project: Mapped[Project] = relationship()
    allocations: Mapped[list[Allocation]] = relationship(back_populates="workload")

    @property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod


class Allocation(Base):
    """One GPU given to one pod of a workload, from ``opened_at`` until ``closed_at``."""

    __tablename__ = "allocations"
    __table_args__ = (
        Index(
            "uq_allocations_open_gpu",
            "gpu_uuid",
            unique=True,
            sqlite_where=text("closed_at IS NULL"),
            postgresql_where=text("closed_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"), index=True)
    gpu_uuid: Mapped[str] = mapped_column(ForeignKey("gpus.uuid"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    pod_index: Mapped[int] = mapped_column(Integer, default=0)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"))
    username: Mapped[str] = mapped_column(String(255))
    gpu_type: Mapped[str] = mapped_column(String(64))
    opened_at: Mapped[datetime]
    closed_at: Mapped[datetime | None] = mapped_column(default=None)

    workload: Mapped[Workload] = relationship(back_populates="allocations")
    gpu: Mapped[Gpu] = relationship()
    node: Mapped[Node] = relationship()


class JobPod(Base):
    """What the node agent last reported of one pod of a job (its process group).

    ``state``: ``running``; ``exited`` (on its own; ``exit_code`` says how); ``stopped``
    (by the agent, on a cancel, a failure elsewhere in the gang or a preemption); or
    ``failed`` (it could not start, or ended with no status to say how: ``reason``). Only
    ``running`` may still hold a process.
    """

    __tablename__ = "job_pods"

    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"), primary_key=True)
    pod_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    exit_code: Mapped[int | None] = mapped_column(Integer, default=None)
    signal: Mapped[int | None] = mapped_column(Integer, default=None)
    reason: Mapped[str] = mapped_column(Text, default="")
    # Why it ended in its backend's own word (Kubernetes' ``OOMKilled``, ``Evicted``,
    # ``NodeLost``...; empty where the words of ``reason`` say it), for the classifier.
    cause: Mapped[str] = mapped_column(String(32), default="", server_default="")
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    ended_at: Mapped[datetime | None] = mapped_column(default=None)


class JobTrace(Base):
    """A request for every rank's Python stacks of one attempt of a job (py-spy, taken by
    the node agent of each pod's node): asked by its owner or an admin, or by the recovery
    loop on a hang, before the gang is stopped. Open until each pod's stacks are in or
    ``expires_at`` passes; a stopping gang with an open trace is held until then."""

    __tablename__ = "job_traces"
    __table_args__ = (Index("ix_job_traces_workload", "workload_id", "attempt"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    why: Mapped[str] = mapped_column(String(16))  # "hang" or "asked"
    asked_by: Mapped[str] = mapped_column(String(255))
    asked_at: Mapped[datetime] = mapped_column()
    expires_at: Mapped[datetime] = mapped_column()
    closed_at: Mapped[datetime | None] = mapped_column(default=None)
    dumps: Mapped[list[JobTraceDump]] = relationship(
        back_populates="trace", order_by="JobTraceDump.pod_index"
    )


class JobTraceDump(Base):
    """One pod's answer to a trace: each of its ranks' stacks as py-spy printed them, or why
    they could not be taken (``ranks``: ``[{rank, pid, where, text, error}]``)."""

    __tablename__ = "job_trace_dumps"

    trace_id: Mapped[int] = mapped_column(ForeignKey("job_traces.id"), primary_key=True)
    pod_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    taken_at: Mapped[datetime] = mapped_column()
    ranks: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    error: Mapped[str] = mapped_column(Text, default="")
    trace: Mapped[JobTrace] = relationship(back_populates="dumps")


class NodeOperation(Base):
    """Heavy work on one node that the node agent there does for a workload: a snapshot
    pass over a Kubernetes session's volumes and container layer, or a restore into its
    volumes before its pod starts (docs/kubernetes.md, "Snapshots").

    The controller and the hub never read a pod's files: they ask, the agent on the node
    claims the operation (``pending`` -> ``running``), reports its progress, and ends it
    ``done`` (with the snapshot command's result) or ``failed`` (with why). An operation
    no agent claims in time is ``failed`` by whoever asked.
    """

    __tablename__ = "node_operations"
    __table_args__ = (Index("ix_node_operations_node_state", "node", "state"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    # None for maintenance (a GPU reset, a node recycle, diagnostics): no workload's.
    workload_id: Mapped[int | None] = mapped_column(ForeignKey("workloads.id"), index=True)
    node: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16))  # snapshot | restore | reset | recycle | diagnose
    # {"project", "username", "server", "paths", "exclude", "container", "tags", "marker"}
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class JobProgress(Base):
    """What a job's ranks last said of their progress (``gpufleet.progress``,
    ``checkpoint_started``, ``checkpoint_saved``), through their node agents: one row per
    job, the pods' reports merged (state/progress.py): the latest report by its time, never
    by its step number (a counter may restart every epoch); every step time, of the most
    recent ``step_times`` kept; the latest metrics; a thinned history of (time, step,
    epoch, loss) for the job page's charts; the last checkpoint and how many were saved."""

    __tablename__ = "job_progress"

    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"), primary_key=True)
    # The step number and epoch of the latest report (None: the job gave none) ...
    last_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    last_epoch: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # ... and when it was made: any ``gpufleet.progress`` call, with or without a number,
    # is a step. The hang rule's clock (recovery/classify.py, ``hang_of``).
    last_step_at: Mapped[datetime | None] = mapped_column(default=None)
    step_times: Mapped[list[float]] = mapped_column(JSON, default=list)  # seconds per step
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # {"every_s": the least spacing of its points, "points": [[unix time, step, epoch,
    # loss], ...]}: at most ``progress.HISTORY_POINTS``, spread over the job's whole life.
    history: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    checkpoint_started_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    checkpoint_started_at: Mapped[datetime | None] = mapped_column(default=None)
    last_checkpoint_uri: Mapped[str] = mapped_column(Text, default="")
    last_checkpoint_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    last_checkpoint_epoch: Mapped[int | None] = mapped_column(BigInteger, default=None)
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(default=None)
    # Checkpoints saved, by attempt: {"1": 12, "2": 3}. A count, not an event each.
    checkpoints_saved: Mapped[dict[str, Any]] = mapped_column(
        JSON, default=dict, server_default="{}"
    )
    updated_at: Mapped[datetime]


class JobLog(Base):
    """A chunk of one rank's stdout or stderr, as the node agent sent it.

    ``offset`` is where the chunk starts in the rank's stream, so a chunk sent twice (an
    agent retrying after a lost answer) is recognised and stored once. A negative rank is
    a pod's launcher (torchrun itself): pod ``p`` logs as rank ``-1 - p``.
    """

    __tablename__ = "job_logs"
    # Also the index every read uses.
    __table_args__ = (UniqueConstraint("workload_id", "rank", "stream", "offset"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"))
    rank: Mapped[int] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    offset: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime]


class Snapshot(Base):
    """An index row for a snapshot whose manifest lives in the snapshot store (the truth)."""

    __tablename__ = "snapshots"

    id: Mapped[int] = mapped_column(primary_key=True)
    username: Mapped[str] = mapped_column(String(255), index=True)
    server_name: Mapped[str] = mapped_column(String(255), default="")
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    workload_id: Mapped[int | None] = mapped_column(ForeignKey("workloads.id"), default=None)
    store_uri: Mapped[str] = mapped_column(String(1000))
    manifest_key: Mapped[str] = mapped_column(String(1000), unique=True)
    created_at: Mapped[datetime]
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    file_count: Mapped[int] = mapped_column(Integer, default=0)


class SessionActivity(Base):
    """What the culler knows of a running session besides the hub's own activity: the
    session extension's latest report, the user's keep-alive, and the notice shown."""

    __tablename__ = "session_activity"

    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"), primary_key=True)
    reported_at: Mapped[datetime | None] = mapped_column(default=None)
    kernels_busy: Mapped[bool] = mapped_column(Boolean, default=False)
    kernels: Mapped[int] = mapped_column(Integer, default=0)
    kernel_activity: Mapped[datetime | None] = mapped_column(default=None)
    terminal_activity: Mapped[datetime | None] = mapped_column(default=None)
    # What its user last did in JupyterLab ("input", "file": culler/policy.USER_ACTIONS).
    user_activity: Mapped[datetime | None] = mapped_column(default=None)
    user_action: Mapped[str] = mapped_column(String(16), default="", server_default="")
    keep_alive_until: Mapped[datetime | None] = mapped_column(default=None)
    warned_at: Mapped[datetime | None] = mapped_column(default=None)
    warned_stop_at: Mapped[datetime | None] = mapped_column(default=None)
    # {"id", "level", "message", "deadline"}: the culler's warning the session shows; a
    # keep-alive or new activity withdraws it.
    notice: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # What the session's start had to say (restored from a snapshot, culled before), in
    # the same shape: shown beside the warning, kept until the session ends, so that a
    # warning never hides it.
    start_notice: Mapped[dict[str, Any] | None] = mapped_column(default=None)


class UserAccount(Base):
    """The Unix identity a hub user's sessions and job ranks run as on every node
    (docs/containment.md). Given once and never changed: a uid handed to one user is
    never handed to another (files the first left behind stay theirs)."""

    __tablename__ = "user_accounts"

    username: Mapped[str] = mapped_column(String(255), primary_key=True)
    uid: Mapped[int] = mapped_column(Integer, unique=True)
    gid: Mapped[int] = mapped_column(Integer)
    # "sandbox": a uid of the controller's range; "system": the node's account of that name.
    mode: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]


class GpuHistoryPoint(Base):
    """One GPU's utilisation and memory at one moment, as a node agent sampled it: the
    history the pages chart. Thinned with age and bounded per GPU
    (``inventory.HISTORY_TIERS``, docs/monitoring.md); never read by the scheduler."""

    __tablename__ = "gpu_history"
    # Also the index every read and every thinning pass uses.
    __table_args__ = (Index("ix_gpu_history_gpu_uuid_at", "gpu_uuid", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_uuid: Mapped[str] = mapped_column(String(96))
    at: Mapped[datetime]
    utilization_pct: Mapped[int | None] = mapped_column(Integer, default=None)
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)


class Event(Base):
    """Append-only log: what happened, why, and what caused it."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(index=True)
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(String(64), default="")
    cause: Mapped[str] = mapped_column(String(255), default="")
    workload_id: Mapped[int | None] = mapped_column(
        ForeignKey("workloads.id"), default=None, index=True
    )
    project: Mapped[str | None] = mapped_column(String(64), default=None)
    username: Mapped[str | None] = mapped_column(String(255), default=None)
    node: Mapped[str | None] = mapped_column(String(255), default=None)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ControllerLease(Base):
    """Who may write. A controller commits only while it holds this row with its epoch."""

    __tablename__ = "controller_lease"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    epoch: Mapped[int] = mapped_column(Integer)
    acquired_at: Mapped[datetime]
    expires_at: Mapped[datetime]


# APScheduler's job store (hub/timed.py): its own table, made by a migration as every
# other; APScheduler reads and writes it with a Table of the same shape.
apscheduler_jobs = Table(
    "apscheduler_jobs",
    Base.metadata,
    Column("id", Unicode(191), primary_key=True),
    Column("next_run_time", Float(25), index=True),
    Column("job_state", LargeBinary, nullable=False),
)
