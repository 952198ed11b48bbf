"""The scheduler's in-memory copy of the fleet, kept current from the database by changes.

Building a snapshot from scratch reads every node, GPU, allocation and open workload: at
16,000 GPUs and 10,000 waiting workloads that alone takes longer than a whole cycle may.
So the controller keeps the snapshot's parts in memory and, before each cycle, re-reads
only what changed since the last one.

What changed is known exactly: every ORM write of the store goes through a session of
the store's own factory, whose ``after_flush`` hook notes the workloads, nodes and quota
rows a transaction touched; the note becomes "dirty" only when that transaction commits
(a rolled-back one changed nothing). Readings that do not matter to the scheduler —
heartbeat times, GPU samples — are not changes. The scheduling cycle's own bulk writes
bypass the hook: the cycle applies its decisions to the mirror itself, after they commit.

The mirror is rebuilt from scratch when it may have missed something: on the first cycle,
when this controller takes the lease over (another one may have written), and after a
cycle failed to commit.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import event, inspect, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from ..scheduler.holds import hand_back_holds
from ..scheduler.model import Project as TreeProject
from ..scheduler.model import ProjectTree, Quota
from ..scheduler.snapshot import (
    NodeState,
    Pending,
    Plan,
    Pod,
    Policy,
    Running,
    SchedulingSnapshot,
    WaitCause,
)
from ..scheduler.tracked import ChangeStream
from .models import (
    Allocation,
    Cluster,
    Gpu,
    Node,
    NodeHealth,
    PriorityClass,
    Project,
    ProjectQuota,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)

# Columns whose changes the scheduler does not read.
_QUIET = {
    Node: {"last_heartbeat_at", "agent"},
    Gpu: {"sampled_at", "last_sample", "busy_at"},
    Workload: {"lease_expires_at", "snapshot_pending_since", "snapshot_sources", "spec"},
}
# A dirty mark that makes the next refresh read the whole database.
EVERYTHING = ("all", 0)


class ChangeTracker:
    """Notes what committed transactions of one session factory changed.

    Safe from any thread: the event loop's handlers, the worker threads that write, and
    the thread the scheduling cycle plans in all use it, under one lock."""

    def __init__(self, factory: sessionmaker[Session]):
        self.dirty: set[tuple[str, int]] = {EVERYTHING}
        # What each open transaction has flushed, by session: committing, or about to.
        self._flushed: dict[int, set[tuple[str, int]]] = {}
        self._lock = threading.Lock()
        event.listen(factory, "after_flush", self._after_flush)
        event.listen(factory, "after_commit", self._after_commit)
        event.listen(factory, "after_soft_rollback", self._after_rollback)
        event.listen(factory, "after_transaction_end", self._after_transaction_end)

    def take(self) -> set[tuple[str, int]]:
        with self._lock:
            dirty, self.dirty = self.dirty, set()
        return dirty

    def everything(self) -> None:
        with self._lock:
            self.dirty.add(EVERYTHING)

    def since_take(self) -> set[tuple[str, int]]:
        """What committed since the last ``take``, and what open transactions flushed: a
        transaction whose database commit is done but whose ``after_commit`` has not run
        yet is among the latter. A superset (a flushed transaction may still roll back)."""
        with self._lock:
            return self.dirty.union(*self._flushed.values())

    def _after_flush(self, session: Session, _context: Any) -> None:
        objects = (*session.new, *session.dirty, *session.deleted)
        changes = {change for obj in objects for change in _changes(obj, session)}
        with self._lock:
            noted = session.info.setdefault("gpufleet_changes", set())
            noted.update(changes)
            self._flushed[id(session)] = noted

    def _after_commit(self, session: Session) -> None:
        with self._lock:
            self.dirty |= session.info.pop("gpufleet_changes", set())
            self._flushed.pop(id(session), None)

    def _after_rollback(self, session: Session, _previous: Any) -> None:
        with self._lock:
            session.info.pop("gpufleet_changes", None)
            self._flushed.pop(id(session), None)

    def _after_transaction_end(self, session: Session, transaction: Any) -> None:
        if transaction.parent is None:  # a session closed without commit or rollback too
            with self._lock:
                self._flushed.pop(id(session), None)


def note_changes(session: Session, changes: Iterable[tuple[str, int]]) -> None:
    """Changes the transaction of ``session`` makes that its objects do not show: a GPU
    taken on a node by an allocation marks only the allocation's workload by itself."""
    session.info.setdefault("gpufleet_changes", set()).update(changes)


def _changes(obj: Any, session: Session) -> Iterable[tuple[str, int]]:
    quiet = _QUIET.get(type(obj))
    if quiet and obj in session.dirty:
        changed = {a.key for a in inspect(obj).attrs if a.history.has_changes()}
        if changed <= quiet:
            return ()
    if isinstance(obj, Workload):
        return (("workload", obj.id),)
    if isinstance(obj, Allocation):
        # Its node's free GPUs follow from the workloads' allocations: re-reading the
        # workload rebuilds the nodes it held and holds (``_read_workloads``).
        return (("workload", obj.workload_id),)
    if isinstance(obj, Node):
        return (("node", obj.id),)
    if isinstance(obj, Gpu):
        return (("node", obj.node_id),)
    if isinstance(obj, Project | ProjectQuota | PriorityClass):
        return (("tree", 0),)
    if isinstance(obj, Zone | Cluster):
        return (EVERYTHING,)
    return ()


@dataclass
class _NodeRecord:
    name: str
    cluster: str
    zone: str
    schedulable: bool
    labels: dict[str, str]
    gpus: list[tuple[str, str]]  # (uuid, GPU type) of its usable GPUs, in index order


@dataclass(frozen=True)
class Shown:
    """What a waiting workload's row says now, to write only what a person would notice."""

    cause: WaitCause
    reason: str
    position: int
    written_at: float


class Mirror:
    def __init__(self) -> None:
        # Waiting workload -> the zone held for it by the last plan (``Plan.held``), handed
        # back as ``Pending.held_zone`` so that the hold stays put. Each cycle's commit
        # writes its changes to the rows (``Workload.held_cluster``, ``held_zone``), so a
        # restarted controller reads them back and keeps holding what has drained.
        self.holding: dict[int, tuple[str, str]] = {}
        self._clear()

    def _clear(self) -> None:
        self.nodes: dict[int, _NodeRecord] = {}
        self.node_ids: dict[str, int] = {}
        self.states: dict[int, tuple[NodeState, ...]] = {}
        # Every change to these goes to the planner's memo with the next snapshot; a new
        # stream after a full read (the memo then reads that snapshot whole).
        self.stream = ChangeStream()
        self.running = self.stream.running
        self.pending = self.stream.queue
        # Jobs whose next attempt waits out its back-off: out of the queue until then.
        self.backing_off: dict[int, float] = {}
        # Waiting next attempts that must avoid nodes or GPUs earlier faults blamed (and
        # that have not passed maintenance since: the store drops those from the row):
        # what they avoid. Only what is in service counts (``_avoiding``): a blamed node
        # that is cordoned is out of reach anyway, and a request with nothing to avoid
        # keeps the whole policy — holding a zone, preempting — that a particular one
        # does without.
        self.avoiding: dict[int, tuple[frozenset[str], frozenset[str]]] = {}
        self.now = 0.0
        self.project_ids: dict[str, int] = {}
        self.shown: dict[int, Shown] = {}
        self.server_names: dict[int, str] = {}
        self.taken: dict[str, int] = {}  # GPU uuid -> workload holding it
        self.tree = ProjectTree({})
        self.priorities: dict[str, int] = {}
        self.preemptible: dict[str, bool] = {}

    # --------------------------------------------------------------- reading
    def refresh(self, session: Session, dirty: set[tuple[str, int]], now: float) -> None:
        """Re-read what changed (everything, when ``EVERYTHING`` is among it), and the
        jobs whose back-off ended by ``now``."""
        self.now = now
        dirty = dirty | {("workload", w) for w, until in self.backing_off.items() if until <= now}
        if EVERYTHING in dirty:
            self._clear()
            self._read_tree(session)
            self._read_nodes(session, None)
            self._read_workloads(session, None)
            for node_id in self.nodes:
                self._rebuild(node_id)
            return
        if ("tree", 0) in dirty:
            self._read_tree(session)
        workloads = [i for kind, i in dirty if kind == "workload"]
        touched = self._read_workloads(session, workloads) if workloads else set()
        nodes = {i for kind, i in dirty if kind == "node"}
        if nodes:
            self._read_nodes(session, nodes)
        for node_id in touched - nodes:
            self._rebuild(node_id)

    def _read_tree(self, session: Session) -> None:
        projects = session.scalars(select(Project).options(selectinload(Project.quotas))).all()
        names = {p.id: p.name for p in projects}
        self.project_ids = {p.name: p.id for p in projects}
        tree: dict[str, TreeProject] = {}
        by_id = {p.id: p for p in projects}
        for project in sorted(projects, key=lambda p: _depth(p, by_id)):
            tree[project.name] = TreeProject(
                name=project.name,
                parent=names.get(project.parent_id) if project.parent_id else None,
                kind=project.kind.value,
                quotas={
                    q.gpu_type: Quota(q.guaranteed, q.borrow_limit, q.lend_limit)
                    for q in project.quotas
                },
                weight=project.fair_share_weight,
                default_priority=project.default_priority,
                per_user_cap=project.per_user_gpu_cap,
            )
        self.tree = ProjectTree(tree)
        classes = session.scalars(select(PriorityClass)).all()
        self.priorities = {c.name: c.rank for c in classes}
        self.preemptible = {c.name: c.preemptible_by_default for c in classes}

    def _read_nodes(self, session: Session, ids: set[int] | None) -> None:
        """Re-read nodes and their usable GPUs (rows, not ORM objects, as for workloads)."""
        nodes = (
            select(
                Node.id, Node.name, Cluster.name, Zone.name, Node.health, Node.cordoned, Node.labels
            )
            .join(Zone, Node.zone_id == Zone.id)
            .join(Cluster, Zone.cluster_id == Cluster.id)
        )
        gpus = select(Gpu.node_id, Gpu.uuid, Gpu.gpu_type).where(
            Gpu.present.is_(True),
            Gpu.lost.is_(False),
            Gpu.cordoned.is_(False),
            Gpu.leftover_marker.is_(None),
        )
        if ids is not None:
            nodes = nodes.where(Node.id.in_(ids))
            gpus = gpus.where(Gpu.node_id.in_(ids))
        usable: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for node_id, uuid, gpu_type in session.execute(gpus.order_by(Gpu.node_id, Gpu.index)):
            usable[node_id].append((uuid, gpu_type))
        found = False
        for node_id, name, cluster, zone, health, cordoned, labels in session.execute(nodes):
            found = True
            self.node_ids[name] = node_id
            self.nodes[node_id] = _NodeRecord(
                name=name,
                cluster=cluster,
                zone=zone,
                schedulable=health == NodeHealth.ok and not cordoned,
                labels={str(k): str(v) for k, v in (labels or {}).items()},
                gpus=usable.get(node_id, []),
            )
            self._rebuild(node_id)
        if found and self.avoiding:
            in_service = self._in_service()
            for workload_id in self.avoiding:
                request = self.pending.get(workload_id)
                if request is not None:
                    fresh = self._avoiding(request, in_service)
                    if fresh != request:
                        self.pending[workload_id] = fresh

    def _in_service(self) -> tuple[set[str], set[str]]:
        """The schedulable nodes' names and their usable GPUs (one pass over the fleet,
        for all the requests that avoid something)."""
        nodes = [r for r in self.nodes.values() if r.schedulable]
        return {r.name for r in nodes}, {uuid for r in nodes for uuid, _ in r.gpus}

    def _avoiding(self, request: Pending, in_service: tuple[set[str], set[str]]) -> Pending:
        """``request`` avoiding what its faults blamed that is in service now."""
        nodes, gpus = self.avoiding.get(request.id, (frozenset(), frozenset()))
        avoid_nodes = frozenset(n for n in nodes if n in in_service[0])
        avoid_gpus = frozenset(g for g in gpus if g in in_service[1])
        if (avoid_nodes, avoid_gpus) == (request.avoid_nodes, request.avoid_gpus):
            return request
        return replace(request, avoid_nodes=avoid_nodes, avoid_gpus=avoid_gpus)

    def _read_workloads(self, session: Session, ids: list[int] | None) -> set[int]:
        """Re-read workloads (rows, not ORM objects: a full read is 10,000s of them);
        returns the nodes whose free GPUs changed."""
        rows = select(*_WORKLOAD_COLUMNS, Project.name).join(Project)
        allocations = select(
            Allocation.workload_id, Allocation.pod_index, Allocation.node_id, Allocation.gpu_uuid
        ).where(Allocation.closed_at.is_(None))
        if ids is None:
            rows = rows.where(Workload.state != WorkloadState.ended)
        else:
            rows = rows.where(Workload.id.in_(ids))
            allocations = allocations.where(Allocation.workload_id.in_(ids))
        pods: dict[int, dict[tuple[int, int], list[str]]] = defaultdict(lambda: defaultdict(list))
        for workload_id, pod_index, node_id, uuid in session.execute(
            allocations.order_by(Allocation.gpu_uuid)
        ):
            pods[workload_id][(pod_index, node_id)].append(uuid)
        touched: set[int] = set()
        in_service: tuple[set[str], set[str]] | None = None  # read when first needed
        for row in session.execute(rows):
            workload = _Row._make(row)
            touched |= self._forget(workload.id)
            if workload.state == WorkloadState.ended:
                continue
            self.server_names[workload.id] = workload.server_name
            if workload.state == WorkloadState.pending:
                until = workload.not_before.timestamp() if workload.not_before else None
                if until is not None and until > self.now:
                    self.backing_off[workload.id] = until
                else:
                    request = _pending(workload)
                    if request.avoid_nodes or request.avoid_gpus:
                        self.avoiding[workload.id] = (request.avoid_nodes, request.avoid_gpus)
                        if in_service is None:
                            in_service = self._in_service()
                        request = self._avoiding(request, in_service)
                    held_zone = self.holding.get(workload.id)
                    if held_zone is None and workload.held_cluster and workload.held_zone:
                        # Held by a cycle before this process started (see ``holding``).
                        held_zone = (workload.held_cluster, workload.held_zone)
                        self.holding[workload.id] = held_zone
                    if held_zone is not None:
                        request = replace(request, held_zone=held_zone)
                    self.pending[workload.id] = request
                continue
            held = pods.get(workload.id, {})
            for (_, node_id), uuids in held.items():
                for uuid in uuids:
                    self.taken[uuid] = workload.id
                touched.add(node_id)
            self.running[workload.id] = _running(workload, held, self.nodes)
        return touched

    def _forget(self, workload_id: int) -> set[int]:
        self.pending.pop(workload_id, None)
        self.backing_off.pop(workload_id, None)
        self.avoiding.pop(workload_id, None)
        self.shown.pop(workload_id, None)
        self.server_names.pop(workload_id, None)
        old = self.running.pop(workload_id, None)
        if old is None:
            return set()
        touched = set()
        for pod in old.pods:
            for uuid in pod.gpus:
                # Only if still this workload's: two workloads that swapped GPUs (the GPU
                # read-back, state/readback.py) are re-read in any order.
                if self.taken.get(uuid) == workload_id:
                    del self.taken[uuid]
            touched.add(self.node_ids[pod.node])
        return touched

    def _rebuild(self, node_id: int) -> None:
        record = self.nodes.get(node_id)
        if record is None:
            return
        by_type: dict[str, list[str]] = defaultdict(list)
        free: dict[str, list[str]] = defaultdict(list)
        for uuid, gpu_type in record.gpus:
            by_type[gpu_type].append(uuid)
            if uuid not in self.taken:
                free[gpu_type].append(uuid)
        self.states[node_id] = tuple(
            NodeState(
                record.name,
                record.cluster,
                record.zone,
                gpu_type,
                len(uuids),
                tuple(free[gpu_type]),
                record.schedulable,
                record.labels,
            )
            for gpu_type, uuids in sorted(by_type.items())
        )

    # -------------------------------------------------------------- the cycle
    def snapshot(self, policy: Policy) -> SchedulingSnapshot:
        return SchedulingSnapshot(
            nodes=tuple(s for states in self.states.values() for s in states),
            running=tuple(self.running.values()),
            queue=tuple(self.pending.values()),
            projects=self.tree,
            priorities=self.priorities,
            preemptible=self.preemptible,
            policy=policy,
            changes=self.stream.changes(),
        )

    def apply(self, plan: Plan, now: float, shown: dict[int, Shown]) -> None:
        """The decisions of a committed plan (the cycle wrote them with bulk statements,
        which the change tracker does not see)."""
        touched: set[int] = set()
        for admission in plan.admissions:
            request = self.pending.pop(admission.workload_id)
            self.shown.pop(request.id, None)
            for pod in admission.pods:
                for uuid in pod.gpus:
                    self.taken[uuid] = request.id
                touched.add(self.node_ids[pod.node])
            self.running[request.id] = Running(
                id=request.id,
                project=request.project,
                user=request.user,
                kind=request.kind,
                gpu_type=request.gpu_type,
                cluster=admission.cluster,
                zone=admission.zone,
                pods=admission.pods,
                priority=request.priority,
                preemptible=self.preemptible.get(request.priority, False),
                started_at=now,
                created_at=request.created_at,
            )
        for kept in plan.kept:
            self.pending[kept.workload_id] = replace(
                self.pending[kept.workload_id], promised=kept.pods
            )
        self.holding = hand_back_holds(self.pending, self.holding, plan)
        for preemption in plan.preemptions:
            victim = self.running[preemption.victim_id]
            self.running[victim.id] = replace(
                victim, stopping=True, stopping_for=preemption.for_workload_id
            )
        self.shown.update(shown)
        for node_id in touched:
            self._rebuild(node_id)


def _depth(project: Project, by_id: dict[int, Project]) -> int:
    depth, parent = 0, project.parent_id
    while parent is not None:
        depth += 1
        parent = by_id[parent].parent_id
    return depth


_WORKLOAD_COLUMNS = (
    Workload.id,
    Workload.kind,
    Workload.username,
    Workload.server_name,
    Workload.gpu_type,
    Workload.pods,
    Workload.gpus_per_pod,
    Workload.priority_class,
    Workload.preemptible,
    Workload.state,
    Workload.created_at,
    Workload.admitted_at,
    Workload.started_at,
    Workload.idle_since,
    Workload.last_checkpoint_at,
    Workload.last_snapshot_at,
    Workload.preempted_for_id,
    Workload.promised,
    Workload.not_before,
    Workload.recovery,
    Workload.held_cluster,
    Workload.held_zone,
)


class _Row(NamedTuple):
    """One workload as the scheduler reads it (the columns above, then its project)."""

    id: int
    kind: WorkloadKind
    username: str
    server_name: str
    gpu_type: str
    pods: int
    gpus_per_pod: int
    priority_class: str
    preemptible: bool
    state: WorkloadState
    created_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    idle_since: datetime | None
    last_checkpoint_at: datetime | None
    last_snapshot_at: datetime | None
    preempted_for_id: int | None
    promised: dict[str, Any] | None
    not_before: datetime | None
    recovery: dict[str, Any] | None
    held_cluster: str | None
    held_zone: str | None
    project: str


def _pending(workload: _Row) -> Pending:
    return Pending(
        id=workload.id,
        project=workload.project,
        user=workload.username,
        kind=workload.kind.value,
        gpu_type=workload.gpu_type,
        gpus_per_pod=workload.gpus_per_pod,
        pods=workload.pods,
        priority=workload.priority_class,
        created_at=workload.created_at.timestamp(),
        promised=promised_pods(workload.promised),
        avoid_nodes=frozenset((workload.recovery or {}).get("avoid_nodes", ())),
        avoid_gpus=frozenset((workload.recovery or {}).get("avoid_gpus", ())),
        recovering=bool((workload.recovery or {}).get("recovering")),
    )


def _running(
    workload: _Row, pods: dict[tuple[int, int], list[str]], nodes: dict[int, _NodeRecord]
) -> Running:
    placed = tuple(
        Pod(nodes[node_id].name, tuple(uuids)) for (_, node_id), uuids in sorted(pods.items())
    )
    first = nodes[min(pods)[1]] if pods else None
    progress = [
        t for t in (workload.last_checkpoint_at, workload.last_snapshot_at) if t is not None
    ]
    started = workload.started_at or workload.admitted_at or workload.created_at
    return Running(
        id=workload.id,
        project=workload.project,
        user=workload.username,
        kind=workload.kind.value,
        gpu_type=workload.gpu_type,
        cluster=first.cluster if first else "",
        zone=first.zone if first else "",
        pods=placed,
        priority=workload.priority_class,
        preemptible=workload.preemptible,
        started_at=started.timestamp(),
        last_progress_at=max(progress).timestamp() if progress else None,
        idle_reclaimable=workload.idle_since is not None,
        stopping=workload.state == WorkloadState.stopping,
        stopping_for=workload.preempted_for_id,
        created_at=workload.created_at.timestamp(),
    )


def promised_json(pods: tuple[Pod, ...]) -> dict[str, Any]:
    return {"pods": [[pod.node, list(pod.gpus)] for pod in pods]}


def promised_pods(value: dict[str, Any] | None) -> tuple[Pod, ...]:
    if not value:
        return ()
    return tuple(Pod(str(node), tuple(str(g) for g in gpus)) for node, gpus in value["pods"])
