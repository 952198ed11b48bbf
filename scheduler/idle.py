"""Why free GPUs sit idle while work waits (pure): the simulator integrates it over a
replay (``Summary.idle_while_waiting_by_cause``) and the controller exports it after each
cycle (``gpufleet_idle_gpus``), so an admin can tell the scheduler's own shortfall from
what the quotas, the held zones and the shapes of the waiting gangs cost
(docs/simulator.md, "Idle while waiting, by why").

Each zone's free GPUs (less those kept for a preemptor) go to the first ``IdleCause``,
in its order, that one of the waiting requests whose gang fits them (each pod on one node
of the zone) has; none fitting is ``SHAPE``.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import replace

from .model import ProjectTree
from .quota import QuotaBook, QuotaLimits
from .snapshot import Mode, NodeState, Pending, Plan, SchedulingSnapshot


class IdleCause(enum.StrEnum):
    """Why free GPUs of a type some request waits for are not used, in the order a
    zone's free GPUs are put down to them."""

    STOPPING = "stopping"  # kept for a preemptor while its victims stop
    OUT_OF_SERVICE = "out-of-service"  # on a node out of service (cordoned, unhealthy)
    SCHEDULER = "scheduler"  # a request the quotas admit fits them, and waits
    HELD = "held"  # in a zone held for a gang; what fits may not enter it
    LEND_LIMITS = "lend-limits"  # what fits is kept from them by others' lend limits
    CAPS = "caps"  # only requests a cap on their path refuses fit
    SHAPE = "shape"  # no waiting request's pods fit them


# (project, GPU type, GPUs per pod, pods): a waiting request as far as fitting counts.
WaitingShape = tuple[str, str, int, int]
# (project, GPU type, GPUs): what one workload holds, as the quotas count it.
Usage = tuple[str, str, int]


def waiting_shape(request: Pending) -> WaitingShape:
    return (request.project, request.gpu_type, request.gpus_per_pod, request.pods)


def kept_gpus(waiting: Iterable[Pending]) -> set[str]:
    """The GPUs kept for waiting preemptors (``Pending.promised``)."""
    return {g for request in waiting for pod in request.promised for g in pod.gpus}


def idle_by_cause(
    nodes: Iterable[NodeState],
    waiting: Iterable[WaitingShape],
    usage: Iterable[Usage],
    kept: set[str],
    held_zones: set[tuple[str, str, str]],
    tree: ProjectTree,
    limits: QuotaLimits,
) -> Counter[IdleCause]:
    """The free GPUs of the types in ``waiting`` by why they are idle. ``nodes``: all of
    the fleet's (its schedulable GPUs are the quotas' capacity, as the planner counts
    them); ``kept``: free GPUs kept for preemptors; ``held_zones``: (cluster, zone, type)
    held for a gang; ``usage``: what runs, for the quotas (per-user caps are not read)."""
    shapes = set(waiting)
    types = {shape[1] for shape in shapes}
    zones: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    found: Counter[IdleCause] = Counter()
    free_by_type: Counter[str] = Counter()
    capacity: Counter[str] = Counter()
    for node in nodes:
        if node.gpu_type not in types:
            continue
        if node.schedulable:
            capacity[node.gpu_type] += node.total
        free = sum(1 for g in node.free if g not in kept)
        if free < len(node.free):
            found[IdleCause.STOPPING] += len(node.free) - free
        if not free:
            continue
        if not node.schedulable:
            found[IdleCause.OUT_OF_SERVICE] += free
        else:
            zones[(node.cluster, node.zone, node.gpu_type)].append(free)
            free_by_type[node.gpu_type] += free
    if not zones:
        return found
    book = QuotaBook(tree, usage, capacity, limits)

    def cause_of(shape: WaitingShape) -> IdleCause:
        project, gpu_type, per_pod, pods = shape
        gpus = per_pod * pods
        if not book.within_guarantee(project, gpu_type, gpus) and book.over_cap(
            project, gpu_type, gpus
        ):
            return IdleCause.CAPS
        if free_by_type[gpu_type] - book.withheld_from(project, gpu_type) < gpus:
            return IdleCause.LEND_LIMITS
        return IdleCause.SCHEDULER

    causes = {shape: cause_of(shape) for shape in shapes}
    order = list(IdleCause)
    for zone, frees in zones.items():
        fitting = [
            cause
            for (_, gpu_type, per_pod, pods), cause in causes.items()
            if gpu_type == zone[2] and sum(free // per_pod for free in frees) >= pods
        ]
        cause = min(fitting, key=order.index, default=IdleCause.SHAPE)
        if cause is IdleCause.SCHEDULER and zone in held_zones:
            cause = IdleCause.HELD
        found[cause] += sum(frees)
    return found


def idle_after_plan(
    snapshot: SchedulingSnapshot, plan: Plan, limits: QuotaLimits | None = None
) -> dict[str, Counter[IdleCause]]:
    """Per GPU type some request still waits for once ``plan`` (decided on ``snapshot``)
    is carried out, its free GPUs by why they stay idle. Empty unless the policy is
    gpufleet's (the causes are its quotas')."""
    if snapshot.policy.mode is not Mode.GPUFLEET:
        return {}
    admitted = {a.workload_id for a in plan.admissions}
    waiting = [r for r in snapshot.queue if r.id not in admitted]
    if not waiting:
        return {}
    taken = {g for a in plan.admissions for pod in a.pods for g in pod.gpus}
    kept = kept_gpus(waiting)
    kept.update(g for k in plan.kept for pod in k.pods for g in pod.gpus)
    nodes = list(snapshot.nodes)
    if taken:
        nodes = [
            replace(n, free=tuple(g for g in n.free if g not in taken))
            if taken.intersection(n.free)
            else n
            for n in nodes
        ]
    usage: list[Usage] = [(r.project, r.gpu_type, r.gpus) for r in snapshot.running]
    usage.extend((r.project, r.gpu_type, r.gpus) for r in snapshot.queue if r.id in admitted)
    limits = limits if limits is not None and limits.tree is snapshot.projects else None
    limits = limits or QuotaLimits(snapshot.projects)
    by_type: dict[str, list[WaitingShape]] = defaultdict(list)
    for request in waiting:
        by_type[request.gpu_type].append(waiting_shape(request))
    return {
        gpu_type: idle_by_cause(
            (n for n in nodes if n.gpu_type == gpu_type),
            shapes,
            usage,
            kept,
            set(plan.held),
            snapshot.projects,
            limits,
        )
        for gpu_type, shapes in sorted(by_type.items())
    }
