"""The recovery loop's classifier (recovery/classify.py), with literal rows: a signal and
what came before it in, the fault's class, the job's and the hardware's action, whether the
retry budget is spent and what is blamed out."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.recovery.classify import (
    AgentSilent,
    EccRising,
    FaultClass,
    GpuCountDrop,
    GpuLost,
    HardwareAction,
    JobAction,
    JobProgress,
    NodeLost,
    NoProgress,
    NvlinkErrors,
    PodOutcome,
    RankError,
    RecoveryAction,
    RecoveryPolicy,
    RemapFailure,
    Signal,
    Xid,
    classify,
    hang_of,
)

F, J, H = FaultClass, JobAction, HardwareAction
T = 10_000.0  # when the signal under test happens
GPU, PEER, OTHER = "GPU-n1-0", "GPU-n1-1", "GPU-n2-0"


def pod(
    exit_code: int | None = 1,
    *,
    signal: int | None = None,
    reason: str = "",
    error: RankError | None = None,
    at: float = T,
) -> PodOutcome:
    return PodOutcome(exit_code, signal, reason, error, (GPU, PEER), ("n1",), at)


ROWS: list[tuple[str, Signal, list[Signal], tuple[Any, ...]]] = [
    # XIDs: application faults
    (
        "xid 13 once",
        Xid(13, GPU, "n1", T),
        [],
        (F.APPLICATION, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "xid 31 once",
        Xid(31, GPU, "n1", T),
        [],
        (F.APPLICATION, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "xid 43 after xid 13 on the same GPU within the window",
        Xid(43, GPU, "n1", T),
        [Xid(13, GPU, "n1", T - 600)],
        (F.APPLICATION, J.RESTART_ELSEWHERE, H.DIAGNOSE_GPU, True, (GPU,), ()),
    ),
    (
        "xid 13 twice, but on another GPU",
        Xid(13, GPU, "n1", T),
        [Xid(13, OTHER, "n2", T - 60)],
        (F.APPLICATION, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "xid 94 twice, the first outside the window",
        Xid(94, GPU, "n1", T),
        [Xid(94, GPU, "n1", T - 3601)],
        (F.APPLICATION, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    # GPU hardware
    *[
        (
            f"xid {code}",
            Xid(code, GPU, "n1", T),
            [],
            (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (GPU,), ()),
        )
        for code in (48, 62, 64, 95, 109, 119, 120, 136, 140, 143)
    ],
    (
        "a row-remap failure",
        RemapFailure(GPU, "n1", T),
        [],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (GPU,), ()),
    ),
    (
        "NVML's GPU_RESET",
        RecoveryAction("GPU_RESET", GPU, "n1", T),
        [],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (GPU,), ()),
    ),
    (
        "NVML's DRAIN_AND_RESET",
        RecoveryAction("DRAIN_AND_RESET", GPU, "n1", T),
        [],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (GPU,), ()),
    ),
    (
        "a repeat offender: xid 48 after a remap failure 3 days ago",
        Xid(48, GPU, "n1", T),
        [RemapFailure(GPU, "n1", T - 3 * 86400)],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.LEMON_GPU, True, (GPU,), ()),
    ),
    (
        "an old hardware fault does not make a lemon",
        Xid(48, GPU, "n1", T + 8 * 86400),
        [Xid(48, GPU, "n1", T)],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (GPU,), ()),
    ),
    # node
    (
        "xid 79: fallen off the bus",
        Xid(79, GPU, "n1", T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "a GPU lost",
        GpuLost(GPU, "n1", T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "the GPU count drops",
        GpuCountDrop("n1", 8, 7, T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "NVML's NODE_REBOOT",
        RecoveryAction("NODE_REBOOT", GPU, "n1", T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "the node NotReady",
        NodeLost("n1", "not Ready (kubelet stopped posting node status)", T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "the node deleted",
        NodeLost("n1", "deleted", T),
        [],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    # degraded
    ("xid 63", Xid(63, GPU, "n1", T), [], (F.DEGRADED, J.KEEP, H.RESET_AT_IDLE, False, (GPU,), ())),
    ("xid 92", Xid(92, GPU, "n1", T), [], (F.DEGRADED, J.KEEP, H.RESET_AT_IDLE, False, (GPU,), ())),
    (
        "single-bit ECC rising",
        EccRising(GPU, "n1", T, 120.0),
        [],
        (F.DEGRADED, J.KEEP, H.RESET_AT_IDLE, False, (GPU,), ()),
    ),
    # NVLink / fabric
    (
        "xid 74 with its peers clean",
        Xid(74, GPU, "n1", T),
        [],
        (F.FABRIC, J.RESTART_ELSEWHERE, H.DIAGNOSE_GPU, True, (GPU,), ()),
    ),
    (
        "NVLink CRC errors on both ends of a link",
        NvlinkErrors(GPU, PEER, "n1", T),
        [NvlinkErrors(PEER, GPU, "n1", T - 30)],
        (F.FABRIC, J.RESTART_ELSEWHERE, H.DIAGNOSE_LINK, True, (GPU, PEER), ()),
    ),
    (
        "NVLink errors, and another link of the node erred (not this one's peer)",
        NvlinkErrors(GPU, PEER, "n1", T),
        [NvlinkErrors("GPU-n1-5", "GPU-n1-6", "n1", T - 30)],
        (F.FABRIC, J.RESTART_ELSEWHERE, H.DIAGNOSE_GPU, True, (GPU,), ()),
    ),
    # pod outcomes: hardware outranks the exit code
    (
        "exit 1 a minute after xid 48 on one of the job's GPUs",
        pod(1, error=RankError(0, "RuntimeError", "CUDA error: unspecified launch failure")),
        [Xid(48, PEER, "n1", T - 60)],
        (F.GPU_HARDWARE, J.RESTART_ELSEWHERE, H.DRAIN_AND_RESET_GPU, True, (PEER,), ()),
    ),
    (
        "exit 1 after the node's GPU fell off the bus",
        pod(1),
        [Xid(79, "GPU-n1-7", "n1", T - 5)],
        (F.NODE, J.RESTART_ELSEWHERE, H.RECYCLE_NODE, True, (), ("n1",)),
    ),
    (
        "a ValueError long after an unrelated xid 48 is the user's",
        pod(1, error=RankError(1, "ValueError", "shapes (3,) and (4,) not aligned")),
        [Xid(48, GPU, "n1", T - 3600)],
        (F.USER, J.FAIL, H.NONE, False, (), ()),
    ),
    (
        "xid 48 on another node's GPU explains nothing",
        pod(1, error=RankError(1, "ValueError", "bad value")),
        [Xid(48, OTHER, "n2", T - 10)],
        (F.USER, J.FAIL, H.NONE, False, (), ()),
    ),
    # pod outcomes: the user's errors are not retried
    (
        "a ValueError",
        pod(1, error=RankError(0, "ValueError", "bad")),
        [],
        (F.USER, J.FAIL, H.NONE, False, (), ()),
    ),
    (
        "CUDA out of memory",
        pod(
            1,
            error=RankError(
                3, "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"
            ),
        ),
        [],
        (F.USER, J.FAIL, H.NONE, False, (), ()),
    ),
    ("OOMKilled", pod(137, reason="OOMKilled"), [], (F.USER, J.FAIL, H.NONE, False, (), ())),
    ("exit 2", pod(2), [], (F.USER, J.FAIL, H.NONE, False, (), ())),
    ("exit 126", pod(126), [], (F.USER, J.FAIL, H.NONE, False, (), ())),
    ("exit 127", pod(127), [], (F.USER, J.FAIL, H.NONE, False, (), ())),
    (
        "could not start",
        pod(None, reason="StartFailed"),
        [],
        (F.USER, J.FAIL, H.NONE, False, (), ()),
    ),
    # pod outcomes: disruptions spend nothing
    (
        "preempted",
        pod(None, signal=15, reason="Preempted"),
        [],
        (F.DISRUPTION, J.RESTART_ELSEWHERE, H.NONE, False, (), ()),
    ),
    (
        "DisruptionTarget",
        pod(143, reason="DisruptionTarget"),
        [],
        (F.DISRUPTION, J.RESTART_ELSEWHERE, H.NONE, False, (), ()),
    ),
    (
        "drained",
        pod(None, signal=15, reason="Drained"),
        [],
        (F.DISRUPTION, J.RESTART_ELSEWHERE, H.NONE, False, (), ()),
    ),
    # pod outcomes: the rest restarts and spends the budget
    (
        "exit 1 with nothing to say why",
        pod(1),
        [],
        (F.UNKNOWN, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "SIGKILL from nowhere",
        pod(None, signal=9),
        [],
        (F.UNKNOWN, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "a CUDA error that is the GPU's, with no GPU signal",
        pod(
            1, error=RankError(0, "RuntimeError", "CUDA error: uncorrectable ECC error encountered")
        ),
        [],
        (F.UNKNOWN, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "an NCCL watchdog timeout",
        pod(
            1,
            error=RankError(
                2,
                "DistBackendError",
                "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)",
            ),
        ),
        [],
        (F.HANG, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    # hangs and silent agents
    (
        "no step for 20 minutes",
        NoProgress("step", 1200, 600, T),
        [],
        (F.HANG, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
    (
        "a silent node agent",
        AgentSilent("n1", 45, T),
        [],
        (F.AGENT_LOST, J.RESTART_ELSEWHERE, H.CORDON_NODE, True, (), ("n1",)),
    ),
    (
        "xid 999, unknown to the catalogue",
        Xid(999, GPU, "n1", T),
        [],
        (F.UNKNOWN, J.RESTART_IN_PLACE, H.NONE, True, (), ()),
    ),
]


@pytest.mark.parametrize(
    ("signal", "history", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_each_signal_gets_its_verdict(
    signal: Signal, history: list[Signal], expected: tuple[Any, ...]
) -> None:
    verdict = classify(signal, history)
    got = (
        verdict.fault,
        verdict.job,
        verdict.hardware,
        verdict.spends_budget,
        verdict.gpus,
        verdict.nodes,
    )
    assert got == expected, verdict.reason
    assert verdict.reason  # always something a person can read


def test_what_the_user_reads_names_the_evidence_and_the_decision() -> None:
    verdict = classify(pod(1, error=RankError(1, "ValueError", "shapes (3,) and (4,) not aligned")))
    assert verdict.reason == (
        "rank 1 raised ValueError: shapes (3,) and (4,) not aligned in the job's code: not "
        "retried; fix the error and submit again"
    )
    explained = classify(pod(1), [Xid(48, PEER, "n1", T - 60)])
    assert explained.reason.startswith("the pod ended (exit 1) 60 s after XID 48 on GPU GPU-n1-1")
    assert "the GPU is drained and reset" in explained.reason
    lemon = classify(Xid(48, GPU, "n1", T), [RemapFailure(GPU, "n1", T - 86400)])
    assert lemon.reason == (
        "XID 48 on GPU GPU-n1-0, a GPU hardware fault; 2 hardware faults of this GPU within 7 "
        "days: it goes on the lemon list (cordoned until an admin clears it) and the job "
        "restarts without it"
    )
    # The clock is the last report, whatever its step number did: it says progress.
    hung = classify(NoProgress("step", 603, 600, T))
    assert hung.reason == (
        "no progress reported for 603 s (limit 600 s): the job is killed and restarts"
    )


def test_signals_after_the_one_judged_are_not_evidence() -> None:
    later = [Xid(13, GPU, "n1", T + 10)]
    assert classify(Xid(13, GPU, "n1", T), later).job is JobAction.RESTART_IN_PLACE
    assert classify(pod(1), [Xid(48, GPU, "n1", T + 5)]).fault is FaultClass.UNKNOWN


def test_the_windows_are_the_policys() -> None:
    strict = RecoveryPolicy(repeat_window_s=60, blame_window_s=10, lemon_after=3)
    assert classify(Xid(13, GPU, "n1", T), [Xid(13, GPU, "n1", T - 120)], strict).job is (
        JobAction.RESTART_IN_PLACE
    )
    assert classify(pod(1), [Xid(48, GPU, "n1", T - 30)], strict).fault is FaultClass.UNKNOWN
    two = [RemapFailure(GPU, "n1", T - 100)]
    assert (
        classify(Xid(48, GPU, "n1", T), two, strict).hardware is HardwareAction.DRAIN_AND_RESET_GPU
    )
    three = [*two, Xid(62, GPU, "n1", T - 50)]
    assert classify(Xid(48, GPU, "n1", T), three, strict).hardware is HardwareAction.LEMON_GPU


POLICY = RecoveryPolicy(
    hang_factor=10, hang_floor_s=600, checkpoint_limit_s=1800, silent_idle_s=900
)


@pytest.mark.parametrize(
    ("progress", "now", "expected"),
    [
        # steps of 2 s at p99: the floor (600 s) is the limit
        (JobProgress(0, last_step_at=1000, p99_step_s=2), 1600, None),
        (JobProgress(0, last_step_at=1000, p99_step_s=2), 1601, ("step", 601, 600)),
        # steps of 120 s at p99: ten of them (1200 s) is the limit
        (JobProgress(0, last_step_at=1000, p99_step_s=120), 2100, None),
        (JobProgress(0, last_step_at=1000, p99_step_s=120), 2201, ("step", 1201, 1200)),
        # a checkpoint in flight has its own, longer limit
        (JobProgress(0, last_step_at=1000, p99_step_s=2, checkpoint_started_at=1000), 2700, None),
        (
            JobProgress(0, last_step_at=1000, checkpoint_started_at=1000),
            2801,
            ("checkpoint", 1801, 1800),
        ),
        # no progress API: output and GPUs
        (JobProgress(0, last_output_at=100, gpus_idle_since=50), 950, None),
        (JobProgress(0, last_output_at=100, gpus_idle_since=50), 1001, ("silent", 901, 900)),
        (JobProgress(0, last_output_at=100, gpus_idle_since=None), 99_999, None),  # GPUs busy
        (JobProgress(0, gpus_idle_since=0), 901, ("silent", 901, 900)),
    ],
)
def test_a_hang_is_no_progress_past_its_limit(
    progress: JobProgress, now: float, expected: tuple[str, float, float] | None
) -> None:
    hang = hang_of(progress, now, POLICY)
    assert (None if hang is None else (hang.kind, hang.quiet_s, hang.limit_s)) == expected
