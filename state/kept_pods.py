"""A restart that keeps a gang's healthy pods (docs/kubernetes.md, "What a restart keeps").

A job on Kubernetes whose pod is lost (deleted, evicted, its node lost) restarts from its
last checkpoint as its next attempt. Its other pods run on healthy nodes: their launchers
run the next attempt's torchrun in place (``clusters/pod_launcher.py``), so only the lost
pods are placed again, here and now, in the gang's zone, without a trip through the queue.
Where they cannot be, the whole gang restarts through the queue as before.

The invariants, besides those of every next attempt (``state/next_attempt.py``):

- it is all one transaction: the lost pods' GPUs close (or stay held as leftovers where
  something of them may still run), the new pods' GPUs open, the attempt begins;
- the nodes whose GPUs it takes or gives back are marked changed (``note_changes``), so a
  scheduling cycle planned before it and placing work there drops its commit: no GPU is
  handed out twice;
- only a restart the retry policy grants at once, with no back-off, keeps pods, and only
  pods that run on nodes and GPUs its verdict does not blame.

The GPUs this takes are those the scheduler would see free (``state/mirror.py`` reads the
same columns), left out those promised to a workload waiting for its victims, and those
the verdict blames. After a fault, empty nodes come first (they are what the recovery
spares are made of, and a spare is there for this), then the fullest node that fits, as
bin-packing does; after a disruption (a pod deleted or evicted), only the latter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery.attempts import Resume, RetryPolicy, next_attempt
from ..recovery.classify import FaultClass, Verdict
from .base import _event
from .clusters import KUBERNETES
from .leftovers import hold_for_leftovers
from .mirror import note_changes
from .models import (
    Allocation,
    Cluster,
    Gpu,
    JobPod,
    Node,
    NodeHealth,
    Workload,
    WorkloadState,
    Zone,
)
from .next_attempt import attempt_record, begin_next_attempt, pods_of, restarting_event

# What a pod ended by, in the cluster manager's words, that leaves its gang's other pods
# able to go on (their node is not in doubt, their ranks did nothing wrong).
GONE_CAUSES = frozenset({"Deleted", "Evicted", "NodeLost", "DisruptionTarget"})


def restart_keeping(
    session: Session,
    now: datetime,
    workload: Workload,
    verdict: Verdict,
    lost: Mapping[int, tuple[Node, bool]],
    told: tuple[EventKind, str],
    retry_policy: RetryPolicy,
) -> bool:
    """The job's next attempt at once, keeping its running pods where they are and
    placing only the ``lost`` ones again (index -> its node, and whether something of
    it may still run there); False, with nothing written, where it cannot be done so
    (see the module docstring): the caller stops the whole gang instead. ``told``: the
    event that says what went wrong, as the whole gang's stop would have said it."""
    rows = {p.pod_index: p for p in session.scalars(pods_of(workload.id))}
    kept = _keepable(session, workload, lost, rows)
    if kept is None:
        return False
    held = [a for a in workload.allocations if a.closed_at is None]
    step = next_attempt(
        attempt_record(session, now, workload), verdict, retry_policy, now.timestamp()
    )
    if not isinstance(step, Resume) or step.delay_s:
        return False
    staying = [a for a in held if a.pod_index not in lost]
    if any(a.node.name in step.avoid_nodes or a.gpu_uuid in step.avoid_gpus for a in staying):
        return False
    going = [a for a in held if a.pod_index in lost]
    freed = [a.gpu_uuid for a in going if not lost[a.pod_index][1]]
    recovering = verdict.fault is not FaultClass.DISRUPTION
    placed = find_replacements(
        session, workload, sorted(lost), freed, step.avoid_nodes, step.avoid_gpus, recovering
    )
    if placed is None:
        return False
    for index, (node, may_run) in sorted(lost.items()):
        if may_run:  # before the marker changes: the leftover carries the old one's
            hold_for_leftovers(session, now, workload, index, node)
    for allocation in going:
        allocation.closed_at = now
    for index in lost:
        if index in rows:
            session.delete(rows[index])
    kind, what = told
    _event(
        session,
        now,
        kind,
        f"attempt {workload.attempt}: {what}; the other pods are kept for the next attempt",
        reason=verdict.fault.value,
        workload=workload,
        node=going[0].node.name if going else None,
        data={"attempt": workload.attempt, "verdict": verdict.reason, "lost": sorted(lost)},
    )
    # The attempt that made each kept pod (its name is that attempt's), by index.
    before = (workload.recovery or {}).get("pods_made_by") or {}
    made_by = {str(i): int(before.get(str(i), workload.attempt)) for i in kept}  # JSON keys
    begin_next_attempt(session, now, workload, verdict, step)
    workload.recovery = {**(workload.recovery or {}), "pods_made_by": made_by}
    _allocate(session, now, workload, placed)
    note_changes(session, {("node", a.node_id) for a in going})
    workload.state = WorkloadState.running
    workload.started_at = now
    moved = ", ".join(f"pod {r.pod_index} on {r.node.name}" for r in placed)
    said = (
        f"{step.message}; pods {', '.join(map(str, kept))} keep their nodes and run it "
        f"in place, {moved} is placed anew"
    )
    workload.reason = f"attempt {step.attempt}: {said}"
    restarting_event(
        session,
        now,
        workload,
        verdict,
        step,
        said,
        kept=kept,
        replaced={str(r.pod_index): r.node.name for r in placed},
    )
    return True


def _keepable(
    session: Session, workload: Workload, lost: Mapping[int, object], rows: Mapping[int, JobPod]
) -> list[int] | None:
    """The pods a restart could keep (every one not lost runs, on Kubernetes); None if
    there is nothing to keep."""
    if workload.pods < 2:
        return None
    kept = [i for i in range(workload.pods) if i not in lost]
    if not kept or any(rows.get(i) is None or rows[i].state != "running" for i in kept):
        return None
    held = {a.node_id for a in workload.allocations if a.closed_at is None}
    return kept if held and on_kubernetes(session, held) else None


def _allocate(
    session: Session, now: datetime, workload: Workload, placed: Sequence[Replacement]
) -> None:
    for replacement in placed:
        for gpu in replacement.gpus:
            session.add(
                Allocation(
                    workload_id=workload.id,
                    gpu_uuid=gpu.uuid,
                    node_id=replacement.node.id,
                    pod_index=replacement.pod_index,
                    project_id=workload.project_id,
                    username=workload.username,
                    gpu_type=gpu.gpu_type,
                    opened_at=now,
                )
            )
    # A cycle planned before this commit may have placed work on these GPUs: its commit
    # must see their nodes changed, and drop itself.
    note_changes(session, {("node", r.node.id) for r in placed})


@dataclass(frozen=True)
class Replacement:
    pod_index: int
    node: Node
    gpus: tuple[Gpu, ...]


def on_kubernetes(session: Session, node_ids: Collection[int]) -> bool:
    """Whether every one of the nodes is in a Kubernetes cluster (whose manager keeps pods)."""
    backends = session.scalars(
        select(Cluster.backend)
        .join(Zone, Zone.cluster_id == Cluster.id)
        .join(Node, Node.zone_id == Zone.id)
        .where(Node.id.in_(node_ids))
        .distinct()
    ).all()
    return bool(backends) and set(backends) == {KUBERNETES}


def find_replacements(
    session: Session,
    workload: Workload,
    lost: Sequence[int],
    freed: Collection[str],
    avoid_nodes: Collection[str],
    avoid_gpus: Collection[str],
    spares_first: bool = True,
) -> list[Replacement] | None:
    """A node and GPUs for each of the ``lost`` pods in the zone of the job's other pods;
    None when they do not all fit. ``freed``: GPUs of the lost pods that go back now.
    ``spares_first``: empty nodes before the fullest that fits (after a fault, as the
    recovery spares are for; a disruption only bin-packs)."""
    kept = [a for a in workload.allocations if a.closed_at is None and a.pod_index not in lost]
    zones = {a.node.zone_id for a in kept}
    if len(zones) != 1:
        return None
    [zone] = zones
    held = set(
        session.scalars(
            select(Allocation.gpu_uuid)
            .join(Node, Allocation.node_id == Node.id)
            .where(Allocation.closed_at.is_(None), Node.zone_id == zone)
        )
    ) - set(freed)
    for promised in session.scalars(
        select(Workload.promised).where(
            Workload.state == WorkloadState.pending, Workload.promised.is_not(None)
        )
    ):
        held.update(str(g) for _, gpus in (promised or {}).get("pods", ()) for g in gpus)
    busy_nodes = _nodes_with_work(session, zone, freed)
    free: dict[int, list[Gpu]] = defaultdict(list)
    nodes: dict[int, Node] = {}
    for gpu, node in session.execute(
        select(Gpu, Node)
        .join(Node, Gpu.node_id == Node.id)
        .where(
            Node.zone_id == zone,
            Node.health == NodeHealth.ok,
            Node.cordoned.is_(False),
            Gpu.gpu_type == workload.gpu_type,
            Gpu.present.is_(True),
            Gpu.lost.is_(False),
            Gpu.cordoned.is_(False),
            Gpu.leftover_marker.is_(None),
        )
        .order_by(Node.name, Gpu.index)
    ).all():
        if gpu.uuid in held or gpu.uuid in avoid_gpus or node.name in avoid_nodes:
            continue
        free[node.id].append(gpu)
        nodes[node.id] = node
    placed: list[Replacement] = []
    for index in sorted(lost):
        fits = [n for n, gpus in free.items() if len(gpus) >= workload.gpus_per_pod]
        if not fits:
            return None
        best = min(
            fits, key=lambda n: (spares_first and n in busy_nodes, len(free[n]), nodes[n].name)
        )
        taken, free[best] = (
            free[best][: workload.gpus_per_pod],
            free[best][workload.gpus_per_pod :],
        )
        busy_nodes.add(best)
        placed.append(Replacement(index, nodes[best], tuple(taken)))
    return placed


def _nodes_with_work(session: Session, zone: int, freed: Collection[str]) -> set[int]:
    counts: Mapping[int, int] = dict(
        session.execute(
            select(Allocation.node_id, func.count())
            .join(Node, Allocation.node_id == Node.id)
            .where(
                Allocation.closed_at.is_(None),
                Node.zone_id == zone,
                Allocation.gpu_uuid.not_in(list(freed)),
            )
            .group_by(Allocation.node_id)
        ).all()
    )
    return {node for node, count in counts.items() if count}
