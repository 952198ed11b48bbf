"""What Kubernetes API servers say of their GPU nodes, recorded as the fleet's inventory.

A Kubernetes node is known to gpufleet from its Node object (the controller watches each
cluster) and, where gpufleet's node agent runs on it, from the agent too. The two sources
split the work:

- the Node object gives the node's place (cluster, zone), GPU type and count, readiness and
  cordon (``spec.unschedulable``: one truth, whoever set it). A cordon the recovery loop
  makes in the store is pushed to the cluster by the inventory loop
  (``recovery_cordons``); until the cluster shows it, for ``RECOVERY_CORDON_PUSH``, the
  Node's word does not undo it;
- the agent, where it runs, gives the GPUs themselves (UUIDs, samples, XIDs). Without it,
  the node's GPUs are counted slots ``k8s/<cluster>/<node>/<i>``: the device plugin chooses
  which device a pod gets, so a slot is "one of this node's GPUs", not a particular one.

Invariants: a node whose cluster's API server does not answer is ``unknown`` (no new work)
whatever else says it is fine; a node the API server no longer lists keeps its row (its
allocations refer to it) but none of its GPUs is present; every change of health, cordon
or GPU count is an event that says what Kubernetes reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from .base import Repository, _event
from .cycle import Stop
from .models import (
    Allocation,
    Cluster,
    Gpu,
    Node,
    NodeHealth,
    Workload,
    WorkloadKind,
    WorkloadState,
    Zone,
)

KUBERNETES = "kubernetes"
# A node without a gpufleet agent of its own is reported by its cluster: its ``agent``.
AGENT_PREFIX = "kubernetes:"
# How long the recovery loop's cordon of a Kubernetes node holds in the store against a
# Node that does not show it yet: the inventory loop pushes it within a pass; after this,
# a Node without it says someone uncordoned it in the cluster.
RECOVERY_CORDON_PUSH = timedelta(seconds=60)


def slot_uuid(cluster: str, node: str, index: int) -> str:
    """The stand-in id of GPU ``index`` of a node whose devices no agent reports."""
    return f"k8s/{cluster}/{node}/{index}"


def is_slot(uuid: str) -> bool:
    return uuid.startswith("k8s/")


@dataclass(frozen=True)
class ClusterNodeState:
    """What one cluster's API server says of one of its GPU nodes."""

    name: str
    zone: str
    gpu_type: str
    gpus: int  # allocatable GPUs (of the cluster's GPU resource)
    ready: bool
    unschedulable: bool
    why_not_ready: str = ""  # the Ready condition's reason and message, or the taint
    cpus: float = 0.0
    memory_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterStatus:
    name: str
    backend: str
    reachable: bool
    message: str
    since: datetime | None


class ClusterInventoryStore(Repository):
    def sync_cluster_nodes(
        self,
        now: datetime,
        cluster: str,
        states: Iterable[ClusterNodeState],
        *,
        gone: Iterable[str] = (),
        complete: bool = False,
        context: str | None = None,
    ) -> list[str]:
        """Record what ``cluster``'s API server lists: ``states`` changed or new, ``gone``
        deleted; with ``complete``, ``states`` is everything it lists and every other node
        of the cluster is gone. Returns the names of nodes whose record changed.

        A node named like one of another cluster is left alone (with an event): node names
        are the fleet's keys, and two clusters must not fight over one row.
        """
        changed: list[str] = []
        with self._write(now) as session:
            row = self._cluster_row(session, cluster, context)
            listed = {}
            for state in states:
                listed[state.name] = state
            nodes = {n.name: n for n in session.scalars(select(Node).where(Node.name.in_(listed)))}
            for name, state in listed.items():
                node = nodes.get(name)
                if node is not None and node.zone.cluster_id != row.id:
                    _name_taken(session, now, cluster, node)
                    continue
                if _apply_state(session, now, row, node, state):
                    changed.append(name)
            if complete:
                ours = session.scalars(
                    select(Node).join(Zone).where(Zone.cluster_id == row.id)
                ).all()
                gone = [*gone, *(n.name for n in ours if n.name not in listed)]
            for name in set(gone) - set(listed):
                node = session.scalar(select(Node).where(Node.name == name))
                if (
                    node is not None
                    and node.zone.cluster_id == row.id
                    and _deleted(session, now, cluster, node)
                ):
                    changed.append(name)
        return changed

    def set_cluster_reachable(
        self, now: datetime, cluster: str, reachable: bool, message: str = ""
    ) -> bool:
        """A cluster's API server stopped or started answering. Unreachable: every node of
        the cluster becomes unknown (no new work). Reachable again: the nodes stay as they
        are until the next complete listing says what they are. Returns whether anything
        changed."""
        with self._write(now) as session:
            row = self._cluster_row(session, cluster, None)
            if row.reachable == reachable:
                if not reachable and message and message != row.status_message:
                    row.status_message = message
                return False
            row.reachable = reachable
            row.status_message = message
            row.status_since = now
            nodes = session.scalars(select(Node).join(Zone).where(Zone.cluster_id == row.id))
            if reachable:
                _event(
                    session,
                    now,
                    EventKind.CLUSTER_REACHABLE,
                    f"cluster {cluster}'s API server answers again",
                    cause=cluster,
                    data={"cluster": cluster},
                )
                return True
            names = []
            for node in nodes:
                if node.health != NodeHealth.unknown:
                    node.health = NodeHealth.unknown
                    names.append(node.name)
            _event(
                session,
                now,
                EventKind.CLUSTER_UNREACHABLE,
                f"cluster {cluster}'s API server does not answer ({message}); its "
                f"{len(names)} node(s) receive no new work until it does",
                reason="api-server-unreachable",
                cause=cluster,
                data={"cluster": cluster, "nodes": names},
            )
            return True

    def stop_sessions_on_node(self, now: datetime, node: str, why: str) -> list[Stop]:
        """The sessions that hold GPUs on ``node``, which its cluster lost (``why``), become
        stopping, each with an event naming the node. Their GPUs stay allocated: they are
        released when the spawner finds the pod gone, never while it may still run."""
        stops: list[Stop] = []
        with self._write(now) as session:
            held = (
                select(Allocation.workload_id)
                .join(Node, Allocation.node_id == Node.id)
                .where(Node.name == node, Allocation.closed_at.is_(None))
            )
            workloads = session.scalars(
                select(Workload).where(
                    Workload.id.in_(held),
                    Workload.kind == WorkloadKind.session,
                    Workload.state.in_((WorkloadState.admitted, WorkloadState.running)),
                )
            ).all()
            for workload in workloads:
                reason = f"node {node} {why}"
                workload.state = WorkloadState.stopping
                workload.reason = reason
                workload.version += 1
                _event(
                    session,
                    now,
                    EventKind.NODE_LOST_SESSION,
                    f"{reason}: the session ends; its GPUs are released once its pod is gone",
                    reason="node-lost",
                    workload=workload,
                    node=node,
                )
                stops.append(
                    Stop(workload.id, "session", workload.username, workload.server_name, reason)
                )
        return stops

    def cluster_statuses(self) -> list[ClusterStatus]:
        with self.read() as session:
            return [
                ClusterStatus(c.name, c.backend, c.reachable, c.status_message, c.status_since)
                for c in session.scalars(select(Cluster).order_by(Cluster.name))
            ]

    def cluster_of_node(self, node_name: str) -> tuple[str, str] | None:
        """(cluster, backend) of a node, None if there is no such node."""
        with self.read() as session:
            found = session.execute(
                select(Cluster.name, Cluster.backend)
                .join(Zone, Zone.cluster_id == Cluster.id)
                .join(Node, Node.zone_id == Zone.id)
                .where(Node.name == node_name)
            ).first()
            return (found[0], found[1]) if found else None

    def recovery_cordons(self, now: datetime) -> list[tuple[str, str, datetime]]:
        """(node, cluster, when) of the recovery loop's cordons of Kubernetes nodes made
        within ``RECOVERY_CORDON_PUSH``: the inventory loop makes each one in its cluster."""
        with self.read() as session:
            rows = session.execute(
                select(Node.name, Cluster.name, Node.recovery_cordoned_at)
                .join(Zone, Node.zone_id == Zone.id)
                .join(Cluster, Zone.cluster_id == Cluster.id)
                .where(
                    Cluster.backend == KUBERNETES,
                    Node.cordoned.is_(True),
                    Node.recovery_cordoned_at >= now - RECOVERY_CORDON_PUSH,
                )
                .order_by(Node.name)
            ).all()
            return [(node, cluster, at) for node, cluster, at in rows if at is not None]

    def node_names(self, cluster: str) -> list[str]:
        """The names of every node the cluster has or had (a deleted node keeps its row
        while allocations refer to it), by name."""
        with self.read() as session:
            return list(
                session.scalars(
                    select(Node.name)
                    .join(Zone, Node.zone_id == Zone.id)
                    .join(Cluster, Zone.cluster_id == Cluster.id)
                    .where(Cluster.name == cluster)
                    .order_by(Node.name)
                )
            )

    def _cluster_row(self, session: Session, name: str, context: str | None) -> Cluster:
        row = session.scalar(select(Cluster).where(Cluster.name == name))
        if row is None:
            row = Cluster(name=name, backend=KUBERNETES, kube_context=context)
            session.add(row)
            session.flush()
        elif row.backend != KUBERNETES:
            row.backend = KUBERNETES
        if context is not None and row.kube_context != context:
            row.kube_context = context
        return row


def _zone(session: Session, cluster: Cluster, name: str) -> Zone:
    zone = session.scalar(select(Zone).where(Zone.cluster_id == cluster.id, Zone.name == name))
    if zone is None:
        zone = Zone(cluster=cluster, name=name)
        session.add(zone)
        session.flush()
    return zone


def _apply_state(
    session: Session, now: datetime, cluster: Cluster, node: Node | None, state: ClusterNodeState
) -> bool:
    """Bring one node's row to what its API server says; True if anything changed."""
    zone = _zone(session, cluster, state.zone)
    new = node is None
    if node is None:
        node = Node(name=state.name, zone=zone, gpu_type=state.gpu_type)
        node.agent = AGENT_PREFIX + cluster.name
        node.health = NodeHealth.unknown
        session.add(node)
        session.flush()
        _event(
            session,
            now,
            EventKind.NODE_REGISTERED,
            f"node {state.name} found in cluster {cluster.name} ({state.zone}) with "
            f"{state.gpus} × {state.gpu_type}",
            node=state.name,
            cause=cluster.name,
        )
    before = (node.zone_id, node.gpu_type, node.cpus, node.memory_bytes, node.labels)
    node.zone = zone
    node.gpu_type = state.gpu_type
    node.cpus = state.cpus
    node.memory_bytes = state.memory_bytes
    node.labels = dict(state.labels)
    changed = new or before != (
        zone.id,
        state.gpu_type,
        state.cpus,
        state.memory_bytes,
        dict(state.labels),
    )
    changed |= _cordon(session, now, cluster.name, node, state.unschedulable)
    changed |= _health(session, now, cluster, node, state)
    if _reported_by_cluster(node):
        changed |= _slots(session, now, cluster.name, node, state)
    node.last_heartbeat_at = now
    return changed


def _reported_by_cluster(node: Node) -> bool:
    """No gpufleet agent reports this node's GPUs: its cluster does, as slots."""
    return node.agent is None or node.agent.startswith(AGENT_PREFIX)


def _cordon(session: Session, now: datetime, cluster: str, node: Node, cordoned: bool) -> bool:
    if node.cordoned == cordoned:
        return False
    pushing = node.recovery_cordoned_at is not None and (
        now - node.recovery_cordoned_at < RECOVERY_CORDON_PUSH
    )
    if not cordoned and pushing:
        return False  # the recovery loop's cordon, on its way to the cluster
    node.cordoned = cordoned
    verb = "cordoned" if cordoned else "uncordoned"
    _event(
        session,
        now,
        EventKind.NODE_CORDONED if cordoned else EventKind.NODE_UNCORDONED,
        f"node {node.name} is {verb} in cluster {cluster} (spec.unschedulable)"
        + ("; it receives no new work" if cordoned else ""),
        node=node.name,
        cause=cluster,
    )
    return True


def _health(
    session: Session, now: datetime, cluster: Cluster, node: Node, state: ClusterNodeState
) -> bool:
    if not cluster.reachable:
        return False  # unknown until its API server answers (set_cluster_reachable)
    if state.ready:
        # An agent's silence (unknown) is the agent's to end: its heartbeat does.
        if node.health == NodeHealth.ok or (
            node.health == NodeHealth.unknown and not _reported_by_cluster(node)
        ):
            return False
        node.health = NodeHealth.ok
        _event(
            session,
            now,
            EventKind.NODE_READY,
            f"node {node.name} of cluster {cluster.name} is Ready",
            node=node.name,
            cause=cluster.name,
        )
        return True
    if node.health == NodeHealth.unhealthy:
        return False
    node.health = NodeHealth.unhealthy
    _event(
        session,
        now,
        EventKind.NODE_NOT_READY,
        f"node {node.name} of cluster {cluster.name} is not Ready ({state.why_not_ready}); "
        "it receives no new work",
        reason="node-not-ready",
        node=node.name,
        cause=cluster.name,
    )
    return True


def _slots(
    session: Session, now: datetime, cluster: str, node: Node, state: ClusterNodeState
) -> bool:
    """The node's GPU slots: ``state.gpus`` of them present, the rest kept but absent (an
    allocation may still hold one)."""
    slot_type = state.gpu_type
    known = {g.index: g for g in node.gpus}
    had = sum(1 for g in known.values() if g.present)
    for index in range(max(state.gpus, len(known))):
        gpu = known.get(index)
        if gpu is None:
            gpu = Gpu(uuid=slot_uuid(cluster, node.name, index), node_id=node.id, index=index)
            session.add(gpu)
        gpu.gpu_type = slot_type
        gpu.present = index < state.gpus
    if not known:
        return state.gpus > 0
    if had == state.gpus:
        return False
    _event(
        session,
        now,
        EventKind.GPU_COUNT_CHANGED,
        f"node {node.name} of cluster {cluster} offers {state.gpus} GPU(s), was {had}",
        node=node.name,
        cause=cluster,
        data={"was": had, "now": state.gpus},
    )
    return True


def _deleted(session: Session, now: datetime, cluster: str, node: Node) -> bool:
    present = [g for g in node.gpus if g.present]
    if not present and node.health == NodeHealth.unknown:
        return False
    for gpu in present:
        gpu.present = False
    node.health = NodeHealth.unknown
    _event(
        session,
        now,
        EventKind.NODE_DELETED,
        f"node {node.name} was deleted from cluster {cluster}; it receives no new work",
        reason="node-deleted",
        node=node.name,
        cause=cluster,
    )
    return True


def _name_taken(session: Session, now: datetime, cluster: str, node: Node) -> None:
    owner = node.zone.cluster.name
    _event(
        session,
        now,
        EventKind.NODE_NAME_CONFLICT,
        f"cluster {cluster} lists a node {node.name}, but a node of that name belongs to "
        f"{owner}; gpufleet ignores the second one (rename one of them)",
        reason="node-name-conflict",
        node=node.name,
        cause=cluster,
    )
