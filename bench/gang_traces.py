"""A seeded synthetic gang workload: 1,024 H100 GPUs, a critical production project that
bursts far past its guarantee, a capped research team, opportunistic scavengers.

``gang_fleet()``, ``gang_projects()`` and ``gang_trace(seed, hours)`` give what
``scheduler.simulator.simulate`` takes. The same seed gives the same trace.

- **Fleet**: 2 clusters (east, west) × 2 zones × 32 nodes × 8 H100 = 1,024 GPUs; a zone
  holds 256, so a 256-GPU gang needs a whole zone.
- **Projects**: ``prod`` guaranteed 384, no borrow limit, default priority critical;
  team ``research`` (guaranteed 384, the sum of its projects', plus a borrow limit of
  176: it holds at most 560) with ``vision`` 160 (borrow 160, lend 64), ``nlp`` 128
  (borrow 128) and ``speech`` 96 (borrow 96, lend 32). ``scavenger`` is a trace group
  the tree does not name: opportunistic, no guarantee. Guarantees cover 768 of 1,024.
- **Workload** (Poisson arrivals, sessions modulated by a day/night cycle): sessions of
  1-8 GPUs for 0.5-8 h (kind ``session``); gangs of 16-256 GPUs in pods of 8 for 1-24 h
  (durations log-uniform), 70% standard and 30% opportunistic in research; prod's base
  stream of critical gangs plus bursts of 3-6 gangs of 128-256 GPUs within 15 minutes
  (15% of the load, a few a day); scavengers submit opportunistic gangs. The offered
  load (GPU-hours submitted over GPU-hours of the fleet in the submission window) is
  about ``load`` (default 1.75; each seed draws its own).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.scheduler.inputs import TraceJob
from gpufleet.scheduler.model import FleetNode, ProjectTree, project_tree

GPU_TYPE = "H100"
CLUSTERS = ("east", "west")
ZONES = ("a", "b")
NODES_PER_ZONE = 32
GPUS_PER_NODE = 8
FLEET_GPUS = len(CLUSTERS) * len(ZONES) * NODES_PER_ZONE * GPUS_PER_NODE
HOUR = 3600.0


def gang_fleet() -> list[FleetNode]:
    return [
        FleetNode(f"{cluster}-{zone}-{i}", cluster, f"{cluster}-{zone}", GPU_TYPE, GPUS_PER_NODE)
        for cluster in CLUSTERS
        for zone in ZONES
        for i in range(NODES_PER_ZONE)
    ]


def _quota(guaranteed: int = 0, borrow: int | None = None, lend: int | None = None) -> dict:
    quota: dict[str, int] = {"guaranteed": guaranteed}
    if borrow is not None:
        quota["borrow_limit"] = borrow
    if lend is not None:
        quota["lend_limit"] = lend
    return {GPU_TYPE: quota}


def gang_projects() -> ProjectTree:
    return project_tree(
        [
            {"name": "prod", "quotas": _quota(384), "default_priority": "critical", "weight": 2},
            {"name": "research", "kind": "team", "quotas": _quota(384, borrow=176)},
            {"name": "vision", "parent": "research", "quotas": _quota(160, 160, 64)},
            {"name": "nlp", "parent": "research", "quotas": _quota(128, 128)},
            {"name": "speech", "parent": "research", "quotas": _quota(96, 96, 32)},
        ]
    )


@dataclass(frozen=True)
class _Stream:
    """One project's arrivals of one kind; ``share`` of the offered GPU-hours."""

    project: str
    kind: str  # "session" or "job"
    share: float
    sizes: Sequence[int]
    weights: Sequence[float]
    hours: tuple[float, float]  # duration range, log-uniform
    opportunistic: float = 0.0  # fraction submitted as opportunistic
    priority: str | None = None  # otherwise the project's default


SESSION_SIZES, SESSION_WEIGHTS = (1, 2, 4, 8), (0.4, 0.25, 0.2, 0.15)
GANG_SIZES, GANG_WEIGHTS = (16, 32, 64, 128, 256), (0.35, 0.3, 0.2, 0.1, 0.05)
STREAMS = (
    _Stream("prod", "job", 0.17, (32, 64, 128, 256), (0.3, 0.35, 0.25, 0.1), (1, 12)),
    _Stream("prod", "session", 0.03, SESSION_SIZES, SESSION_WEIGHTS, (0.5, 8), priority="standard"),
    _Stream("vision", "session", 0.05, SESSION_SIZES, SESSION_WEIGHTS, (0.5, 8)),
    _Stream("vision", "job", 0.13, GANG_SIZES, GANG_WEIGHTS, (1, 24), opportunistic=0.3),
    _Stream("nlp", "session", 0.04, SESSION_SIZES, SESSION_WEIGHTS, (0.5, 8)),
    _Stream("nlp", "job", 0.11, GANG_SIZES, GANG_WEIGHTS, (1, 24), opportunistic=0.3),
    _Stream("speech", "session", 0.04, SESSION_SIZES, SESSION_WEIGHTS, (0.5, 8)),
    _Stream("speech", "job", 0.08, GANG_SIZES[:4], GANG_WEIGHTS[:4], (1, 24), opportunistic=0.3),
    _Stream("scavenger", "job", 0.20, GANG_SIZES[:4], GANG_WEIGHTS[:4], (1, 24)),
)
BURST_SHARE = 0.15  # prod's bursts, of the offered GPU-hours
BURST_SIZES, BURST_WEIGHTS, BURST_HOURS = (128, 256), (0.6, 0.4), (2.0, 8.0)


def _log_uniform_mean(low: float, high: float) -> float:
    return (high - low) / math.log(high / low)


def _mean(values: Sequence[int], weights: Sequence[float]) -> float:
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


def _hours(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def gang_trace(seed: int, hours: float = 48.0, load: float = 1.75) -> list[TraceJob]:
    """The trace, in submission order; submissions fall in ``[0, hours)``."""
    rng = random.Random(seed)
    window = hours * HOUR
    offered_gpu_h = load * FLEET_GPUS * hours
    jobs: list[TraceJob] = []
    for stream in STREAMS:
        per_item = _mean(stream.sizes, stream.weights) * _log_uniform_mean(*stream.hours)
        rate = stream.share * offered_gpu_h / per_item / window  # arrivals per second
        peak = rate * 1.6 if stream.kind == "session" else rate
        at = 0.0
        while True:
            at += rng.expovariate(peak)
            if at >= window:
                break
            if stream.kind == "session":  # day/night: busier by day (thinning)
                day = 1 + 0.6 * math.sin(2 * math.pi * (at / (24 * HOUR) - 0.25))
                if rng.random() * 1.6 > day:
                    continue
            gpus = rng.choices(stream.sizes, stream.weights)[0]
            priority = stream.priority
            if stream.opportunistic and rng.random() < stream.opportunistic:
                priority = "opportunistic"
            jobs.append(
                TraceJob(
                    job_id="",
                    submit_s=round(at, 1),
                    duration_s=round(_hours(rng, *stream.hours) * HOUR, 1),
                    num_gpus=gpus,
                    group=stream.project,
                    kind=stream.kind,
                    priority=priority,
                    gpu_type=GPU_TYPE,
                    gpus_per_pod=GPUS_PER_NODE if stream.kind == "job" else None,
                )
            )
    per_burst_item = _mean(BURST_SIZES, BURST_WEIGHTS) * _log_uniform_mean(*BURST_HOURS) * 4.5
    bursts = BURST_SHARE * offered_gpu_h / per_burst_item  # expected bursts in the window
    at = 0.0
    while True:
        at += rng.expovariate(bursts / window)
        if at >= window:
            break
        for _ in range(rng.randint(3, 6)):
            jobs.append(
                TraceJob(
                    job_id="",
                    submit_s=round(min(at + rng.uniform(0, 900), window - 1), 1),
                    duration_s=round(_hours(rng, *BURST_HOURS) * HOUR, 1),
                    num_gpus=rng.choices(BURST_SIZES, BURST_WEIGHTS)[0],
                    group="prod",
                    kind="job",
                    priority="critical",
                    gpu_type=GPU_TYPE,
                    gpus_per_pod=GPUS_PER_NODE,
                )
            )
    jobs.sort(key=lambda j: (j.submit_s, j.group, j.num_gpus))
    return [
        TraceJob(
            job_id=f"{j.group}-{j.kind}-{i}",
            submit_s=j.submit_s,
            duration_s=j.duration_s,
            num_gpus=j.num_gpus,
            group=j.group,
            kind=j.kind,
            priority=j.priority,
            gpu_type=j.gpu_type,
            gpus_per_pod=j.gpus_per_pod,
        )
        for i, j in enumerate(jobs)
    ]


def offered_load(jobs: Sequence[TraceJob], hours: float) -> float:
    """GPU-hours submitted over the fleet's GPU-hours in the submission window."""
    return sum(j.num_gpus * j.duration_s for j in jobs) / HOUR / (FLEET_GPUS * hours)
