"""What node agents report: nodes, GPUs, heartbeats, samples and XID events.

Each sample also becomes a row of each GPU's history (``gpu_history``: utilisation and
memory over time, what the pages chart), thinned with age by :func:`history_to_drop` in
the same transaction that writes it. The rule (docs/monitoring.md): every sample of the
last hour, one a minute for the day, one per 10 minutes for the week, nothing older, and
never more than ``HISTORY_MAX_POINTS`` rows of one GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..scheduler.errors import NotFound
from .base import Repository, _event
from .clusters import AGENT_PREFIX, is_slot
from .models import Cluster, Gpu, GpuHistoryPoint, Node, NodeHealth, Zone


@dataclass(frozen=True)
class GpuSpec:
    uuid: str
    index: int
    pci_bus_id: str = ""
    memory_bytes: int = 0
    gpu_type: str | None = None  # a MIG slice names its own type; None: the node's


@dataclass(frozen=True)
class NodeSpec:
    """What a node agent reports about one node."""

    name: str
    cluster: str
    zone: str  # empty: the zone the node has in its cluster, or "default" for a new node
    gpu_type: str
    gpus: tuple[GpuSpec, ...]
    cpus: float = 0.0
    memory_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HistoryTier:
    """Points younger than ``younger_than`` are kept one per ``every`` (aligned to the
    epoch: 09:00, 09:01, ...); ``every=None`` keeps every sample."""

    younger_than: timedelta
    every: timedelta | None


# From the youngest: what ``gpu_history`` keeps of each GPU. Older than the last: nothing.
HISTORY_TIERS = (
    HistoryTier(timedelta(hours=1), None),
    HistoryTier(timedelta(days=1), timedelta(minutes=1)),
    HistoryTier(timedelta(days=7), timedelta(minutes=10)),
)
# The hard bound per GPU, whatever the agent's sample interval: the oldest rows go first.
# At the default interval (5 s) the tiers keep at most 720 + 1,380 + 864 = 2,964 rows.
HISTORY_MAX_POINTS = 5000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def history_to_drop(
    times: Sequence[datetime], now: datetime, tiers: Sequence[HistoryTier] = HISTORY_TIERS
) -> list[int]:
    """The positions in ``times`` (one GPU's points, oldest first) that the tiers no
    longer keep at ``now``.

    A point is kept unless it is older than the last tier, or an earlier kept point lies
    in the same ``every``-long bucket of its tier. Buckets are aligned to the epoch and each
    tier's ``every`` divides the next one's, so the point kept for a minute is also the one
    kept for its 10 minutes: applying the rule again, later or to any run of points that
    starts on a bucket boundary, drops only what has aged since.
    """
    drop: list[int] = []
    kept_in: set[tuple[timedelta, int]] = set()
    for position, at in enumerate(times):
        age = now - at
        tier = next((t for t in tiers if age < t.younger_than), None)
        if tier is None:
            drop.append(position)
            continue
        if tier.every is None:
            continue
        bucket = (tier.every, (at - _EPOCH) // tier.every)
        if bucket in kept_in:
            drop.append(position)
        else:
            kept_in.add(bucket)
    return drop


def _history_windows(
    previous: datetime | None, now: datetime, tiers: Sequence[HistoryTier]
) -> list[tuple[datetime, datetime]]:
    """The spans of one GPU's history whose points crossed a tier's age since the
    previous thinning (at or after the minute of ``previous``), each starting on a
    boundary of the coarsest bucket so that the rule sees every earlier point of a bucket."""
    coarsest = max((t.every for t in tiers if t.every is not None), default=timedelta(minutes=1))
    since = _EPOCH if previous is None else previous - (previous - _EPOCH) % timedelta(minutes=1)
    windows: list[tuple[datetime, datetime]] = []
    for tier in sorted(tiers[:-1], key=lambda t: t.younger_than, reverse=True):
        start = max(since - tier.younger_than, _EPOCH)
        start, end = start - (start - _EPOCH) % coarsest, now - tier.younger_than
        if windows and start <= windows[-1][1]:  # overlapping (a long silence): one span
            start = windows.pop()[0]
        windows.append((start, end))
    return windows


def _minute(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(minutes=1)


@dataclass(frozen=True)
class GpuPoint:
    """One point of a GPU's history; a reading the GPU did not report is None."""

    at: datetime
    utilization_pct: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


class InventoryStore(Repository):
    # ------------------------------------------------------------- inventory
    def register_nodes(self, now: datetime, agent: str, nodes: Iterable[NodeSpec]) -> list[str]:
        """Record what an agent reports; a node it reports is healthy and heard from now."""
        names = []
        with self._write(now) as session:
            for spec in nodes:
                node = session.scalar(select(Node).where(Node.name == spec.name))
                zone = self._reported_zone(session, spec, node)
                back = node is not None and node.health == NodeHealth.unknown
                if node is None:
                    node = Node(name=spec.name, zone=zone, gpu_type=spec.gpu_type)
                    session.add(node)
                    _event(
                        session,
                        now,
                        EventKind.NODE_REGISTERED,
                        f"node {spec.name} registered by "
                        f"{agent} with {len(spec.gpus)} × {spec.gpu_type}",
                        node=spec.name,
                    )
                elif back:
                    _event(
                        session,
                        now,
                        EventKind.NODE_BACK,
                        f"node {spec.name} is reporting again",
                        node=spec.name,
                        cause=agent,
                    )
                node.zone = zone
                node.gpu_type = spec.gpu_type
                node.cpus = spec.cpus
                node.memory_bytes = spec.memory_bytes
                node.labels = dict(spec.labels)
                node.agent = agent
                node.health = NodeHealth.ok
                node.last_heartbeat_at = now
                session.flush()
                known = {g.uuid: g for g in node.gpus}
                for gpu_spec in spec.gpus:
                    gpu = known.pop(gpu_spec.uuid, None) or session.get(Gpu, gpu_spec.uuid)
                    if gpu is None:
                        gpu = Gpu(uuid=gpu_spec.uuid, node_id=node.id)
                        session.add(gpu)
                    gpu.node_id = node.id
                    gpu.index = gpu_spec.index
                    gpu.gpu_type = gpu_spec.gpu_type or spec.gpu_type
                    gpu.pci_bus_id = gpu_spec.pci_bus_id
                    gpu.memory_bytes = gpu_spec.memory_bytes
                    gpu.present = True
                for missing in known.values():
                    if is_slot(missing.uuid):
                        # The node's cluster counted its GPUs until this agent named them.
                        missing.present = False
                    elif missing.present:
                        missing.present = False
                        _event(
                            session,
                            now,
                            EventKind.GPU_MISSING,
                            f"GPU {missing.uuid} (index "
                            f"{missing.index}) is no longer reported on {spec.name}",
                            node=spec.name,
                            cause=agent,
                        )
                names.append(spec.name)
        return names

    def _reported_zone(self, session: Session, spec: NodeSpec, node: Node | None) -> Zone:
        """The zone of a node an agent reports. An agent that names none (a DaemonSet's,
        which cannot read its Node) keeps the zone the node's cluster gave it: its
        Kubernetes zone label, which an agent's "default" must not overwrite."""
        if not spec.zone and node is not None and node.zone.cluster.name == spec.cluster:
            return node.zone
        return self._zone(session, spec.cluster, spec.zone or "default")

    def _zone(self, session: Session, cluster_name: str, zone_name: str) -> Zone:
        cluster = session.scalar(select(Cluster).where(Cluster.name == cluster_name))
        if cluster is None:
            cluster = Cluster(name=cluster_name)
            session.add(cluster)
            session.flush()
        zone = session.scalar(
            select(Zone).where(Zone.cluster_id == cluster.id, Zone.name == zone_name)
        )
        if zone is None:
            zone = Zone(cluster=cluster, name=zone_name)
            session.add(zone)
            session.flush()
        return zone

    def heartbeat(self, now: datetime, agent: str, node_names: Iterable[str]) -> list[str]:
        """Refresh the named nodes; returns the names this controller does not know."""
        names = set(node_names)
        with self._write(now) as session:
            nodes = session.scalars(select(Node).where(Node.name.in_(names))).all()
            for node in nodes:
                if node.health == NodeHealth.unknown:
                    node.health = NodeHealth.ok
                    _event(
                        session,
                        now,
                        EventKind.NODE_BACK,
                        f"node {node.name} is reporting again",
                        node=node.name,
                        cause=agent,
                    )
                node.last_heartbeat_at = now
                node.agent = agent
            return sorted(names - {n.name for n in nodes})

    def set_cordoned(self, now: datetime, node_name: str, cordoned: bool, by: str) -> bool:
        """Cordon (no new work; what runs keeps running) or uncordon a node. Returns whether
        anything changed; an unknown node raises NotFound."""
        with self._write(now) as session:
            node = session.scalar(select(Node).where(Node.name == node_name))
            if node is None:
                raise NotFound(f"there is no node {node_name!r}")
            # Not the lemons: they stay out until an admin clears each (``clear_lemon``).
            blamed = [g for g in node.gpus if g.cordoned and not g.lemon] if not cordoned else []
            if node.cordoned == cordoned and not blamed:
                return False
            node.cordoned = cordoned
            node.recovery_cordoned_at = None  # a person decided: the loop's cordon is over
            if not cordoned and node.maintenance in ("recycle", "diagnose"):
                node.maintenance = None  # ... and what it left due with it
            for gpu in blamed:  # an admin's uncordon returns the node's every GPU
                gpu.cordoned = False
                if gpu.maintenance in ("reset", "diagnose"):
                    gpu.maintenance = None
            verb = "cordoned" if cordoned else "uncordoned"
            _event(
                session,
                now,
                EventKind.NODE_CORDONED if cordoned else EventKind.NODE_UNCORDONED,
                f"node {node_name} {verb} by {by}"
                + ("; it receives no new work" if cordoned else ""),
                node=node_name,
                cause=by,
            )
            return True

    def record_samples(
        self,
        now: datetime,
        agent: str,
        samples: Iterable[Mapping[str, Any]],
        busy_utilization_pct: float = 5.0,
    ) -> list[str]:
        """Keep each GPU's latest sample, and the time of the latest one that showed it
        working (utilisation at or over ``busy_utilization_pct``); a GPU that NVML reports
        lost (or back) is an event. The sample's utilisation and memory join the GPU's
        history, which is thinned here once a minute (the first sample of each minute).

        Returns the UUIDs this controller does not know (the agent should register again).
        """
        by_uuid = {s["uuid"]: s for s in samples}
        with self._write(now) as session:
            gpus = session.scalars(select(Gpu).where(Gpu.uuid.in_(by_uuid))).all()
            for gpu in gpus:
                sample = by_uuid[gpu.uuid]
                lost = bool(sample.get("lost", False))
                if lost != gpu.lost:
                    _gpu_event(session, now, gpu, agent, lost)
                if not lost:
                    _add_history(session, now, gpu, sample)
                gpu.lost = lost
                gpu.sampled_at = now
                gpu.last_sample = dict(sample)
                if sample.get("utilization_gpu_pct", 0) >= busy_utilization_pct:
                    gpu.busy_at = now
            return sorted(by_uuid.keys() - {g.uuid for g in gpus})

    def gpu_history(
        self, uuids: Iterable[str], since: datetime, until: datetime
    ) -> dict[str, list[GpuPoint]]:
        """Each named GPU's points within ``[since, until]``, oldest first (a GPU with
        none maps to an empty list)."""
        found: dict[str, list[GpuPoint]] = {uuid: [] for uuid in uuids}
        if not found:
            return found
        with self.read() as session:
            rows = session.execute(
                select(
                    GpuHistoryPoint.gpu_uuid,
                    GpuHistoryPoint.at,
                    GpuHistoryPoint.utilization_pct,
                    GpuHistoryPoint.memory_used_bytes,
                    GpuHistoryPoint.memory_total_bytes,
                )
                .where(
                    GpuHistoryPoint.gpu_uuid.in_(found),
                    GpuHistoryPoint.at >= since,
                    GpuHistoryPoint.at <= until,
                )
                .order_by(GpuHistoryPoint.gpu_uuid, GpuHistoryPoint.at, GpuHistoryPoint.id)
            )
            for uuid, at, utilization, used, total in rows:
                found[uuid].append(GpuPoint(at, utilization, used, total))
        return found

    def record_xid(self, now: datetime, agent: str, uuid: str, xid: int) -> bool:
        """An XID error as NVML delivered it; False if the GPU is unknown."""
        with self._write(now) as session:
            gpu = session.get(Gpu, uuid)
            if gpu is None:
                return False
            _event(
                session,
                now,
                EventKind.GPU_XID,
                f"XID {xid} on GPU {uuid} (index {gpu.index}) of node {gpu.node.name}",
                reason=f"xid-{xid}",
                cause=agent,
                node=gpu.node.name,
                data={"uuid": uuid, "xid": xid, "index": gpu.index},
            )
            return True


def _add_history(session: Session, now: datetime, gpu: Gpu, sample: Mapping[str, Any]) -> None:
    """Append the sample to the GPU's history; thin it on the first sample of a minute.

    Called before ``gpu.sampled_at`` moves on: that is the previous sample's time, so the
    pass reads only the points that crossed a tier's age since the previous pass (a dozen
    at the default interval), not the GPU's whole history.
    """
    reading = {
        "utilization_pct": sample.get("utilization_gpu_pct"),
        "memory_used_bytes": sample.get("memory_used_bytes"),
        "memory_total_bytes": sample.get("memory_total_bytes"),
    }
    if all(value is None for value in reading.values()):
        return
    session.add(GpuHistoryPoint(gpu_uuid=gpu.uuid, at=now, **reading))
    previous = gpu.sampled_at
    if previous is not None and _minute(previous) == _minute(now):
        return
    _thin_history(session, now, gpu.uuid, previous)


def _thin_history(session: Session, now: datetime, uuid: str, previous: datetime | None) -> None:
    of_gpu = GpuHistoryPoint.gpu_uuid == uuid
    session.execute(
        delete(GpuHistoryPoint).where(
            of_gpu, GpuHistoryPoint.at <= now - HISTORY_TIERS[-1].younger_than
        )
    )
    for start, end in _history_windows(previous, now, HISTORY_TIERS):
        rows = session.execute(
            select(GpuHistoryPoint.id, GpuHistoryPoint.at)
            .where(of_gpu, GpuHistoryPoint.at >= start, GpuHistoryPoint.at < end)
            .order_by(GpuHistoryPoint.at, GpuHistoryPoint.id)
        ).all()
        drop = [rows[i].id for i in history_to_drop([r.at for r in rows], now)]
        if drop:
            session.execute(delete(GpuHistoryPoint).where(GpuHistoryPoint.id.in_(drop)))
    count = session.scalar(select(func.count()).select_from(GpuHistoryPoint).where(of_gpu)) or 0
    if count > HISTORY_MAX_POINTS:
        oldest = (
            select(GpuHistoryPoint.id)
            .where(of_gpu)
            .order_by(GpuHistoryPoint.at, GpuHistoryPoint.id)
            .limit(count - HISTORY_MAX_POINTS)
        )
        session.execute(
            delete(GpuHistoryPoint).where(GpuHistoryPoint.id.in_(oldest.scalar_subquery()))
        )


def _gpu_event(session: Session, now: datetime, gpu: Gpu, agent: str, lost: bool) -> None:
    if lost:
        message = (
            f"GPU {gpu.uuid} (index {gpu.index}) on {gpu.node.name} is lost (NVML: "
            "fallen off the bus); it receives no new work"
        )
    else:
        message = f"GPU {gpu.uuid} (index {gpu.index}) on {gpu.node.name} is back"
    _event(
        session,
        now,
        EventKind.GPU_LOST if lost else EventKind.GPU_BACK,
        message,
        reason="nvml-gpu-lost" if lost else "",
        cause=agent,
        node=gpu.node.name,
        data={"uuid": gpu.uuid, "index": gpu.index},
    )


def mark_silent(session: Session, now: datetime, timeout: timedelta) -> list[Node]:
    """Nodes whose heartbeat is older than ``timeout`` become unknown: no new work. Returns
    the nodes that became so now (what runs there is ``JobStore.lose_silent_nodes``'s)."""
    # A node no agent of gpufleet reports lives as long as its cluster says so.
    silent = session.scalars(
        select(Node)
        .where(
            Node.health != NodeHealth.unknown,
            Node.agent.is_(None) | Node.agent.not_like(f"{AGENT_PREFIX}%"),
            (Node.last_heartbeat_at.is_(None)) | (Node.last_heartbeat_at < now - timeout),
        )
        .order_by(Node.name)
    ).all()
    for node in silent:
        node.health = NodeHealth.unknown
        _event(
            session,
            now,
            EventKind.NODE_LOST,
            f"node {node.name} has not reported for "
            f"{int(timeout.total_seconds())} s; it receives no new work",
            node=node.name,
            reason="heartbeat-lost",
        )
    return list(silent)
