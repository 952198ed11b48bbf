"""The REST API's bodies and answers (pydantic, at the boundary only)."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

# The largest whole number any body may carry: what SQLite's and PostgreSQL's 64-bit
# integers and JavaScript's numbers all hold exactly. A larger one is refused with a 400.
MAX_INT = 2**53


# Characters no name may hold: NUL (PostgreSQL refuses it in text; C strings end at it),
# the other C0/C1 controls, and the bidirectional controls that make a name display other
# than it reads (U+202A-U+202E embeddings and overrides, U+2066-U+2069 isolates, the
# marks U+200E, U+200F and U+061C) — "Trojan Source", CVE-2021-42574. The scheduler's
# pure core holds the same rule for what reaches it other than through these models
# (scheduler/validation.py); a unit test holds the two to the same answer for every
# character.
BIDI_CONTROLS = frozenset(
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
)


def name_problem(text: str) -> str | None:
    """What makes ``text`` unfit to be a name (user, project, GPU type, node...), or None."""
    for char in text:
        if char == "\0":
            return "holds a NUL character (U+0000)"
        if char in BIDI_CONTROLS:
            return (
                f"holds the bidirectional control U+{ord(char):04X}, which makes text "
                "display other than it reads"
            )
        if ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0:
            return f"holds the control character U+{ord(char):04X}"
    return None


def _plain_name(text: str) -> str:
    problem = name_problem(text)
    if problem is not None:
        raise PydanticCustomError("name", f"{problem}; names are plain text on one line")
    return text


def _count_as_sent(value: object) -> object:
    """A count is a JSON number or text; ``true`` is refused here, where pydantic (and
    Python: True == 1) would take it for 1."""
    if isinstance(value, int | str) and not isinstance(value, bool):
        return value
    if isinstance(value, list | dict):
        sent = "a list" if isinstance(value, list) else "an object"
    else:
        sent = json.dumps(value)  # true, false, null, 2.0
    raise PydanticCustomError(
        "count", "must be a whole number such as 1 or 2, not {sent}", {"sent": sent}
    )


def _as_utc(at: datetime) -> datetime:
    """A time as sent, in UTC; one without a zone is taken as UTC (what JupyterHub sends).
    Year 1 at +01:00 is before any UTC time Python holds: refused here, not an
    OverflowError where the store converts it."""
    if at.tzinfo is None:
        return at.replace(tzinfo=UTC)
    try:
        return at.astimezone(UTC)
    except OverflowError:
        raise PydanticCustomError("time", "is outside the years 1-9999 in UTC") from None


# A user, server, project, GPU type, profile, priority class, node or GPU name: no NUL,
# control or bidirectional-control character (name_problem).
Name = Annotated[str, AfterValidator(_plain_name)]
# A GPU count as sent: a JSON number, or the text a form field held ("2": ASCII digits
# alone, " 1" is refused), which the controller reads with a message saying what to type
# (scheduler/validation.py). JSON true is not 1.
Count = Annotated[int | str, BeforeValidator(_count_as_sent)]
# A time a client reports (kernel activity, a keep-alive's end), as an aware UTC datetime.
Instant = Annotated[datetime, AfterValidator(_as_utc)]


class Strict(BaseModel):
    # strict: a JSON number where the schema says integer (true is not 1, "5" is not 5),
    # and no field the schema does not name.
    model_config = ConfigDict(extra="forbid", strict=True)


class SessionRequestIn(Strict):
    """A spawner asks for GPUs for one user's server."""

    username: Name = Field(min_length=1, max_length=255)
    server_name: Name = Field(default="", max_length=255)
    project: Name = Field(min_length=1, max_length=64)
    gpu_type: Name = Field(min_length=1, max_length=64)
    gpus: Count = Field(description="GPUs on one node; validated with a readable message")
    profile: Name | None = Field(default=None, max_length=64)
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
    on_node: bool = Field(
        default=False,
        description="the paths are on the session's node: its node agent reads them "
        "(a Kubernetes session's hostPath volumes)",
    )
    container: bool = Field(
        default=False, description="on_node: also the container's layer (overlay upper)"
    )


class RunningIn(Strict):
    snapshot: SnapshotSourcesIn | None = None
    # What the user should read in the session about its start ("restored from ...").
    notice: str = Field(default="", max_length=2000)


class KernelIn(BaseModel):
    model_config = ConfigDict(strict=True)  # extra fields: the kernel model as Jupyter has it
    id: str = Field(max_length=128)
    name: str = Field(default="", max_length=255)
    execution_state: str = Field(default="", max_length=32)
    last_activity: Instant | None = None
    connections: int = Field(default=0, ge=0, le=MAX_INT)


class TerminalIn(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(max_length=255)
    last_activity: Instant | None = None


class ActivityIn(BaseModel):
    """What a session's extension saw: its kernels and terminals."""

    model_config = ConfigDict(strict=True)

    kernels: list[KernelIn] = Field(default_factory=list, max_length=1000)
    terminals: list[TerminalIn] = Field(default_factory=list, max_length=1000)
    # What its user last did in JupyterLab: typed, clicked or scrolled ("input"), or
    # saved or changed a file through it ("file"); the page's own polling is no action.
    user_activity: Instant | None = None
    user_action: Literal["", "input", "file"] = ""
    sent_at: Instant | None = None


class KeepAliveIn(Strict):
    until: Instant | None = None
    hours: float | None = Field(default=None, ge=0, le=24 * 14)


class NoticeOut(BaseModel):
    """A notice the session shows its user (an idle warning, what was restored)."""

    id: str
    level: str = Field(description="info or warning")
    message: str
    deadline: datetime | None = Field(description="when the session will be stopped, if it is")


class SessionStateOut(BaseModel):
    """What a session's extension is told after a report or a keep-alive."""

    notices: list[NoticeOut]
    keep_alive_until: datetime | None = Field(description="no cull before this; None: none")
    keep_alive_max_s: float = Field(description="how far ahead a keep-alive may reach")
    notice_poll_s: float = Field(description="how often to ask for notices")


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
    cluster: str


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
    uuid: Name = Field(min_length=1, max_length=96)
    index: int = Field(ge=0, le=MAX_INT)
    pci_bus_id: Name = ""
    memory_bytes: int = Field(default=0, ge=0, le=MAX_INT)
    gpu_type: Name | None = None


class NodeSpecIn(Strict):
    name: Name = Field(min_length=1, max_length=255)
    cluster: Name = Field(default="local", min_length=1, max_length=64)
    zone: Name = Field(
        default="",
        max_length=64,
        description="empty: the zone the node's cluster gave it, or 'default' for a new node",
    )
    gpu_type: Name = Field(min_length=1, max_length=64)
    gpus: list[GpuSpecIn]
    cpus: float = Field(default=0.0, ge=0, le=MAX_INT)
    memory_bytes: int = Field(default=0, ge=0, le=MAX_INT)
    labels: dict[Name, str] = Field(default_factory=dict)


class RegisterIn(Strict):
    nodes: list[NodeSpecIn]


class HeartbeatIn(Strict):
    nodes: list[Name]


class AssignmentOut(BaseModel):
    workload_id: int
    username: str
    name: str
    kind: str
    project: str = ""
    marker: str = Field(default="", description="what the workload's processes carry")


class HeartbeatOut(BaseModel):
    unknown: list[str] = Field(description="nodes the controller does not know: register them")
    assignments: dict[str, AssignmentOut] = Field(
        default_factory=dict, description="GPU UUID → the workload holding it now"
    )


class GpuSampleIn(Strict):
    """One GPU's sample; a reading the GPU does not support is absent, not zero."""

    uuid: Name = Field(min_length=1, max_length=96)
    index: int = Field(ge=0, le=MAX_INT)
    # NaN and Infinity are JSON to pydantic, not to PostgreSQL's json nor to the pages.
    at: float = Field(allow_inf_nan=False, description="when it was read (Unix seconds)")
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
    uuid: Name = Field(min_length=1, max_length=96)
    xid: int = Field(ge=0, le=2**31)


class PlacementIn(Strict):
    """The GPUs the processes carrying one marker were given (their container's
    NVIDIA_VISIBLE_DEVICES, the served GPUs of it)."""

    marker: str = Field(
        min_length=8,
        max_length=74,
        pattern=r"^[0-9A-Za-z_-]{8,64}(\.[0-9]{1,9})?$",
        description="a workload's process marker, or one pod's: <marker>.<pod index>",
    )
    gpu_uuids: list[Annotated[Name, Field(min_length=1, max_length=96)]] = Field(
        min_length=1, max_length=1024
    )


class PlacementsIn(Strict):
    placements: list[PlacementIn] = Field(max_length=100_000)


class PlacementsOut(BaseModel):
    reseated: list[int] = Field(description="workloads now recorded on other GPUs")
    mismatched: list[int] = Field(
        description="workloads whose report fits no admission: nothing changed (an event says "
        "why, once)"
    )
    unknown: list[str] = Field(description="markers of no workload this controller knows")


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
    gpu_uuids: list[str] = Field(
        default_factory=list,
        description="its present GPUs' UUIDs, by index; on Kubernetes, until a node agent "
        "there names them, its cluster's counted slots k8s/<cluster>/<node>/<i>",
    )
    cordoned_gpus: list[str] = Field(
        default_factory=list,
        description="GPUs the recovery loop took out of service; uncordoning the node "
        "returns them, but for the lemons",
    )
    lemon_gpus: list[str] = Field(
        default_factory=list,
        description="GPUs on the lemon list (repeated hardware faults): out of service "
        "until an admin clears each (POST /gpus/{uuid}/clear-lemon)",
    )
    maintenance: str | None = Field(
        default=None,
        description="recycle or diagnose while due (once the node is empty), recycling or "
        'diagnosing while its agent runs it (docs/recovery.md, "Maintenance")',
    )
    leftover_gpus: list[str] = Field(
        default_factory=list,
        description="GPUs held for what may be left of a job pod whose node agent went "
        "silent: out of service until an agent of the node reports its processes gone",
    )
    spare: bool = Field(
        default=False,
        description="Held back as a recovery spare in the last admission cycle "
        "(c.FleetController.recovery_spares): only jobs restarting after a fault and "
        "preemptible work land here",
    )


class BreakerOut(BaseModel):
    cluster: str
    open: bool = Field(description="the recovery loop cordons none of its nodes until reset")
    tripped_at: datetime | None


class DrainIn(Strict):
    reason: str = Field(default="", max_length=500, description="why, for the events")
    at: str | None = Field(
        default=None,
        max_length=64,
        description="drain later: HH:MM (the next such time, UTC) or an ISO date and time; "
        "the drain is then a timed job (GET /timed)",
    )


class RecycleIn(Strict):
    reason: str = Field(default="", max_length=500, description="why, for the events")


class TimedJobOut(BaseModel):
    id: str
    what: str
    at: datetime | None


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
    default_priority: Name | None = Field(default=None, min_length=1, max_length=32)
    per_user_gpu_cap: int | None = Field(default=None, ge=1, le=MAX_INT, description="null: no cap")
    quotas: dict[Name, QuotaEditIn] = Field(
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


class AccountOut(BaseModel):
    """Whom a user's sessions and job ranks run as (docs/containment.md)."""

    username: str
    uid: int
    gid: int
    mode: Literal["sandbox", "system"]
    home: str | None = Field(description="the system account's home; null in sandbox mode")


class SpawnOptionsOut(BaseModel):
    """Everything the spawn page offers one user."""

    username: str
    projects: list[ProjectOut]
    profiles: list[ProfileOut]
    gpu_types: dict[str, int] = Field(description="GPU type → most GPUs one node has")


class ErrorOut(BaseModel):
    code: str
    message: str
    details: object | None = None
