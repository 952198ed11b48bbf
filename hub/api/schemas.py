"""The REST API's bodies and answers (pydantic, at the boundary only)."""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The largest whole number any body may carry: what SQLite's and PostgreSQL's 64-bit
# integers and JavaScript's numbers all hold exactly. A larger one is refused with a 400.
MAX_INT = 2**53


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionRequestIn(Strict):
    """A spawner asks for GPUs for one user's server."""

    username: str = Field(min_length=1, max_length=255)
    server_name: str = Field(default="", max_length=255)
    project: str = Field(min_length=1, max_length=64)
    gpu_type: str = Field(min_length=1, max_length=64)
    gpus: int | str = Field(description="GPUs on one node; validated with a readable message")
    profile: str | None = Field(default=None, max_length=64)
    process_marker: str | None = Field(
        default=None,
        min_length=8,
        max_length=64,
        pattern=r"^[0-9A-Za-z_-]+$",
        description="The random marker every process of the session will carry "
        "(GPUFLEET_SESSION_MARKER); sent before any process starts, so the reconciler can "
        "tell which live processes belong to which workload",
    )


class SnapshotSourcesIn(Strict):
    """What a snapshot of a session holds, as ``gpufleet snapshot create`` takes it."""

    paths: list[str] = Field(default_factory=list, max_length=16)
    prefixes: list[str] = Field(default_factory=list, max_length=64)
    overlays: list[str] = Field(default_factory=list, max_length=4)
    exclude: list[str] = Field(default_factory=list, max_length=256)


class RunningIn(Strict):
    snapshot: SnapshotSourcesIn | None = None
    # What the user should read in the session about its start ("restored from ...").
    notice: str = Field(default="", max_length=2000)


class KernelIn(BaseModel):
    id: str = Field(max_length=128)
    name: str = Field(default="", max_length=255)
    execution_state: str = Field(default="", max_length=32)
    last_activity: datetime | None = None
    connections: int = Field(default=0, ge=0, le=MAX_INT)


class TerminalIn(BaseModel):
    name: str = Field(max_length=255)
    last_activity: datetime | None = None


class ActivityIn(BaseModel):
    """What a session's extension saw: its kernels and terminals."""

    kernels: list[KernelIn] = Field(default_factory=list, max_length=1000)
    terminals: list[TerminalIn] = Field(default_factory=list, max_length=1000)
    sent_at: datetime | None = None


class KeepAliveIn(Strict):
    until: datetime | None = None
    hours: float | None = Field(default=None, ge=0, le=24 * 14)


class HoldIn(Strict):
    """The spawner keeps a stopped session's GPUs: its final snapshot failed."""

    message: str = Field(min_length=1, max_length=2000)


class ReleaseIn(Strict):
    outcome: Literal["withdrawn", "stopped", "failed"] = "stopped"
    message: str = Field(default="", max_length=2000)


class GpuOut(BaseModel):
    uuid: str
    index: int
    pci_bus_id: str
    node: str


class WorkloadOut(BaseModel):
    id: int
    kind: str
    state: str
    outcome: str | None
    project: str
    username: str
    server_name: str
    profile: str | None
    gpu_type: str
    pods: int
    gpus_per_pod: int
    gpus: int
    priority_class: str
    queue_position: int | None = Field(description="1 = next for its GPU type; None unless pending")
    reason: str = Field(description="why it waits, or what happened last, in words")
    version: int
    created_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    allocations: list[GpuOut]


class WorkloadList(BaseModel):
    items: list[WorkloadOut]
    total: int
    offset: int
    limit: int


class SnapshotOut(BaseModel):
    """A snapshot as the index lists it (the store's manifest is the truth)."""

    id: int
    username: str
    server_name: str
    workload_id: int | None
    created_at: datetime
    size_bytes: int
    file_count: int
    manifest_key: str


class SnapshotList(BaseModel):
    items: list[SnapshotOut]
    indexed_at: datetime | None = Field(description="when the index last read the store")


class GpuSpecIn(Strict):
    uuid: str = Field(min_length=1, max_length=96)
    index: int = Field(ge=0, le=MAX_INT)
    pci_bus_id: str = ""
    memory_bytes: int = Field(default=0, ge=0, le=MAX_INT)
    gpu_type: str | None = None


class NodeSpecIn(Strict):
    name: str = Field(min_length=1, max_length=255)
    cluster: str = Field(default="local", min_length=1, max_length=64)
    zone: str = Field(min_length=1, max_length=64)
    gpu_type: str = Field(min_length=1, max_length=64)
    gpus: list[GpuSpecIn]
    cpus: float = Field(default=0.0, ge=0, le=MAX_INT)
    memory_bytes: int = Field(default=0, ge=0, le=MAX_INT)
    labels: dict[str, str] = Field(default_factory=dict)


class RegisterIn(Strict):
    nodes: list[NodeSpecIn]


class HeartbeatIn(Strict):
    nodes: list[str]


class AssignmentOut(BaseModel):
    workload_id: int
    username: str
    name: str
    kind: str


class HeartbeatOut(BaseModel):
    unknown: list[str] = Field(description="nodes the controller does not know: register them")
    assignments: dict[str, AssignmentOut] = Field(
        default_factory=dict, description="GPU UUID → the workload holding it now"
    )


class GpuSampleIn(Strict):
    """One GPU's sample; a reading the GPU does not support is absent, not zero."""

    uuid: str = Field(min_length=1, max_length=96)
    index: int = Field(ge=0, le=MAX_INT)
    at: float
    lost: bool = False
    utilization_gpu_pct: int | None = Field(default=None, ge=0, le=100)
    utilization_memory_pct: int | None = Field(default=None, ge=0, le=100)
    memory_used_bytes: int | None = Field(default=None, ge=0, le=MAX_INT)
    memory_total_bytes: int | None = Field(default=None, ge=0, le=MAX_INT)
    power_watts: float | None = Field(default=None, ge=0, le=MAX_INT)
    temperature_c: int | None = Field(default=None, ge=-273, le=1000)
    clocks_event_reasons: int | None = Field(default=None, ge=0, le=MAX_INT)
    ecc_uncorrected_volatile: int | None = Field(default=None, ge=0, le=MAX_INT)
    ecc_corrected_volatile: int | None = Field(default=None, ge=0, le=MAX_INT)
    ecc_uncorrected_aggregate: int | None = Field(default=None, ge=0, le=MAX_INT)
    ecc_corrected_aggregate: int | None = Field(default=None, ge=0, le=MAX_INT)
    remapped_rows_correctable: int | None = Field(default=None, ge=0, le=MAX_INT)
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0, le=MAX_INT)
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_replays: int | None = Field(default=None, ge=0, le=MAX_INT)
    nvlink_replay_errors: int | None = Field(default=None, ge=0, le=MAX_INT)
    nvlink_recovery_errors: int | None = Field(default=None, ge=0, le=MAX_INT)
    nvlink_crc_flit_errors: int | None = Field(default=None, ge=0, le=MAX_INT)
    nvlink_crc_data_errors: int | None = Field(default=None, ge=0, le=MAX_INT)
    processes: list[
        tuple[Annotated[int, Field(ge=0, le=MAX_INT)], Annotated[int, Field(ge=0, le=MAX_INT)]]
    ] = Field(default_factory=list, max_length=4096)


class SamplesIn(Strict):
    samples: list[GpuSampleIn]


class XidIn(Strict):
    uuid: str = Field(min_length=1, max_length=96)
    xid: int = Field(ge=0, le=2**31)


class NodeOut(BaseModel):
    name: str
    cluster: str
    zone: str
    gpu_type: str
    health: str
    cordoned: bool
    gpus: int
    free_gpus: int
    last_heartbeat_at: datetime | None


class ProfileOut(BaseModel):
    name: str
    display_name: str
    description: str
    gpu_types: list[str]
    projects: list[str]
    default: bool


class QuotaOut(BaseModel):
    gpu_type: str
    guaranteed: int
    used: int


class ProjectOut(BaseModel):
    name: str
    display_name: str
    quotas: list[QuotaOut]


class QuotaUsageOut(BaseModel):
    gpu_type: str
    guaranteed: int
    borrow_limit: int | None = Field(description="more than the guarantee it may borrow; None: any")
    lend_limit: int | None = Field(description="of its guarantee others may borrow; None: all")
    used: int = Field(description="GPUs allocated now, in this project and those under it")
    waiting: int = Field(description="GPUs asked for by its waiting workloads")


class ProjectUsageOut(BaseModel):
    """A node of the project tree with its quotas and what it uses now."""

    name: str
    display_name: str
    kind: str = Field(description="organisation, team or project")
    parent: str | None
    fair_share_weight: float
    per_user_gpu_cap: int | None
    default_priority: str
    quotas: list[QuotaUsageOut]


class QuotaEditIn(Strict):
    guaranteed: int = Field(ge=0, le=MAX_INT)
    borrow_limit: int | None = Field(default=None, ge=0, le=MAX_INT, description="None: any")
    lend_limit: int | None = Field(default=None, ge=0, le=MAX_INT, description="None: all of it")


class ProjectEditIn(Strict):
    """An admin's change to one node of the project tree; what is left out stays."""

    weight: float | None = Field(default=None, gt=0, le=1e6)
    default_priority: str | None = Field(default=None, min_length=1, max_length=32)
    per_user_gpu_cap: int | None = Field(default=None, ge=1, le=MAX_INT, description="null: no cap")
    quotas: dict[str, QuotaEditIn] = Field(
        default_factory=dict, max_length=64, description="per GPU type, the whole quota"
    )


class ProjectList(BaseModel):
    items: list[ProjectUsageOut]


class WeekUsageOut(BaseModel):
    project: str
    username: str
    week: date = Field(description="the Monday (UTC) the week starts on")
    gpu_hours: float


class UsageList(BaseModel):
    weeks: int
    items: list[WeekUsageOut]


class SpawnOptionsOut(BaseModel):
    """Everything the spawn page offers one user."""

    username: str
    projects: list[ProjectOut]
    profiles: list[ProfileOut]
    gpu_types: dict[str, int] = Field(description="GPU type → most GPUs one node has")


class EventOut(BaseModel):
    id: int
    at: datetime
    kind: str
    message: str
    reason: str
    cause: str
    workload_id: int | None
    project: str | None
    username: str | None
    node: str | None
    # Details for programs (e.g. an idle warning's ``last_active`` and ``due_at``).
    data: dict[str, Any] = Field(default_factory=dict)


class ErrorOut(BaseModel):
    code: str
    message: str
    details: object | None = None
