"""What may be left of a job pod whose node agent went silent, and the GPUs it keeps held.

A node whose agent stops reporting may still run the pod's processes: the agent may have
died while its ranks live on, or the node may only be cut off. Its job does not wait for
it (``JobStore.lose_silent_nodes`` ends the attempt and the job resumes elsewhere), but the
GPUs under those processes cannot be handed to anyone else until they are known gone. So
each such GPU records the pod's process marker (``Gpu.leftover_marker``); the scheduler's
mirror leaves it out, and every agent sync of the node is told to end what carries the
marker. Only an agent's report that nothing of it runs (``gone``) returns the GPU, with an
event. A node that never comes back keeps its GPUs held until an admin removes it.

Invariants:
- a leftover is recorded in the same transaction that gives up on the pod, before its
  allocation can close, so there is no moment when the GPU is free and the process alive;
- only an agent that reports the marker's node may clear it, and only for that marker.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.processes import part_marker
from .base import _event
from .models import Allocation, Gpu, Node, Workload


@dataclass(frozen=True)
class Leftover:
    """Processes an agent must make sure are gone: those carrying ``marker`` on ``node``."""

    node: str
    marker: str
    workload_id: int


def hold_for_leftovers(
    session: Session, now: datetime, workload: Workload, pod_index: int, node: Node
) -> list[str]:
    """Keep the GPUs of ``workload``'s pod ``pod_index`` on ``node`` held for whatever of
    the pod may still run there. Returns their UUIDs."""
    marker = part_marker(workload.process_marker or "", pod_index)
    held = [
        a.gpu
        for a in workload.allocations
        if a.closed_at is None and a.pod_index == pod_index and a.node_id == node.id
    ]
    for gpu in held:
        gpu.leftover_marker = marker
        gpu.leftover_workload_id = workload.id
        gpu.leftover_since = now
    return sorted(g.uuid for g in held)


def leftovers_on(session: Session, nodes: Collection[str]) -> list[Leftover]:
    """The leftovers an agent reporting ``nodes`` must end, one per marker."""
    rows = session.execute(
        select(Node.name, Gpu.leftover_marker, Gpu.leftover_workload_id)
        .join(Node, Gpu.node_id == Node.id)
        .where(Node.name.in_(nodes), Gpu.leftover_marker.is_not(None))
        .distinct()
        .order_by(Node.name, Gpu.leftover_marker)
    ).all()
    return [Leftover(node, marker, workload or 0) for node, marker, workload in rows if marker]


def release_leftovers(
    session: Session, now: datetime, nodes: Collection[str], gone: Iterable[str]
) -> list[str]:
    """An agent of ``nodes`` found nothing carrying the markers ``gone``: their GPUs take
    work again. Returns the UUIDs released."""
    markers = set(gone)
    if not markers:
        return []
    gpus = session.scalars(
        select(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .where(Node.name.in_(nodes), Gpu.leftover_marker.in_(markers))
        .order_by(Gpu.node_id, Gpu.index)
    ).all()
    by_marker: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        by_marker.setdefault(gpu.leftover_marker or "", []).append(gpu)
    for marker, released in by_marker.items():
        first = released[0]
        node, workload_id = first.node.name, first.leftover_workload_id
        pod = marker.rpartition(".")[2]
        held_for = (now - (first.leftover_since or now)).total_seconds()
        _event(
            session,
            now,
            EventKind.GPU_LEFTOVERS_GONE,
            f"nothing of job {workload_id}'s lost pod {pod} runs on {node} any more: "
            f"{len(released)} GPU(s) held for it {held_for:.0f} s take work again"
            + (" once the node is uncordoned" if first.node.cordoned else ""),
            node=node,
            data={"uuids": [g.uuid for g in released], "workload": workload_id, "pod": pod},
        )
        for gpu in released:
            gpu.leftover_marker = gpu.leftover_workload_id = gpu.leftover_since = None
    return [g.uuid for g in gpus]


def open_allocations_on(session: Session, node: Node) -> list[Allocation]:
    return list(
        session.scalars(
            select(Allocation)
            .where(Allocation.node_id == node.id, Allocation.closed_at.is_(None))
            .order_by(Allocation.workload_id, Allocation.pod_index)
        )
    )
