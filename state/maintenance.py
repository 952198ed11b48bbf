"""Maintenance in the store: a node's recycle and diagnostics, a GPU's reset and
diagnostics, asked of the node's agent as node operations with no workload
(``state/operations.py``) once nothing runs where they would act, and what their ends do.

``maintenance_plan.py`` says what a verdict leaves due; an admin's ``recycle_node`` drains
the node and leaves a recycle due. The controller's recovery loop calls
``start_due_maintenance`` on every pass ("the next idle point" is a condition, checked
there, not a time); the agent's report of an operation's end settles it in the same
transaction (``_operation_ended``).

Invariants:
- an operation acts only where nothing runs: a node's when no open allocation and no
  leftover holds any of its GPUs, a GPU's when none holds it; a GPU reset at its next
  idle point is cordoned in the transaction that asks for it, so nothing lands on it
  while it resets;
- only a pass returns anything to service, and never a lemon; a failure, or an agent that
  stops reporting on a running operation, leaves it out of service with an event;
- what a pass returns to service is no longer avoided by any job whose faults blamed it
  (``lapse_avoidance``; docs/recovery.md, "What the job avoids");
- each step is one operation at a time (due -> in flight -> None or the next step).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from .attempts import AttemptStore, DrainStops, _node_named
from .base import Repository, _event
from .database import Database
from .maintenance_plan import BY_CLUSTER, GPU_STEPS, MAINTENANCE_KINDS, NODE_STEPS, OPERATION_OF
from .models import (
    Allocation,
    Gpu,
    Node,
    NodeHealth,
    NodeOperation,
    Workload,
    WorkloadKind,
    WorkloadState,
)

# A running operation's agent reports on it every half second; silence this long ends it.
STALE_OPERATION = timedelta(seconds=120)


class MaintenanceStore(Repository):
    def __init__(self, database: Database, attempts: AttemptStore):
        super().__init__(database)
        self.attempts = attempts
        # Clusters whose nodes are recycled by deleting the Node, for their node groups to
        # replace (``c.KubeInventory.recycle_action``): the controller does it, no agent.
        self.replacing_clusters: frozenset[str] = frozenset()

    def recycle_node(self, now: datetime, node_name: str, by: str, why: str) -> DrainStops:
        """Drain ``node_name`` (``drain_node``), recycle it once it is empty, then diagnose
        it; it returns to service if the diagnostics pass. NotFound for an unknown node."""
        with self._write(now) as session:
            node = _node_named(session, node_name)
            stops = self.attempts.drain(session, now, node, by, why or "to be recycled")
            node.maintenance, node.maintenance_by = "recycle", by
            _event(
                session,
                now,
                EventKind.NODE_MAINTENANCE_PLANNED,
                f"{by} asked for node {node_name} to be recycled: it is recycled once "
                "nothing runs there, then diagnosed; it returns to service if the "
                "diagnostics pass",
                node=node_name,
                cause=by,
            )
            return stops

    def start_due_maintenance(self, now: datetime) -> list[int]:
        """Ask the node agents for the maintenance that became possible (nothing runs
        where it acts, the node's agent reports); fail in-flight operations whose agent
        stopped reporting. Returns the operations asked for."""
        asked: list[int] = []
        # A read first: a pass with nothing due and nothing stale (nearly every pass)
        # writes nothing.
        with self.read() as session:
            due = session.scalar(
                select(func.count()).select_from(
                    select(Node.id).where(Node.maintenance.in_(NODE_STEPS)).subquery()
                )
            ) or session.scalar(
                select(func.count()).select_from(
                    select(Gpu.uuid).where(Gpu.maintenance.in_(GPU_STEPS)).subquery()
                )
            )
            stale = session.scalar(
                select(func.count()).select_from(
                    select(NodeOperation.id)
                    .where(
                        NodeOperation.workload_id.is_(None),
                        NodeOperation.state == "running",
                        NodeOperation.updated_at < now - STALE_OPERATION,
                    )
                    .subquery()
                )
            )
        if not (due or stale):
            return asked
        with self._write(now) as session:
            for row in session.scalars(
                select(NodeOperation).where(
                    NodeOperation.workload_id.is_(None),
                    NodeOperation.state == "running",
                    NodeOperation.updated_at < now - STALE_OPERATION,
                )
            ):
                row.state, row.updated_at = "failed", now
                row.error = "its node agent stopped reporting on it"
                settle_operation(session, now, row)
            held = set(
                session.scalars(select(Allocation.gpu_uuid).where(Allocation.closed_at.is_(None)))
            )

            def idle(gpus: Sequence[Gpu]) -> bool:
                return not any(g.uuid in held or g.leftover_marker for g in gpus)

            for node in session.scalars(
                select(Node).where(Node.maintenance.in_(NODE_STEPS)).order_by(Node.id)
            ):
                step = node.maintenance or ""
                if node.health == NodeHealth.ok and idle(node.gpus):
                    node.maintenance = NODE_STEPS[step]
                    replaced = (
                        step == "recycle" and node.zone.cluster.name in self.replacing_clusters
                    )
                    asked.append(_ask(session, now, node, step, list(node.gpus), "node", replaced))
            for gpu in session.scalars(
                select(Gpu).where(Gpu.maintenance.in_(GPU_STEPS)).order_by(Gpu.uuid)
            ):
                step, node = gpu.maintenance or "", gpu.node
                if node.health != NodeHealth.ok or node.maintenance or not idle([gpu]):
                    continue
                if step == "reset-at-idle":
                    gpu.cordoned = True  # nothing lands on it while it resets
                gpu.maintenance = GPU_STEPS[step]
                asked.append(_ask(session, now, node, step, [gpu], "gpu"))
        return asked


def settle_operation(session: Session, now: datetime, row: NodeOperation) -> None:
    """Settle a maintenance operation the agent ended: the next step, a return to
    service, or an event that says why it stays out."""
    if row.workload_id is not None or row.kind not in MAINTENANCE_KINDS:
        return
    request = row.request or {}
    passed = row.state == "done"
    what = f"{row.kind} of " + (
        f"node {row.node}"
        if request.get("scope") == "node"
        else f"GPU {', '.join(request.get('uuids', []))} of node {row.node}"
    )
    said = str((row.result or {}).get("summary") or "") if passed else row.error
    # What the pass returns to service: the jobs that avoid it since a fault no longer do.
    returned_nodes: list[str] = []
    returned_gpus: list[str] = []
    if request.get("scope") == "node":
        node = session.scalar(select(Node).where(Node.name == row.node))
        if node is None:
            return
        replaced = passed and bool((row.result or {}).get("replaced"))
        # A Node deleted for its node group to replace is gone: nothing left to diagnose.
        node.maintenance = "diagnose" if passed and row.kind == "recycle" and not replaced else None
        if passed and row.kind == "diagnose":
            node.cordoned = False
            node.recovery_cordoned_at = None
            returned_nodes.append(node.name)
            for gpu in node.gpus:
                if not gpu.lemon:
                    gpu.cordoned = False
                    returned_gpus.append(gpu.uuid)
        outcome = (
            "its node group replaces it (the new node joins under a name of its own)"
            if replaced
            else "its diagnostics follow"
            if node.maintenance
            else "it takes work again"
            if passed
            else "it stays cordoned until an admin acts"
        )
    else:
        gpus = [g for g in (session.get(Gpu, u) for u in request.get("uuids", [])) if g]
        for gpu in gpus:
            gpu.maintenance = None
            if passed and not gpu.lemon:
                gpu.cordoned = False
                returned_gpus.append(gpu.uuid)
        outcome = "it takes work again" if passed else "it stays out of service until an admin acts"
    lapsed = lapse_avoidance(session, returned_nodes, returned_gpus)
    if len(lapsed) == 1:
        outcome += f"; job {lapsed[0]} no longer avoids it"
    elif lapsed:
        outcome += f"; jobs {', '.join(map(str, lapsed))} no longer avoid it"
    _event(
        session,
        now,
        EventKind.MAINTENANCE_PASSED if passed else EventKind.MAINTENANCE_FAILED,
        f"{what} {'passed' if passed else 'failed'}"
        + (f" ({said})" if said else "")
        + f": {outcome}",
        reason=row.kind,
        node=row.node,
        cause=str(request.get("by") or "recovery"),
        data={
            "operation": row.id,
            **request,
            **({"no_longer_avoided_by": lapsed} if lapsed else {}),
        },
    )


def lapse_avoidance(session: Session, nodes: Sequence[str], gpus: Sequence[str]) -> list[int]:
    """Every job that avoids any of these nodes or GPUs since a fault blamed them stops
    avoiding them: they passed maintenance, so they are as healthy as any other. Returns
    the jobs changed.

    It ends what jobs avoid at this moment; hardware an attempt held cannot pass before
    that attempt's restart is queued with what it avoids: an attempt holds its GPUs (and
    with them its nodes) until every pod of it is gone, and maintenance acts only where
    nothing is held."""
    if not (nodes or gpus):
        return []
    passed_nodes, passed_gpus = set(nodes), set(gpus)
    rows = session.execute(
        select(Workload.id, Workload.recovery).where(
            Workload.kind == WorkloadKind.job,
            Workload.state != WorkloadState.ended,
            Workload.recovery.is_not(None),
        )
    ).all()
    changed: list[int] = []
    for workload_id, recovery in rows:
        avoid_nodes = list((recovery or {}).get("avoid_nodes", ()))
        avoid_gpus = list((recovery or {}).get("avoid_gpus", ()))
        kept_nodes = [n for n in avoid_nodes if n not in passed_nodes]
        kept_gpus = [g for g in avoid_gpus if g not in passed_gpus]
        if (kept_nodes, kept_gpus) == (avoid_nodes, avoid_gpus):
            continue
        workload = session.get(Workload, workload_id)
        assert workload is not None
        # A new dict: the column sees an assignment, not a change inside its value.
        workload.recovery = {
            **(workload.recovery or {}),
            "avoid_nodes": kept_nodes,
            "avoid_gpus": kept_gpus,
        }
        changed.append(workload_id)
    return changed


def _ask(
    session: Session,
    now: datetime,
    node: Node,
    step: str,
    gpus: Sequence[Gpu],
    scope: str,
    by_cluster: bool = False,
) -> int:
    """Ask for one maintenance step: of the node's agent, or (``by_cluster``: a recycle
    that deletes the Node) of the controller's inventory loop, which alone claims it."""
    kind = OPERATION_OF[step]
    request = {
        "scope": scope,
        "uuids": [g.uuid for g in gpus],
        "indexes": [g.index for g in gpus],
        "by": node.maintenance_by or "recovery" if scope == "node" else "recovery",
        **({BY_CLUSTER: True} if by_cluster else {}),
    }
    row = NodeOperation(
        workload_id=None,
        node=node.name,
        kind=kind,
        request=request,
        state="pending",
        created_at=now,
        updated_at=now,
    )
    session.add(row)
    session.flush()
    target = f"node {node.name}" if scope == "node" else f"GPU {gpus[0].uuid} of node {node.name}"
    _event(
        session,
        now,
        EventKind.MAINTENANCE_ASKED,
        f"{kind} of {target} asked of "
        + (
            "its cluster: the Node is deleted for its node group to replace"
            if by_cluster
            else "its node agent"
        ),
        reason=kind,
        node=node.name,
        cause=str(request["by"]),
        data={"operation": row.id, **request},
    )
    return row.id
