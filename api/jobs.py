"""The REST API's bodies and answers for training jobs and the node agent's pod sync."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .schemas import MAX_INT, Count, Instant, Name, Strict, WorkloadOut

MAX_PODS = 100_000

# How torchrun marks each line a rank writes, in a Kubernetes job pod's output (its
# TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE): the node agent splits the pod's output into the
# ranks' streams by it.
RANK_LINE_PREFIX_TEMPLATE = "[gpufleet rank ${rank}]:"


class JobSubmitIn(Strict):
    """A training job: ``gpus`` in pods of ``gpus_per_pod``, every pod in one zone."""

    project: Name = Field(min_length=1, max_length=64)
    gpu_type: Name = Field(min_length=1, max_length=64)
    gpus: Count = Field(description="GPUs in all; validated with a readable message")
    gpus_per_pod: Count | None = Field(
        default=None, description="GPUs of each pod (one node); default: a whole node's worth"
    )
    priority: Name | None = Field(default=None, max_length=32, description="a priority class")
    name: Name = Field(default="", max_length=100, description="default: job-<id>")
    script: str = Field(min_length=1, max_length=1 << 20, description="the entry script's text")
    script_name: str = Field(
        default="train.py", min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.-]+\.py$"
    )
    args: list[str] = Field(default_factory=list, max_length=256)
    python: str = Field(
        default="",
        max_length=4096,
        description="the interpreter the ranks run with, as the submitting session sees it "
        "(its own, sys.executable); default: the job's environment's python",
    )
    cwd: str = Field(default="", max_length=4096, description="where the ranks start")
    env: dict[str, str] = Field(
        default_factory=dict, max_length=256, description="extra environment for the ranks"
    )
    checkpoint_uri: str = Field(
        default="",
        max_length=2000,
        description="where checkpoints go (GPUFLEET_CHECKPOINT_URI); default: the "
        "controller's job_checkpoint_store for this user and job name",
    )
    session: int | None = Field(
        default=None,
        ge=1,
        le=2**62,
        description="the submitter's running session (its workload id): the ranks run in "
        "its environment as it is at submit; default: the user's default environment",
    )


class JobPodOut(BaseModel):
    pod: int
    node: str
    cluster: str = Field(default="", description="the cluster of its node")
    state: str = Field(description="waiting|running|exited|stopped|failed")
    ranks: list[int]
    exit_code: int | None
    signal: int | None
    reason: str
    started_at: datetime | None
    ended_at: datetime | None


class CheckpointOut(BaseModel):
    uri: str
    step: int
    epoch: int | None = Field(default=None, description="the epoch it was saved in, if given")
    at: datetime | None


class InFlightOut(BaseModel):
    step: int
    since: datetime | None


class JobProgressOut(BaseModel):
    # A loss gone NaN reads "NaN" (JSON has no NaN), which a float field takes back.
    model_config = ConfigDict(ser_json_inf_nan="strings")

    last_step: int | None = Field(description="the step number last reported; null: none given")
    last_epoch: int | None = Field(
        default=None, description="the epoch last reported with it (gpufleet.progress(epoch=))"
    )
    last_step_at: datetime | None = Field(
        description="when the ranks last reported progress, with a step number or without: "
        "the hang check's clock"
    )
    step_time_p50_s: float | None
    step_time_p99_s: float | None
    metrics: dict[str, float]
    checkpoint_in_flight: InFlightOut | None
    last_checkpoint: CheckpointOut | None
    checkpoints_saved: int = Field(default=0, description="checkpoints saved, by all attempts")
    checkpoints_saved_by_attempt: dict[int, int] = Field(
        default_factory=dict, description="checkpoints saved by each attempt that saved any"
    )
    updated_at: datetime


class JobOut(WorkloadOut):
    name: str
    script_name: str
    args: list[str]
    checkpoint_uri: str
    ranks: int
    pod_states: list[JobPodOut]
    progress: JobProgressOut | None = Field(
        default=None,
        description="what its ranks reported (gpufleet.progress, checkpoint_saved); null "
        "before any report",
    )
    attempt: int = Field(
        default=1, description="which run of the job this is: 1, then one more per restart"
    )
    faults: int = Field(default=0, description="infrastructure faults it restarted from")
    restarts_at: datetime | None = Field(
        default=None, description="a waiting attempt's back-off ends then (null: none)"
    )
    avoids: list[str] = Field(
        default_factory=list,
        description="nodes and GPUs earlier faults blamed: not used until they pass maintenance",
    )
    effective_training_ratio: float | None = Field(
        default=None,
        description="the share of the time since its first step not lost to faults, "
        "preemptions and drains (work redone since the last checkpoint, and each restart "
        "until its first step); null before its first step (docs/recovery.md)",
    )


class JobList(BaseModel):
    items: list[JobOut]
    total: int
    offset: int
    limit: int


class LogOut(BaseModel):
    rank: int
    stream: str
    offset: int
    next_offset: int = Field(description="pass as offset to read on")
    data: str
    complete: bool = Field(description="the job ended: nothing will follow next_offset")


class AgentPodIn(Strict):
    workload_id: int = Field(ge=1, le=MAX_INT)
    pod_index: int = Field(ge=0, le=MAX_PODS)
    state: Literal["running", "exited", "stopped", "failed"]
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31)
    signal: int | None = Field(default=None, ge=0, le=255)
    reason: str = Field(default="", max_length=2000)
    attempt: int = Field(default=1, ge=1, le=MAX_INT, description="the job's attempt")
    adopted: bool = Field(
        default=False,
        description="the agent took this running pod over from the agent before it (a "
        "restart): said once",
    )


class LogChunkIn(Strict):
    workload_id: int = Field(ge=1, le=MAX_INT)
    rank: int = Field(ge=-MAX_PODS, le=MAX_PODS * 1024)
    stream: Literal["stdout", "stderr"]
    offset: int = Field(ge=0, le=MAX_INT, description="bytes into the attempt's stream")
    data: str = Field(max_length=1 << 20)
    attempt: int = Field(default=1, ge=1, le=MAX_INT, description="the job's attempt")


class StartedIn(Strict):
    step: int = Field(ge=0, le=MAX_INT)
    at: Instant


class SavedIn(Strict):
    uri: str = Field(max_length=2000)
    step: int = Field(ge=0, le=MAX_INT)
    epoch: int | None = Field(default=None, ge=0, le=MAX_INT)
    at: Instant


class PodProgressIn(Strict):
    """One pod's progress since the agent's last sync (agent/progress.py)."""

    workload_id: int = Field(ge=1, le=MAX_INT)
    pod_index: int = Field(ge=0, le=MAX_PODS)
    step: int | None = Field(default=None, ge=0, le=MAX_INT)
    epoch: int | None = Field(default=None, ge=0, le=MAX_INT)
    step_at: Instant | None = None
    step_times_s: list[float] = Field(default_factory=list, max_length=512)
    metrics: dict[str, float] = Field(default_factory=dict, max_length=32)
    checkpoint_started: StartedIn | None = None
    checkpoints_saved: list[SavedIn] = Field(default_factory=list, max_length=64)


class RankStackIn(Strict):
    rank: int = Field(ge=0, le=MAX_PODS * 1024)
    pid: int | None = Field(default=None, ge=1, le=2**31)
    where: str = Field(default="", max_length=500, description="the main thread's innermost frame")
    text: str = Field(default="", max_length=1 << 17, description="py-spy dump's output")
    error: str = Field(default="", max_length=2000, description="why none were taken")


class PodStacksIn(Strict):
    """One pod's answer to a trace: each of its ranks' stacks (agent/stacks.py)."""

    trace_id: int = Field(ge=1, le=MAX_INT)
    workload_id: int = Field(ge=1, le=MAX_INT)
    pod_index: int = Field(ge=0, le=MAX_PODS)
    ranks: list[RankStackIn] = Field(default_factory=list, max_length=1024)


class AgentSyncIn(Strict):
    nodes: list[Name] = Field(max_length=10_000)
    pods: list[AgentPodIn] = Field(default_factory=list, max_length=10_000)
    logs: list[LogChunkIn] = Field(default_factory=list, max_length=10_000)
    known: list[
        tuple[Annotated[int, Field(ge=1, le=MAX_INT)], Annotated[int, Field(ge=0, le=MAX_PODS)]]
    ] = Field(
        default_factory=list,
        max_length=10_000,
        description="(workload, pod) the agent runs, is stopping or watches: the answer "
        "waits only while these are exactly the pods the controller lists for its nodes",
    )
    wait: float = Field(default=0, ge=0, le=30)
    progress: list[PodProgressIn] = Field(default_factory=list, max_length=10_000)
    gone: list[Annotated[str, Field(max_length=80)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="leftover markers of which the agent found no process any more",
    )
    stacks: list[PodStacksIn] = Field(
        default_factory=list, max_length=10_000, description="answers to the pods' traces"
    )


class DesiredPodOut(BaseModel):
    workload_id: int
    pod_index: int
    pods: int
    gpus_per_pod: int
    node: str
    gpu_uuids: list[str]
    marker: str
    run: bool
    started: bool
    username: str
    name: str
    spec: dict[str, object]
    account: dict[str, object] | None = Field(
        default=None, description="uid, gid and mode: whom the pod's ranks run as"
    )
    attempt: int = Field(default=1, description="the job's attempt this pod belongs to")
    created_attempt: int = Field(
        default=0,
        description="the attempt that made the pod, whose name it has: an earlier one for a "
        "pod a restart kept on Kubernetes (0 from a controller that does not say: this "
        "attempt)",
    )
    resume_from: str = Field(
        default="", description="the checkpoint the attempt resumes from (GPUFLEET_RESUME_FROM)"
    )
    trace: int | None = Field(
        default=None,
        description="a trace awaiting this pod's ranks' stacks: take them (py-spy) before "
        "anything else, and send them with the next sync",
    )


class RankStackOut(BaseModel):
    rank: int
    pid: int | None
    where: str = Field(description="its main thread's innermost frame")
    text: str = Field(description="every thread's stacks, as py-spy dump printed them")
    error: str = Field(description="why its stacks could not be taken; empty when they were")


class PodStacksOut(BaseModel):
    pod: int
    node: str
    taken_at: datetime
    ranks: list[RankStackOut]


class TraceOut(BaseModel):
    """Every rank's Python stacks of one attempt, taken on a hang or when asked for."""

    id: int
    job: int
    attempt: int
    why: str = Field(description="hang (the recovery loop, before it stopped the gang) or asked")
    asked_by: str
    asked_at: datetime
    complete: bool = Field(description="every pod answered, or the wait for them ended")
    closed_at: datetime | None
    pods: list[PodStacksOut] = Field(description="the pods that answered, in pod order")
    missing_pods: list[int] = Field(description="pods that have not answered (yet)")


class TraceList(BaseModel):
    items: list[TraceOut]


class LeftoverOut(BaseModel):
    """What may be left of a pod whose agent went silent: end every process carrying
    ``marker`` on ``node``, then report the marker ``gone``."""

    node: str
    marker: str
    workload_id: int


class AgentSyncOut(BaseModel):
    pods: list[DesiredPodOut]
    leftovers: list[LeftoverOut] = Field(default_factory=list)
    watch: list[DesiredPodOut] = Field(
        default_factory=list,
        description="pods Kubernetes runs on the agent's nodes: it does not start them, "
        "it relays their output and their ranks' progress",
    )
