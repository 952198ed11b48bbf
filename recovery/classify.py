"""What a fault is and what to do about it: ``classify(signal, history, policy) -> Verdict``.

Pure and table-driven: a signal (an XID, an NVML recovery action, a lost GPU or node, a
silent node agent, a pod's outcome, a job that stopped progressing) and what was seen
recently on the same GPUs and nodes go in; the fault's class, what to do with the job,
what to do with the GPU or node, and whether the attempt spends the job's retry budget come
out. The recovery loop (``recovery/loop.py``) observes and acts; this module decides.

The rules (docs/recovery.md has them as a table):

- **Application faults** (XID 13, 31, 43, 94): restart the job in place. The same GPU's
  second application fault within ``repeat_window_s``: the GPU is suspect, so it is cordoned
  for diagnostics and the job restarts elsewhere.
- **GPU hardware** (XID 48, 62, 64, 95, 109, 119, 120, 136, 140, 143, a row-remap failure,
  NVML's recovery action GPU_RESET or DRAIN_AND_RESET): drain and reset the GPU, restart
  the job without it. A GPU with ``lemon_after`` hardware faults within ``lemon_window_s``
  goes on the lemon list (cordoned until an admin clears it).
- **Node** (XID 79 fallen off the bus, a GPU lost, the GPU count dropping, NODE_REBOOT, the
  node NotReady or deleted): cordon, drain and recycle the node; restart elsewhere.
- **Degraded** (XID 63, 92, rising single-bit ECC counts): nothing stops; the GPU is reset
  at its next idle point.
- **NVLink / fabric** (XID 74, NVLink CRC errors): blamed on a GPU only when its link peer
  saw nothing within ``repeat_window_s``; when both ends did, the link is suspect and both
  GPUs are diagnosed. The job restarts elsewhere.
- **Pod and process outcomes.** A hardware signal on the job's GPUs or nodes within
  ``blame_window_s`` before the outcome outranks the exit code: torchrun exits 1 whenever
  any rank fails, and a GPU fault shows up in the rank as a CUDA error and exit 1. Without
  one: disruptions (preemption, drain, ``DisruptionTarget``) restart without spending the
  budget; the user's own errors (a Python exception in their code, CUDA out of memory,
  ``OOMKilled``, exit 2, 126, 127, a pod that could not start as the job asks, e.g. a
  checkpoint location it may not use) are not retried, and the verdict says why; a pod its
  node could not start (no sandbox there, the agent's own trouble) restarts elsewhere; a
  restarted agent that found no record of a pod is a disruption; an NCCL watchdog timeout
  restarts; anything else (exit 1 with no rank error, a SIGKILL from nowhere) restarts and
  spends the budget: an exit code alone is weak evidence.
- **Hangs**: no progress report for ``max(hang_factor × p99 step time, hang_floor_s)``,
  a checkpoint started and not saved within ``checkpoint_limit_s``, or (a job that never
  reports progress) no output and idle GPUs for ``silent_idle_s``: the job is killed and
  restarts.
- **A silent node agent** while a job runs there: the node is cordoned (its GPUs stay held
  until its processes are known gone) and the job restarts elsewhere.

Disruptions spend nothing; user errors end the job; every other fault spends one attempt
of the infrastructure budget.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class FaultClass(enum.StrEnum):
    APPLICATION = "application"
    GPU_HARDWARE = "gpu-hardware"
    NODE = "node"
    DEGRADED = "degraded"
    FABRIC = "fabric"
    USER = "user-error"
    DISRUPTION = "disruption"
    HANG = "hang"
    AGENT_LOST = "agent-lost"
    UNKNOWN = "unknown"


class JobAction(enum.StrEnum):
    KEEP = "keep"  # it keeps running
    RESTART_IN_PLACE = "restart-in-place"  # the same GPUs may be used again
    RESTART_ELSEWHERE = "restart-elsewhere"  # without the GPUs and nodes blamed
    FAIL = "fail"  # not retried: the user must change something


class HardwareAction(enum.StrEnum):
    NONE = "none"
    DIAGNOSE_GPU = "cordon-gpu-and-diagnose"
    DRAIN_AND_RESET_GPU = "drain-and-reset-gpu"
    LEMON_GPU = "lemon-gpu"  # cordoned until an admin clears it
    RESET_AT_IDLE = "reset-gpu-at-idle"
    DIAGNOSE_LINK = "diagnose-link"  # both ends of an NVLink
    RECYCLE_NODE = "cordon-drain-recycle-node"
    CORDON_NODE = "cordon-node"  # until its agent is back


# NVIDIA's XID catalogue, as far as it decides an action.
APPLICATION_XIDS = frozenset({13, 31, 43, 94})
GPU_HARDWARE_XIDS = frozenset({48, 62, 64, 95, 109, 119, 120, 136, 140, 143})
NODE_XIDS = frozenset({79})
DEGRADED_XIDS = frozenset({63, 92})
FABRIC_XIDS = frozenset({74})

# NVML's recovery actions (nvmlDeviceGetGpuRecoveryAction) that name one.
GPU_RECOVERY_ACTIONS = frozenset({"GPU_RESET", "DRAIN_AND_RESET"})
NODE_RECOVERY_ACTIONS = frozenset({"NODE_REBOOT"})

# What each class does, unless a rule below says otherwise.
ACTIONS: dict[FaultClass, tuple[JobAction, HardwareAction, bool]] = {
    FaultClass.APPLICATION: (JobAction.RESTART_IN_PLACE, HardwareAction.NONE, True),
    FaultClass.GPU_HARDWARE: (
        JobAction.RESTART_ELSEWHERE,
        HardwareAction.DRAIN_AND_RESET_GPU,
        True,
    ),
    FaultClass.NODE: (JobAction.RESTART_ELSEWHERE, HardwareAction.RECYCLE_NODE, True),
    FaultClass.DEGRADED: (JobAction.KEEP, HardwareAction.RESET_AT_IDLE, False),
    FaultClass.FABRIC: (JobAction.RESTART_ELSEWHERE, HardwareAction.DIAGNOSE_GPU, True),
    FaultClass.USER: (JobAction.FAIL, HardwareAction.NONE, False),
    FaultClass.DISRUPTION: (JobAction.RESTART_ELSEWHERE, HardwareAction.NONE, False),
    FaultClass.HANG: (JobAction.RESTART_IN_PLACE, HardwareAction.NONE, True),
    FaultClass.AGENT_LOST: (JobAction.RESTART_ELSEWHERE, HardwareAction.CORDON_NODE, True),
    FaultClass.UNKNOWN: (JobAction.RESTART_IN_PLACE, HardwareAction.NONE, True),
}

# Exit codes that are the command's own complaint: misuse of a shell builtin or bad
# arguments (2), a command found but not executable (126), a command not found (127).
USER_EXIT_CODES = {
    2: "bad arguments",
    126: "a command that is not executable",
    127: "a command that was not found",
}
# Pod reasons and termination causes that are someone else's decision, not a fault.
# ``Deleted``: a Kubernetes pod deleted by someone other than gpufleet (a drain, kubectl).
DISRUPTIONS = frozenset(
    {"Preempted", "DisruptionTarget", "Drained", "Evicted", "AgentRestarted", "Deleted"}
)
# A pod's cluster could not start it, for no fault of the job's: the gang did not start
# whole within its deadline, or the API server refused one of its objects.
NOT_STARTED_BY_CLUSTER = {
    "StartTimeout": "its pods did not all start in time",
    "CreateRefused": "its cluster refused to create its pods",
}
# How the local node agent's reasons for a pod that did not run begin, and what they mean
# for the pod's outcome (``outcome_reason``): the job asked for what cannot be done (its
# own error), the node could not run it (the infrastructure's), or a restarted agent found
# no record of a pod an agent of an earlier release ran (a disruption of the platform's).
REFUSED_AS_ASKED = "could not start: "
NODE_COULD_NOT_START = "this node could not start it: "
ENDED_BY_AGENT_RESTART = "was ended: the node agent restarted"
# Exception types and messages of a rank that are the user's own doing.
OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory")
NCCL_TIMEOUT = ("Watchdog caught collective operation timeout", "NCCL timeout", "ncclTimeout")
# Markers of a rank's error that are the infrastructure's (a GPU or driver fault as CUDA
# reports it): never blamed on the user.
CUDA_INFRASTRUCTURE = (
    "uncorrectable ECC error",
    "CUDA error: unspecified launch failure",
    "CUDA-capable device(s) is/are busy or unavailable",
    "GPU has fallen off the bus",
    "CUDA error: an illegal instruction was encountered",
)


# ------------------------------------------------------------------ signals
@dataclass(frozen=True)
class Xid:
    code: int
    gpu: str
    node: str
    at: float


@dataclass(frozen=True)
class RecoveryAction:
    """NVML's own verdict for a GPU (``GPU_RESET``, ``NODE_REBOOT``, ``DRAIN_AND_RESET``)."""

    action: str
    gpu: str
    node: str
    at: float


@dataclass(frozen=True)
class RemapFailure:
    gpu: str
    node: str
    at: float


@dataclass(frozen=True)
class EccRising:
    """Single-bit (corrected) ECC errors growing faster than ``ecc_rising_per_hour``."""

    gpu: str
    node: str
    at: float
    per_hour: float


@dataclass(frozen=True)
class NvlinkErrors:
    """NVLink CRC or replay errors on ``gpu``'s link to ``peer`` (XID 74 has no peer)."""

    gpu: str
    peer: str | None
    node: str
    at: float


@dataclass(frozen=True)
class GpuLost:
    gpu: str
    node: str
    at: float


@dataclass(frozen=True)
class GpuCountDrop:
    node: str
    before: int
    now: int
    at: float


@dataclass(frozen=True)
class NodeLost:
    node: str
    why: str  # "not Ready (...)", "deleted"
    at: float


@dataclass(frozen=True)
class AgentSilent:
    node: str
    silent_s: float
    at: float


@dataclass(frozen=True)
class RankError:
    """What torchrun's error file (``TORCHELASTIC_ERROR_FILE``) says of the failing rank."""

    rank: int
    exception: str  # its type, "ValueError"
    message: str


def outcome_reason(agent_reason: str) -> str:
    """The backend's reason (``PodOutcome.reason``) for what the local node agent said of
    a pod: ``StartFailed``, ``NodeCannotStart``, ``AgentRestarted`` or none."""
    if agent_reason.startswith(REFUSED_AS_ASKED):
        return "StartFailed"
    if agent_reason.startswith(NODE_COULD_NOT_START):
        return "NodeCannotStart"
    if agent_reason.startswith(ENDED_BY_AGENT_RESTART):
        return "AgentRestarted"
    return ""


@dataclass(frozen=True)
class PodOutcome:
    """A job pod that ended by itself or was ended: its exit code or signal, the reason its
    backend gives (``OOMKilled``, ``Preempted``, ``DisruptionTarget``...), the failing
    rank's error if one was read, and where it ran."""

    exit_code: int | None
    signal: int | None
    reason: str
    rank_error: RankError | None
    gpus: tuple[str, ...]
    nodes: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class NoProgress:
    """A job that stopped progressing (``hang_of`` decides): ``kind`` is ``step``,
    ``checkpoint`` or ``silent``."""

    kind: str
    quiet_s: float
    limit_s: float
    at: float


Signal = (
    Xid
    | RecoveryAction
    | RemapFailure
    | EccRising
    | NvlinkErrors
    | GpuLost
    | GpuCountDrop
    | NodeLost
    | AgentSilent
    | PodOutcome
    | NoProgress
)
HardwareSignal = (
    Xid
    | RecoveryAction
    | RemapFailure
    | EccRising
    | NvlinkErrors
    | GpuLost
    | GpuCountDrop
    | NodeLost
)


@dataclass(frozen=True)
class RecoveryPolicy:
    repeat_window_s: float = 3600.0  # a second application fault of a GPU within this
    lemon_after: int = 2  # hardware faults of one GPU ...
    lemon_window_s: float = 7 * 86400.0  # ... within this make it a lemon
    blame_window_s: float = 120.0  # a hardware signal this long before an exit explains it
    hang_factor: float = 10.0  # no step for this many p99 step times ...
    hang_floor_s: float = 600.0  # ... and at least this long (NCCL's own default)
    checkpoint_limit_s: float = 1800.0  # a checkpoint started and not saved
    silent_idle_s: float = 1800.0  # no progress API: no output and idle GPUs this long
    # A hung gang is stopped once every rank's stacks are taken, or after this long.
    stacks_wait_s: float = 20.0


@dataclass(frozen=True)
class Verdict:
    fault: FaultClass
    job: JobAction
    hardware: HardwareAction
    spends_budget: bool
    reason: str  # what a person reads: the evidence and the decision
    gpus: tuple[str, ...] = ()  # blamed (excluded from the restart)
    nodes: tuple[str, ...] = ()
    evidence: tuple[Signal, ...] = field(default=(), compare=False)


def _verdict(
    fault: FaultClass,
    reason: str,
    *,
    gpus: Sequence[str] = (),
    nodes: Sequence[str] = (),
    job: JobAction | None = None,
    hardware: HardwareAction | None = None,
    evidence: Sequence[Signal] = (),
) -> Verdict:
    default_job, default_hardware, spends = ACTIONS[fault]
    return Verdict(
        fault,
        job or default_job,
        hardware or default_hardware,
        spends,
        reason,
        tuple(gpus),
        tuple(nodes),
        tuple(evidence),
    )


# ------------------------------------------------------------------ classify
def classify(
    signal: Signal, history: Iterable[Signal] = (), policy: RecoveryPolicy | None = None
) -> Verdict:
    """The verdict on ``signal``, given what was seen before it (``history``: earlier
    signals, any order; those after ``signal.at`` are ignored)."""
    policy = policy or RecoveryPolicy()
    earlier = [s for s in history if s.at <= signal.at and s is not signal]
    if isinstance(signal, PodOutcome):
        return _outcome(signal, earlier, policy)
    if isinstance(signal, NoProgress):
        return _hang(signal)
    if isinstance(signal, AgentSilent):
        return _verdict(
            FaultClass.AGENT_LOST,
            f"the node agent of {signal.node} has been silent for {signal.silent_s:.0f} s: "
            "the node is cordoned, its GPUs stay held until its processes are known gone, "
            "and the job restarts elsewhere",
            nodes=[signal.node],
            evidence=[signal],
        )
    return _hardware(signal, earlier, policy)


def _hardware(signal: HardwareSignal, earlier: Sequence[Signal], policy: RecoveryPolicy) -> Verdict:
    if isinstance(signal, Xid):
        return _xid(signal, earlier, policy)
    if isinstance(signal, RecoveryAction):
        if signal.action in NODE_RECOVERY_ACTIONS:
            return _node(signal.node, f"NVML asks for {signal.action} on GPU {signal.gpu}", signal)
        if signal.action in GPU_RECOVERY_ACTIONS:
            return _gpu_hardware(
                signal, f"NVML asks for {signal.action} on GPU {signal.gpu}", earlier, policy
            )
        return _verdict(
            FaultClass.DEGRADED,
            f"NVML's recovery action {signal.action} on GPU {signal.gpu}: reset at idle",
            gpus=[signal.gpu],
            evidence=[signal],
        )
    if isinstance(signal, RemapFailure):
        return _gpu_hardware(signal, f"GPU {signal.gpu} failed to remap a row", earlier, policy)
    if isinstance(signal, EccRising):
        return _verdict(
            FaultClass.DEGRADED,
            f"GPU {signal.gpu}'s corrected ECC errors rise ({signal.per_hour:.0f}/h): it is "
            "reset at its next idle point",
            gpus=[signal.gpu],
            evidence=[signal],
        )
    if isinstance(signal, NvlinkErrors):
        return _fabric(signal, f"NVLink errors on GPU {signal.gpu}", earlier, policy)
    if isinstance(signal, GpuLost):
        return _node(signal.node, f"GPU {signal.gpu} is lost to NVML", signal)
    if isinstance(signal, GpuCountDrop):
        return _node(
            signal.node,
            f"the node's GPU count dropped from {signal.before} to {signal.now}",
            signal,
        )
    return _node(signal.node, f"the node is {signal.why}", signal)


def _xid(signal: Xid, earlier: Sequence[Signal], policy: RecoveryPolicy) -> Verdict:
    what = f"XID {signal.code} on GPU {signal.gpu}"
    if signal.code in APPLICATION_XIDS:
        repeats = [
            s
            for s in earlier
            if isinstance(s, Xid)
            and s.gpu == signal.gpu
            and s.code in APPLICATION_XIDS
            and signal.at - s.at <= policy.repeat_window_s
        ]
        if repeats:
            return _verdict(
                FaultClass.APPLICATION,
                f"{what}, the GPU's second application fault within "
                f"{policy.repeat_window_s:.0f} s (XID {repeats[-1].code} before): the GPU is "
                "cordoned for diagnostics and the job restarts without it",
                gpus=[signal.gpu],
                job=JobAction.RESTART_ELSEWHERE,
                hardware=HardwareAction.DIAGNOSE_GPU,
                evidence=[signal, *repeats],
            )
        return _verdict(
            FaultClass.APPLICATION,
            f"{what}, an application fault: the job restarts in place",
            evidence=[signal],
        )
    if signal.code in GPU_HARDWARE_XIDS:
        return _gpu_hardware(signal, f"{what}, a GPU hardware fault", earlier, policy)
    if signal.code in NODE_XIDS:
        return _node(signal.node, f"{what}: the GPU has fallen off the bus", signal)
    if signal.code in DEGRADED_XIDS:
        return _verdict(
            FaultClass.DEGRADED,
            f"{what}: the GPU is degraded and is reset at its next idle point",
            gpus=[signal.gpu],
            evidence=[signal],
        )
    if signal.code in FABRIC_XIDS:
        return _fabric(
            NvlinkErrors(signal.gpu, None, signal.node, signal.at), what, earlier, policy
        )
    return _verdict(
        FaultClass.UNKNOWN,
        f"{what}, which gpufleet does not classify: the job restarts in place",
        evidence=[signal],
    )


def _gpu_hardware(
    signal: Xid | RecoveryAction | RemapFailure,
    what: str,
    earlier: Sequence[Signal],
    policy: RecoveryPolicy,
) -> Verdict:
    before = [
        s
        for s in earlier
        if getattr(s, "gpu", None) == signal.gpu
        and signal.at - s.at <= policy.lemon_window_s
        and _is_gpu_hardware(s)
    ]
    if len(before) + 1 >= policy.lemon_after:
        return _verdict(
            FaultClass.GPU_HARDWARE,
            f"{what}; {len(before) + 1} hardware faults of this GPU within "
            f"{policy.lemon_window_s / 86400:.0f} days: it goes on the lemon list (cordoned "
            "until an admin clears it) and the job restarts without it",
            gpus=[signal.gpu],
            hardware=HardwareAction.LEMON_GPU,
            evidence=[signal, *before],
        )
    return _verdict(
        FaultClass.GPU_HARDWARE,
        f"{what}: the GPU is drained and reset, and the job restarts without it",
        gpus=[signal.gpu],
        evidence=[signal],
    )


def _is_gpu_hardware(s: Signal) -> bool:
    if isinstance(s, Xid):
        return s.code in GPU_HARDWARE_XIDS
    if isinstance(s, RecoveryAction):
        return s.action in GPU_RECOVERY_ACTIONS
    return isinstance(s, RemapFailure)


def _node(node: str, what: str, signal: Signal) -> Verdict:
    return _verdict(
        FaultClass.NODE,
        f"{what}: node {node} is cordoned, drained and recycled; the job restarts elsewhere",
        nodes=[node],
        evidence=[signal],
    )


def _fabric(
    signal: NvlinkErrors, what: str, earlier: Sequence[Signal], policy: RecoveryPolicy
) -> Verdict:
    """Blame the GPU only if its link peer is clean; both ends erring blames the link."""
    peer_errors = [
        s
        for s in earlier
        if isinstance(s, NvlinkErrors | Xid)
        and (not isinstance(s, Xid) or s.code in FABRIC_XIDS)
        and s.gpu != signal.gpu
        and s.node == signal.node
        and (signal.peer is None or s.gpu == signal.peer)
        and signal.at - s.at <= policy.repeat_window_s
    ]
    if peer_errors:
        peer = peer_errors[-1].gpu
        return _verdict(
            FaultClass.FABRIC,
            f"{what}, and its peer GPU {peer} erred too: the link between them is diagnosed "
            "(neither GPU is blamed alone) and the job restarts away from both",
            gpus=sorted({signal.gpu, peer}),
            hardware=HardwareAction.DIAGNOSE_LINK,
            evidence=[signal, *peer_errors],
        )
    return _verdict(
        FaultClass.FABRIC,
        f"{what}, its peers clean: the GPU is cordoned for diagnostics and the job restarts "
        "without it",
        gpus=[signal.gpu],
        evidence=[signal],
    )


def _outcome(signal: PodOutcome, earlier: Sequence[Signal], policy: RecoveryPolicy) -> Verdict:
    # A hardware signal on the job's GPUs or nodes just before outranks the exit code.
    verdict = _hardware_before(signal, earlier, policy) or _stopped_or_not_started(signal)
    if verdict is not None:
        return verdict
    if signal.rank_error is not None:
        return _rank_error(signal, signal.rank_error)
    if signal.reason == "OOMKilled":
        return _verdict(
            FaultClass.USER,
            "the pod ran out of host memory (OOMKilled): not retried; use less memory or "
            "ask for more",
            evidence=[signal],
        )
    if signal.exit_code in USER_EXIT_CODES:
        return _verdict(
            FaultClass.USER,
            f"the job's command exited {signal.exit_code} "
            f"({USER_EXIT_CODES[signal.exit_code]}): not retried; check the command",
            evidence=[signal],
        )
    return _verdict(
        FaultClass.UNKNOWN,
        f"the pod ended ({_how(signal)}) with nothing to explain it: the job restarts and "
        "spends one attempt of its retry budget",
        evidence=[signal],
    )


def _hardware_before(
    signal: PodOutcome, earlier: Sequence[Signal], policy: RecoveryPolicy
) -> Verdict | None:
    """The verdict on the latest hardware signal on the pod's GPUs or nodes within
    ``blame_window_s`` before it ended, when that one acts on the job; else None."""
    explaining = [
        s
        for s in earlier
        if signal.at - s.at <= policy.blame_window_s
        and not isinstance(s, PodOutcome | NoProgress)
        and (getattr(s, "gpu", None) in signal.gpus or getattr(s, "node", None) in signal.nodes)
        and not isinstance(s, EccRising)
    ]
    if not explaining:
        return None
    cause = classify(explaining[-1], earlier, policy)
    if cause.job is JobAction.KEEP:
        return None
    return Verdict(
        cause.fault,
        cause.job,
        cause.hardware,
        cause.spends_budget,
        f"the pod ended ({_how(signal)}) {signal.at - explaining[-1].at:.0f} s after "
        f"{cause.reason}",
        cause.gpus,
        cause.nodes,
        (signal, *cause.evidence),
    )


def _stopped_or_not_started(signal: PodOutcome) -> Verdict | None:
    """The verdict its reason alone gives a pod that was stopped (a disruption) or never
    started (as the job asks, or on its node); else None."""
    if signal.reason in DISRUPTIONS:
        return _verdict(
            FaultClass.DISRUPTION,
            f"the pod was stopped ({signal.reason}): the job restarts without spending its "
            "retry budget",
            evidence=[signal],
        )
    if signal.reason == "StartFailed":
        return _verdict(
            FaultClass.USER,
            "the pod could not start as the job asks: not retried; the job's reason says "
            "what to change",
            evidence=[signal],
        )
    if signal.reason == "NodeLost":
        return _node(", ".join(signal.nodes), "the pod's node was lost under it", signal)
    if signal.reason in NOT_STARTED_BY_CLUSTER:
        return _verdict(
            FaultClass.UNKNOWN,
            f"{NOT_STARTED_BY_CLUSTER[signal.reason]} (not the job's doing): the job goes "
            "back to the queue and spends one attempt of its retry budget",
            job=JobAction.RESTART_ELSEWHERE,
            evidence=[signal],
        )
    if signal.reason == "NodeCannotStart":
        return _verdict(
            FaultClass.UNKNOWN,
            f"node {', '.join(signal.nodes)} could not start the pod (not the job's doing): "
            "the job restarts elsewhere",
            nodes=signal.nodes,
            job=JobAction.RESTART_ELSEWHERE,
            evidence=[signal],
        )
    return None


def _rank_error(signal: PodOutcome, error: RankError) -> Verdict:
    """A rank's exception: the GPU's or the collective's (restart), or the job's own
    (out of GPU memory, an error in its code: not retried)."""
    text = f"{error.exception}: {error.message}"
    if any(m in text for m in CUDA_INFRASTRUCTURE):
        return _verdict(
            FaultClass.UNKNOWN,
            f"rank {error.rank} failed with a GPU error ({text[:200]}) and no GPU "
            "signal explains it: the job restarts",
            evidence=[signal],
        )
    if any(m in text for m in NCCL_TIMEOUT):
        return _verdict(
            FaultClass.HANG,
            f"rank {error.rank}'s collective timed out ({text[:200]}): the job restarts",
            evidence=[signal],
        )
    if any(m in text for m in OUT_OF_MEMORY):
        return _verdict(
            FaultClass.USER,
            f"rank {error.rank} ran out of GPU memory ({text[:200]}): not retried; use "
            "a smaller batch or model, or more GPUs",
            evidence=[signal],
        )
    return _verdict(
        FaultClass.USER,
        f"rank {error.rank} raised {text[:300]} in the job's code: not retried; fix the "
        "error and submit again",
        evidence=[signal],
    )


def _how(signal: PodOutcome) -> str:
    if signal.signal is not None:
        return f"signal {signal.signal}"
    parts = [f"exit {signal.exit_code}"] if signal.exit_code is not None else []
    if signal.reason:
        parts.append(signal.reason)
    return ", ".join(parts) or "no exit status"


def _hang(signal: NoProgress) -> Verdict:
    what = {
        "step": "no progress reported",
        "checkpoint": "a checkpoint started and not saved",
        "silent": "no output and idle GPUs",
    }.get(signal.kind, signal.kind)
    return _verdict(
        FaultClass.HANG,
        f"{what} for {signal.quiet_s:.0f} s (limit {signal.limit_s:.0f} s): the job is "
        "killed and restarts",
        evidence=[signal],
    )


# ------------------------------------------------------------------ hangs
@dataclass(frozen=True)
class JobProgress:
    """What the controller knows of a running attempt's progress (seconds since epoch).
    ``last_step_at`` is when its ranks last reported progress — a step with a number or
    without, whatever the number did (a counter may restart every epoch)."""

    started_at: float
    last_step_at: float | None = None
    p99_step_s: float | None = None
    checkpoint_started_at: float | None = None  # of a checkpoint not saved yet
    last_output_at: float | None = None
    gpus_idle_since: float | None = None


def hang_of(progress: JobProgress, now: float, policy: RecoveryPolicy) -> NoProgress | None:
    """The hang of a running attempt, or None: a job is hung when it stops reporting, not
    when its step number stops rising. A checkpoint in flight has its own, longer limit;
    a job that never reported progress is judged by its output and GPUs."""
    if progress.checkpoint_started_at is not None:
        quiet = now - progress.checkpoint_started_at
        if quiet > policy.checkpoint_limit_s:
            return NoProgress("checkpoint", quiet, policy.checkpoint_limit_s, now)
        return None
    if progress.last_step_at is not None:
        limit = policy.hang_floor_s
        if progress.p99_step_s is not None:
            limit = max(policy.hang_factor * progress.p99_step_s, policy.hang_floor_s)
        quiet = now - progress.last_step_at
        return NoProgress("step", quiet, limit, now) if quiet > limit else None
    if progress.gpus_idle_since is None:
        return None  # its GPUs work: it is not hung
    quiet_since = max(progress.gpus_idle_since, progress.last_output_at or progress.started_at)
    quiet = now - quiet_since
    if quiet > policy.silent_idle_s:
        return NoProgress("silent", quiet, policy.silent_idle_s, now)
    return None
