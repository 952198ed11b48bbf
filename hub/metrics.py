"""The controller's Prometheus metrics: ``gpufleet_<noun>_<verb>_<unit>``.

Gauges of the fleet are read from the database at scrape time by a custom collector, so
they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.classify import FaultClass
from ..scheduler.idle import IdleCause
from ..scheduler.snapshot import PreemptionCause
from ..state.models import (
    WORKLOAD_OUTCOMES,
    Allocation,
    Event,
    Gpu,
    Node,
    NodeHealth,
    Project,
    ProjectKind,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from ..state.progress import training_ratio
from .reconcile import Rule

if TYPE_CHECKING:
    from ..state.fleet import FleetStore


class FleetCollector(Collector):
    def __init__(self, store: FleetStore):
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # The queue, the allocations and the capacity are read at one moment: they add up.
        with self.store.read() as session:
            types = _present_types(session)
            pairs = _project_pairs(session, types)
            queued = _queued(session, pairs)
            allocated = _allocated(session, pairs)
            capacity = _capacity(session)
            health = _gpu_health(session)
        breakers = self._breakers()
        cordons = self._cordons()
        ettr = self._training_ratios()
        idle = self._idle(types)
        yield queued
        yield allocated
        yield idle
        yield ettr
        yield capacity
        yield health
        yield breakers
        yield cordons

    def _breakers(self) -> GaugeMetricFamily:
        breakers = GaugeMetricFamily(
            "gpufleet_recovery_breaker_open",
            "1 while a cluster's breaker keeps the recovery loop from cordoning its nodes",
            labels=["cluster"],
        )
        for cluster, tripped_at in self.store.jobs.breakers().items():
            breakers.add_metric([cluster], 0 if tripped_at is None else 1)
        return breakers

    def _cordons(self) -> CounterMetricFamily:
        cordons = CounterMetricFamily(
            "gpufleet_recovery_cordons",
            "Nodes and GPUs the recovery loop cordoned, by the class of the fault",
            labels=["what", "cause"],
        )
        with self.store.read() as session:
            for event_kind, cause, count in session.execute(
                select(Event.kind, Event.reason, func.count())
                .where(
                    Event.kind.in_((EventKind.NODE_CORDONED, EventKind.GPU_CORDONED)),
                    Event.cause == "recovery",
                )
                .group_by(Event.kind, Event.reason)
            ):
                cordons.add_metric([event_kind.removesuffix("-cordoned"), cause], count)
        return cordons

    def _training_ratios(self) -> GaugeMetricFamily:
        ettr = GaugeMetricFamily(
            "gpufleet_job_effective_training_ratio",
            "Each live job's effective training time ratio so far: the share of the time "
            "since its first step not lost to faults, preemptions and drains",
            labels=["job", "name", "project"],
        )
        now = datetime.now(UTC)
        with self.store.read() as session:
            for job_id, name, project, recovery in session.execute(
                select(Workload.id, Workload.name, Project.name, Workload.recovery)
                .join(Project, Workload.project_id == Project.id)
                .where(Workload.kind == WorkloadKind.job, Workload.state != WorkloadState.ended)
            ):
                ratio = training_ratio(recovery, now)
                if ratio is not None:
                    ettr.add_metric([str(job_id), name, project], ratio)
        return ettr

    def _idle(self, types: Sequence[str]) -> GaugeMetricFamily:
        idle = GaugeMetricFamily(
            "gpufleet_idle_gpus",
            "Free GPUs of a type work waits for, after the last admission cycle, by why "
            "nothing waiting uses them (docs/simulator.md, 'Idle while waiting, by why')",
            labels=["gpu_type", "cause"],
        )
        # A type nothing waits for has no free GPU while work waits: 0 for it, not "no data".
        found: dict[str, Mapping[IdleCause, int]] = {gpu_type: {} for gpu_type in types}
        found |= self.store.scheduling.idle_gpus()
        for gpu_type, causes in sorted(found.items()):
            for cause in IdleCause:
                idle.add_metric([gpu_type, cause.value], causes.get(cause, 0))
        return idle


def _present_types(session: Session) -> list[str]:
    """The GPU types of the GPUs present: the per-type series exist at 0 for each, so a
    panel shows 0, not "no data", while nothing waits or runs."""
    return sorted(
        session.scalars(select(Gpu.gpu_type).where(Gpu.present.is_(True)).distinct()).all()
    )


def _project_pairs(session: Session, types: Sequence[str]) -> list[tuple[str, str]]:
    """Every (project, GPU type) of the fleet, for the per-project series' zeros."""
    projects = session.scalars(
        select(Project.name).where(Project.kind != ProjectKind.organisation)
    ).all()
    return [(project, gpu_type) for project in sorted(projects) for gpu_type in types]


def _queued(session: Session, pairs: Sequence[tuple[str, str]]) -> GaugeMetricFamily:
    queued = GaugeMetricFamily(
        "gpufleet_queue_workloads",
        "Workloads waiting for GPUs",
        labels=["project", "gpu_type", "kind"],
    )
    counts = {
        (project, gpu_type, kind.value): count
        for project, gpu_type, kind, count in session.execute(
            select(Project.name, Workload.gpu_type, Workload.kind, func.count())
            .join(Project, Workload.project_id == Project.id)
            .where(Workload.state == WorkloadState.pending)
            .group_by(Project.name, Workload.gpu_type, Workload.kind)
        )
    }
    for project, gpu_type in pairs:
        for kind in WorkloadKind:
            counts.setdefault((project, gpu_type, kind.value), 0)
    for labels, count in sorted(counts.items()):
        queued.add_metric(list(labels), count)
    return queued


def _allocated(session: Session, pairs: Sequence[tuple[str, str]]) -> GaugeMetricFamily:
    allocated = GaugeMetricFamily(
        "gpufleet_allocated_gpus", "GPUs allocated now", labels=["project", "gpu_type"]
    )
    counts = dict.fromkeys(pairs, 0)
    for project, gpu_type, count in session.execute(
        select(Project.name, Allocation.gpu_type, func.count())
        .join(Project, Allocation.project_id == Project.id)
        .where(Allocation.closed_at.is_(None))
        .group_by(Project.name, Allocation.gpu_type)
    ):
        counts[(project, gpu_type)] = count
    for (project, gpu_type), count in sorted(counts.items()):
        allocated.add_metric([project, gpu_type], count)
    return allocated


def _capacity(session: Session) -> GaugeMetricFamily:
    capacity = GaugeMetricFamily(
        "gpufleet_capacity_gpus",
        "GPUs present on nodes, by health",
        labels=["gpu_type", "health"],
    )
    for gpu_type, health, count in session.execute(
        select(Gpu.gpu_type, Node.health, func.count())
        .join(Node, Gpu.node_id == Node.id)
        .where(Gpu.present.is_(True))
        .group_by(Gpu.gpu_type, Node.health)
    ):
        capacity.add_metric([gpu_type, health.value], count)
    return capacity


def gpu_health_state(gpu: Gpu, node: Node) -> str:
    """The recovery loop's verdict on a GPU, worst first: ``lemon`` (repeated hardware
    faults: out of service until an admin clears it), ``cordoned`` (it or its node takes no
    new work), ``suspect`` (lost, a reset or diagnosis due or under way, or its node not
    healthy or not heard from), else ``healthy``."""
    if gpu.lemon:
        return "lemon"
    if gpu.cordoned or node.cordoned:
        return "cordoned"
    if gpu.lost or gpu.maintenance is not None or node.health != NodeHealth.ok:
        return "suspect"
    return "healthy"


def _gpu_health(session: Session) -> GaugeMetricFamily:
    # One series per GPU, whose ``state`` label is its verdict now: a GPU costs one series
    # (not one per state), and changes series only when its verdict changes.
    health = GaugeMetricFamily(
        "gpufleet_gpu_health",
        "Each GPU's health as the recovery loop judges it (state: healthy, suspect, "
        "cordoned or lemon; docs/monitoring.md)",
        labels=["Hostname", "gpu", "UUID", "gpu_type", "state"],
    )
    for gpu, node in session.execute(
        select(Gpu, Node)
        .join(Node, Gpu.node_id == Node.id)
        .where(Gpu.present.is_(True))
        .order_by(Node.name, Gpu.index)
    ):
        state = gpu_health_state(gpu, node)
        health.add_metric([node.name, str(gpu.index), gpu.uuid, gpu.gpu_type, state], 1)
    return health


class ControllerMetrics:
    def __init__(self, store: FleetStore):
        self.registry = CollectorRegistry()
        self.registry.register(FleetCollector(store))
        self.cycle_duration = Histogram(
            "gpufleet_admission_cycle_duration_seconds",
            "Time to read the fleet, decide and commit one admission cycle",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.admissions = Counter(
            "gpufleet_admissions_total",
            "Workloads admitted",
            ["gpu_type"],
            registry=self.registry,
        )
        self.wait_time = Histogram(
            "gpufleet_queue_wait_seconds",
            "Time from request to admission",
            ["project"],
            buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpufleet_preemptions_total",
            "Workloads the scheduler stopped to make room, by cause",
            ["cause"],
            registry=self.registry,
        )
        for cause in PreemptionCause:  # every series exists from the start
            self.preemptions.labels(cause.value)
        self.ended = Counter(
            "gpufleet_workloads_ended_total",
            "Workloads ended, by outcome",
            ["kind", "outcome"],
            registry=self.registry,
        )
        for kind in WorkloadKind:  # every series exists from the start
            for outcome in WORKLOAD_OUTCOMES:
                self.ended.labels(kind.value, outcome)
        self.job_restarts = Counter(
            "gpufleet_job_restarts_total",
            "Jobs that went back to the queue as their next attempt, by the class of what "
            "ended the attempt (docs/recovery.md)",
            ["reason"],
            registry=self.registry,
        )
        for fault in FaultClass:  # every series exists from the start
            self.job_restarts.labels(fault.value)
        self.job_resume = Histogram(
            "gpufleet_job_resume_seconds",
            "From what ended a job's attempt (a fault, a preemption, a drain) to the first "
            "step of its next attempt",
            buckets=(5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600),
            registry=self.registry,
        )
        self.repairs = Counter(
            "gpufleet_reconciler_repairs_total",
            "Repairs the reconciler made, by rule (docs/reconciler.md)",
            ["rule"],
            registry=self.registry,
        )
        for rule in Rule:  # every series exists from the start
            self.repairs.labels(rule.value)
