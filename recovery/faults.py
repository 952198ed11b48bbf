"""Faults injected into one long training job on a virtual clock, and the effective
training time ratio (ETTR) each recovery policy gets out of it.

``simulate_job(job, costs, policy, seed)`` draws faults from a fault model (Llama 3's
classes and rates by default: 419 unplanned interruptions in 54 days on 16,384 GPUs) and
follows the job from fault to fault: how long until the fault is noticed, what the policy
does about it, how long until the job steps again, and how much work since its last
checkpoint is lost. The fixed costs are the same for every policy and stated in the
output (``Costs``); what differs is detection, classification, placement and spares:

- ``gpufleet``: the controller's own rules. Each fault becomes the signal the node agent or
  the job would give (an XID, a lost node, a pod's exit, a missed step) and goes through
  ``classify`` and ``next_attempt`` — the code the controller runs. A GPU or node fault
  is acted on within seconds and the job restarts without the node, on a spare when the
  zone keeps one (lent to preemptible work, taken back within its stop grace), else once
  the node is repaired; a hang is found by its missed steps.
- ``restart-any``: torchrun's ``--max-restarts`` without classification. A crash of its own
  ranks restarts them at once, but a GPU or node fault leaves the other ranks waiting out
  NCCL's timeout, and the restart lands on the same, still faulty, node: the job is down
  until a person swaps the node out.
- ``manual``: a person notices each fault (their response time) and restarts the job,
  swapping out a faulty node.

ETTR = the time the job spent making progress it kept / the wall time. Checkpoints are
asynchronous and cost ``checkpoint_s`` of stall each, at Young's interval
(``sqrt(2 × checkpoint_s × MTBF)``) for the job's MTBF.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from .attempts import AttemptRecord, GiveUp, RetryPolicy, next_attempt
from .classify import (
    JobAction,
    NodeLost,
    NoProgress,
    PodOutcome,
    RankError,
    RecoveryPolicy,
    Signal,
    Xid,
    classify,
)

Policy = Literal["gpufleet", "restart-any", "manual"]
POLICIES: tuple[Policy, ...] = ("gpufleet", "restart-any", "manual")
# How a fault shows: a GPU's XID, its host going down, a crash of the job's own ranks, a
# collective that stops (network, NIC), NCCL's watchdog firing, or nothing at all (silent
# data corruption, noticed later in the loss curve).
Shows = Literal["gpu", "host", "crash", "hang", "nccl", "silent"]


@dataclass(frozen=True)
class FaultKind:
    name: str
    count: int  # how many the model's reference run saw
    shows: Shows


@dataclass(frozen=True)
class FaultModel:
    kinds: tuple[FaultKind, ...]
    gpus: int  # the reference run: this many GPUs ...
    days: float  # ... for this long

    @property
    def per_gpu_second(self) -> float:
        return sum(k.count for k in self.kinds) / (self.gpus * self.days * 86400.0)

    def mtbf_s(self, gpus: int) -> float:
        return 1.0 / (self.per_gpu_second * gpus)


# Llama 3 405B's pre-training (Meta, "The Llama 3 Herd of Models", table 5): 419
# unexpected interruptions in a 54-day snapshot on 16,384 H100s; 16 of them not in the
# classes listed are taken as crashes.
LLAMA3 = FaultModel(
    kinds=(
        FaultKind("faulty GPU", 148, "gpu"),
        FaultKind("GPU HBM3 memory", 72, "gpu"),
        FaultKind("software bug", 54, "crash"),
        FaultKind("network switch or cable", 35, "hang"),
        FaultKind("host maintenance", 32, "host"),
        FaultKind("GPU SRAM memory", 19, "gpu"),
        FaultKind("GPU system processor", 17, "gpu"),
        FaultKind("NIC", 7, "hang"),
        FaultKind("NCCL watchdog timeout", 7, "nccl"),
        FaultKind("silent data corruption", 6, "silent"),
        FaultKind("GPU thermal interface or sensor", 6, "gpu"),
        FaultKind("other", 16, "crash"),
    ),
    gpus=16384,
    days=54.0,
)
XID_OF = {"faulty GPU": 48, "GPU HBM3 memory": 48, "GPU SRAM memory": 48}  # else 119 (GSP)


@dataclass(frozen=True)
class Costs:
    """What every policy pays alike (seconds)."""

    checkpoint_s: float = 5.0  # an asynchronous checkpoint's stall
    restart_s: float = 60.0  # restart the processes and load the checkpoint
    node_loss_timeout_s: float = 30.0  # a host that went down is noticed after this
    nccl_timeout_s: float = 600.0  # NCCL's watchdog: a stuck collective ends after this
    act_s: float = 5.0  # a signal on the node to the ranks' SIGTERM (measured: <= 5 s)
    step_s: float = 5.0  # one training step (the hang limit is a multiple of it)
    human_median_s: float = 1800.0  # a person's response time: lognormal, this median ...
    human_sigma: float = 0.8  # ... and this spread of its logarithm
    spare_grace_s: float = 30.0  # the preemptible work on a spare stops within this
    repair_s: float = 3600.0  # a faulty node drained, reset or replaced, back in service
    silent_detect_s: float = 3600.0  # silent data corruption noticed in the loss curve


@dataclass(frozen=True)
class Job:
    gpus: int
    gpus_per_node: int = 8
    spares: int = 0  # spare nodes kept in its zone (0: none)
    days: float = 54.0
    model: FaultModel = LLAMA3

    @property
    def checkpoint_interval_s(self) -> float:
        """Young's interval for its MTBF."""
        return math.sqrt(2 * Costs.checkpoint_s * self.model.mtbf_s(self.gpus))


@dataclass
class Outcome:
    policy: Policy
    ettr: float
    faults: int
    down_s: float  # from each fault to the first step after it
    lost_s: float  # work done since the last checkpoint before each fault
    checkpoint_s: float  # stalls for checkpoints
    gave_up: int = 0  # times gpufleet's budget ended the job (a person resubmitted it)
    by_shows: dict[str, float] = field(default_factory=dict)  # down time per kind of fault


def simulate_job(job: Job, costs: Costs, policy: Policy, seed: int) -> Outcome:
    # Faults and people draw from streams of their own: the same seed gives every policy
    # the same kinds of faults, in the same order, on the same nodes.
    rng, people = random.Random(seed), random.Random(seed + 1_000_003)
    horizon = job.days * 86400.0
    rate = job.model.per_gpu_second * job.gpus
    weights = [k.count for k in job.model.kinds]
    interval = math.sqrt(2 * costs.checkpoint_s * job.model.mtbf_s(job.gpus))
    retry, recovery = RetryPolicy(), RecoveryPolicy()
    record = AttemptRecord(attempt=1, gpus=job.gpus)
    spares_free_at = [0.0] * job.spares  # when each spare node is back in the zone
    now = 0.0
    outcome = Outcome(policy, 0.0, 0, 0.0, 0.0, 0.0)
    running_since = 0.0
    while True:
        fault_at = now + rng.expovariate(rate)
        if fault_at >= horizon:
            break
        kind = rng.choices(job.model.kinds, weights)[0]
        outcome.faults += 1
        # Work since the last checkpoint of this run is lost.
        outcome.lost_s += (fault_at - running_since) % interval
        node = f"node-{rng.randrange(job.gpus // job.gpus_per_node)}"
        if policy == "gpufleet":
            signal = _signal(kind, node, fault_at, costs, recovery)
            verdict = classify(signal, (), recovery)
            elsewhere = verdict.job is JobAction.RESTART_ELSEWHERE and bool(verdict.nodes)
            detect = _detection(kind, costs, recovery)
            down = detect + costs.restart_s
            down += _replacement(elsewhere, fault_at + detect, costs, spares_free_at, True)
            step = next_attempt(record, verdict, retry, fault_at)
            if isinstance(step, GiveUp):
                outcome.gave_up += 1
                down += _human(costs, people)  # a person reads why and submits again
                record = AttemptRecord(attempt=1, gpus=job.gpus)
            else:
                down += step.delay_s
                record = AttemptRecord(
                    attempt=step.attempt,
                    fault_times=step.fault_times,
                    gpus=job.gpus,
                    ran_s=fault_at - running_since,
                    quick_faults=step.quick_faults,
                )
        else:
            down = _downtime(kind, fault_at, costs, policy, people, spares_free_at)
        outcome.down_s += down
        outcome.by_shows[kind.shows] = outcome.by_shows.get(kind.shows, 0.0) + down
        now = running_since = fault_at + down
    wall = horizon
    productive_s = max(0.0, wall - outcome.down_s - outcome.lost_s)
    checkpoints = productive_s / interval
    outcome.checkpoint_s = checkpoints * costs.checkpoint_s
    outcome.ettr = max(0.0, productive_s - outcome.checkpoint_s) / wall
    return outcome


def _downtime(
    kind: FaultKind,
    at: float,
    costs: Costs,
    policy: Policy,
    people: random.Random,
    spares_free_at: list[float],
) -> float:
    """From the fault to the job's first step after it, for the baselines."""
    bad_node = kind.shows in ("gpu", "host")
    if policy == "manual":
        noticed = _human(costs, people)
        return (
            noticed
            + _replacement(bad_node, at + noticed, costs, spares_free_at)
            + (costs.restart_s)
        )
    if policy == "restart-any":
        if kind.shows == "crash":
            return costs.act_s + costs.restart_s
        if kind.shows in ("hang", "nccl"):
            return costs.nccl_timeout_s + costs.restart_s
        if kind.shows == "silent":
            return costs.silent_detect_s + costs.restart_s
        # A GPU or host fault: the other ranks wait out NCCL's timeout, the restart lands
        # on the same node and fails again; a person swaps the node out.
        first = costs.nccl_timeout_s if kind.shows == "gpu" else costs.node_loss_timeout_s
        noticed = first + _human(costs, people)
        return noticed + _replacement(True, at + noticed, costs, spares_free_at) + (costs.restart_s)
    raise ValueError(f"no baseline policy {policy!r}")


def _detection(kind: FaultKind, costs: Costs, recovery: RecoveryPolicy) -> float:
    """How long gpufleet takes from the fault to acting on it."""
    return {
        "gpu": costs.act_s,  # the XID, posted at once, stops the ranks
        "host": costs.node_loss_timeout_s,
        "crash": costs.act_s,  # the pod's exit, in the agent's next sync
        "hang": _hang_limit(costs, recovery),
        "nccl": costs.nccl_timeout_s,  # NCCL's own watchdog ends the ranks
        "silent": costs.silent_detect_s,
    }[kind.shows]


def _replacement(
    needed: bool,
    at: float,
    costs: Costs,
    spares_free_at: list[float],
    grace: bool = False,
) -> float:
    """The wait for a node in place of the faulty one: a spare of the zone if one is in
    service (lent to preemptible work: ``spare_grace_s`` to take it back, overlapping
    the restart), else the faulty node's repair. The faulty node, once repaired, becomes
    the zone's spare."""
    if not needed:
        return 0.0
    for i, free_at in enumerate(spares_free_at):
        if free_at <= at:
            spares_free_at[i] = at + costs.repair_s  # the faulty one is repaired as a spare
            return max(0.0, costs.spare_grace_s - costs.restart_s) if grace else 0.0
    return costs.repair_s


def _human(costs: Costs, rng: random.Random) -> float:
    return rng.lognormvariate(math.log(costs.human_median_s), costs.human_sigma)


def _hang_limit(costs: Costs, policy: RecoveryPolicy) -> float:
    return max(policy.hang_factor * costs.step_s, policy.hang_floor_s)


def _signal(
    kind: FaultKind, node: str, at: float, costs: Costs, recovery: RecoveryPolicy
) -> Signal:
    """What the controller would see of the fault."""
    gpu = f"{node}/gpu-0"
    if kind.shows == "gpu":
        return Xid(XID_OF.get(kind.name, 119), gpu, node, at)
    if kind.shows == "host":
        return NodeLost(node, "its host rebooted", at)
    if kind.shows == "hang":
        limit = _hang_limit(costs, recovery)
        return NoProgress("step", limit, limit, at)
    if kind.shows == "nccl":
        error = RankError(0, "DistBackendError", "Watchdog caught collective operation timeout")
        return PodOutcome(1, None, "", error, (gpu,), (node,), at)
    return PodOutcome(1, None, "", None, (gpu,), (node,), at)  # a crash, or found corrupt


def ettr_table(
    gpus: int, spares: int, costs: Costs, seeds: int = 20, days: float = 54.0
) -> dict[Policy, Outcome]:
    """Each policy's mean outcome over ``seeds`` runs of the same faults."""
    job = Job(gpus=gpus, spares=spares, days=days)
    table: dict[Policy, Outcome] = {}
    for policy in POLICIES:
        runs = [simulate_job(job, costs, policy, seed) for seed in range(seeds)]
        mean = Outcome(
            policy,
            sum(r.ettr for r in runs) / seeds,
            round(sum(r.faults for r in runs) / seeds),
            sum(r.down_s for r in runs) / seeds,
            sum(r.lost_s for r in runs) / seeds,
            sum(r.checkpoint_s for r in runs) / seeds,
            sum(r.gave_up for r in runs),
        )
        for r in runs:
            for shows, down in r.by_shows.items():
                mean.by_shows[shows] = mean.by_shows.get(shows, 0.0) + down / seeds
        table[policy] = mean
    return table
