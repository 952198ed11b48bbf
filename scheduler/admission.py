"""The first admission policy: guaranteed quota and per-user cap, else wait in order.

``admit(snapshot) -> AdmissionPlan`` is pure: plain data in, decisions out, no I/O. The
quota scheduler (borrowing, priorities, preemption, gangs across nodes) replaces it later
behind the same shape.

Rules, applied to the queue in arrival order:
1. A request is admitted when its project's use of that GPU type plus the request stays
   within the project's guarantee, the user's use in that project stays within the
   project's per-user cap, and one schedulable node of that type has enough free GPUs.
   Sessions are single-pod, so a request is placed on one node: best fit, the node with the
   fewest free GPUs that still fits, so whole nodes stay free for large requests.
2. A request that cannot be admitted holds its place: later requests that compete for the
   same thing (the same project's quota, the same user's cap, or the same GPU type's free
   capacity) wait behind it, so a large request is never starved by a stream of small ones.
3. Every waiting request gets its queue position (among requests for the same GPU type) and
   a reason a person can act on.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class NodeView:
    """The GPUs of one type on one node. A node with MIG slices of several profiles (each
    its own GPU type, e.g. ``A100-80GB:1g.10gb``) appears once per type."""

    name: str
    zone: str
    gpu_type: str
    free_gpus: tuple[str, ...]  # UUIDs in device index order
    total_gpus: int
    schedulable: bool = True  # false when cordoned, unhealthy or its heartbeat is lost


@dataclass(frozen=True)
class PendingRequest:
    workload_id: int
    project: str
    username: str
    gpu_type: str
    gpus: int
    created_at: datetime


@dataclass(frozen=True)
class FleetSnapshot:
    nodes: tuple[NodeView, ...]
    queue: tuple[PendingRequest, ...]
    # (project, gpu_type) -> GPUs; a missing key means no guarantee.
    guaranteed: Mapping[tuple[str, str], int] = field(default_factory=dict)
    project_usage: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # (project, username) -> GPUs of any type held by that user in that project.
    user_usage: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # project -> per-user cap in GPUs; a missing key or None means no cap.
    user_caps: Mapping[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    workload_id: int
    node: str
    gpu_uuids: tuple[str, ...]


@dataclass(frozen=True)
class Waiting:
    workload_id: int
    position: int
    reason: str


@dataclass(frozen=True)
class AdmissionPlan:
    admissions: tuple[Admission, ...] = ()
    waiting: tuple[Waiting, ...] = ()


def _gpus(n: int, gpu_type: str) -> str:
    return f"{n} × {gpu_type}"


class WaitCause(enum.Enum):
    """Why a request waits; decides which later requests queue behind it."""

    QUOTA = "quota"  # the project's guarantee is used up
    USER_CAP = "user-cap"  # the user's cap in the project is used up
    CAPACITY = "capacity"  # no node has enough free GPUs of the type
    BEHIND = "behind"  # an earlier request holds its place


def admit(snapshot: FleetSnapshot) -> AdmissionPlan:
    free: dict[tuple[str, str], list[str]] = {
        _key(node): list(node.free_gpus) for node in snapshot.nodes if node.schedulable
    }
    nodes_by_type: dict[str, list[NodeView]] = defaultdict(list)
    for node in snapshot.nodes:
        if node.schedulable:
            nodes_by_type[node.gpu_type].append(node)
    project_usage = defaultdict(int, snapshot.project_usage)
    user_usage = defaultdict(int, snapshot.user_usage)

    # The workload at the head of each blocked resource; later requests wait behind it.
    blocked_quota: dict[tuple[str, str], int] = {}  # (project, gpu type)
    blocked_user: dict[tuple[str, str], int] = {}  # (project, username)
    blocked_capacity: dict[str, int] = {}  # gpu type
    positions: dict[str, int] = defaultdict(int)

    admissions: list[Admission] = []
    waiting: list[Waiting] = []
    for request in sorted(snapshot.queue, key=lambda r: (r.created_at, r.workload_id)):
        quota_key = (request.project, request.gpu_type)
        user_key = (request.project, request.username)
        cause, reason = _why_not_admissible(request, snapshot, project_usage, user_usage)
        if cause is None:
            cause, reason = _why_behind(request, blocked_quota, blocked_user, blocked_capacity)
        placement: NodeView | None = None
        if cause is None:
            placement = _best_fit(nodes_by_type[request.gpu_type], free, request.gpus)
            if placement is None:
                cause, reason = WaitCause.CAPACITY, _capacity_reason(request, nodes_by_type, free)
        if placement is not None:
            taken = tuple(free[_key(placement)][: request.gpus])
            del free[_key(placement)][: request.gpus]
            admissions.append(Admission(request.workload_id, placement.name, taken))
            project_usage[quota_key] += request.gpus
            user_usage[user_key] += request.gpus
            continue
        # The head of a queue holds only the queue it waits on: a user at their cap does
        # not hold back the rest of the project, nor a quota wait the user's other types.
        if cause is WaitCause.QUOTA:
            blocked_quota.setdefault(quota_key, request.workload_id)
        elif cause is WaitCause.USER_CAP:
            blocked_user.setdefault(user_key, request.workload_id)
        elif cause is WaitCause.CAPACITY:
            blocked_capacity.setdefault(request.gpu_type, request.workload_id)
        positions[request.gpu_type] += 1
        waiting.append(Waiting(request.workload_id, positions[request.gpu_type], reason))
    return AdmissionPlan(tuple(admissions), tuple(waiting))


def _why_not_admissible(
    request: PendingRequest,
    snapshot: FleetSnapshot,
    project_usage: Mapping[tuple[str, str], int],
    user_usage: Mapping[tuple[str, str], int],
) -> tuple[WaitCause | None, str]:
    key = (request.project, request.gpu_type)
    guaranteed = snapshot.guaranteed.get(key, 0)
    used = project_usage.get(key, 0)
    if used + request.gpus > guaranteed:
        return WaitCause.QUOTA, (
            f"{_gpus(request.gpus, request.gpu_type)} requested; project {request.project} "
            f"uses {used} of {guaranteed} guaranteed {request.gpu_type}"
        )
    cap = snapshot.user_caps.get(request.project)
    user_used = user_usage.get((request.project, request.username), 0)
    if cap is not None and user_used + request.gpus > cap:
        return WaitCause.USER_CAP, (
            f"{_gpus(request.gpus, request.gpu_type)} requested; {request.username} uses "
            f"{user_used} of the {cap}-GPU per-user cap in project {request.project}"
        )
    return None, ""


def _why_behind(
    request: PendingRequest,
    blocked_quota: Mapping[tuple[str, str], int],
    blocked_user: Mapping[tuple[str, str], int],
    blocked_capacity: Mapping[str, int],
) -> tuple[WaitCause | None, str]:
    if (head := blocked_quota.get((request.project, request.gpu_type))) is not None:
        what = f"an earlier request for {request.gpu_type} in project {request.project}"
    elif (head := blocked_user.get((request.project, request.username))) is not None:
        what = f"your earlier request in project {request.project}"
    elif (head := blocked_capacity.get(request.gpu_type)) is not None:
        what = f"an earlier request for {request.gpu_type} until GPUs free up"
    else:
        return None, ""
    return WaitCause.BEHIND, f"waiting behind {what} (workload {head})"


def _capacity_reason(
    request: PendingRequest,
    nodes_by_type: Mapping[str, list[NodeView]],
    free: Mapping[tuple[str, str], list[str]],
) -> str:
    nodes = nodes_by_type.get(request.gpu_type, [])
    if not nodes:
        return (
            f"{_gpus(request.gpus, request.gpu_type)} requested; no schedulable node has "
            f"{request.gpu_type} right now (cordoned, unhealthy or not reporting)"
        )
    largest = max(nodes, key=lambda n: (len(free[_key(n)]), n.name))
    total_free = sum(len(free[_key(n)]) for n in nodes)
    return (
        f"{_gpus(request.gpus, request.gpu_type)} requested on one node; the largest free "
        f"block is {len(free[_key(largest)])} on {largest.name} ({largest.zone}); "
        f"{total_free} free in all"
    )


def _best_fit(
    nodes: list[NodeView], free: Mapping[tuple[str, str], list[str]], needed: int
) -> NodeView | None:
    fitting = [node for node in nodes if len(free[_key(node)]) >= needed]
    if not fitting:
        return None
    return min(fitting, key=lambda n: (len(free[_key(n)]), n.name))


def _key(node: NodeView) -> tuple[str, str]:
    return (node.name, node.gpu_type)
