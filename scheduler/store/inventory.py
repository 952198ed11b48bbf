"""What node agents report: nodes, GPUs, heartbeats, samples and XID events."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import NotFound
from .base import StoreBase, _event
from .models import Cluster, Gpu, Node, NodeHealth, Zone


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
    zone: str
    gpu_type: str
    gpus: tuple[GpuSpec, ...]
    cpus: float = 0.0
    memory_bytes: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


class InventoryStore(StoreBase):
    # ------------------------------------------------------------- inventory
    def register_nodes(self, now: datetime, agent: str, nodes: Iterable[NodeSpec]) -> list[str]:
        """Record what an agent reports; a node it reports is healthy and heard from now."""
        names = []
        with self._write(now) as session:
            for spec in nodes:
                zone = self._zone(session, spec.cluster, spec.zone)
                node = session.scalar(select(Node).where(Node.name == spec.name))
                back = node is not None and node.health == NodeHealth.unknown
                if node is None:
                    node = Node(name=spec.name, zone=zone, gpu_type=spec.gpu_type)
                    session.add(node)
                    _event(
                        session,
                        now,
                        "node-registered",
                        f"node {spec.name} registered by "
                        f"{agent} with {len(spec.gpus)} × {spec.gpu_type}",
                        node=spec.name,
                    )
                elif back:
                    _event(
                        session,
                        now,
                        "node-back",
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
                    if missing.present:
                        missing.present = False
                        _event(
                            session,
                            now,
                            "gpu-missing",
                            f"GPU {missing.uuid} (index "
                            f"{missing.index}) is no longer reported on {spec.name}",
                            node=spec.name,
                            cause=agent,
                        )
                names.append(spec.name)
        return names

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
                        "node-back",
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
            if node.cordoned == cordoned:
                return False
            node.cordoned = cordoned
            verb = "cordoned" if cordoned else "uncordoned"
            _event(
                session,
                now,
                f"node-{verb}",
                f"node {node_name} {verb} by {by}"
                + ("; it receives no new work" if cordoned else ""),
                node=node_name,
                cause=by,
            )
            return True

    def mark_silent_nodes(self, now: datetime, timeout: timedelta) -> list[str]:
        """Nodes whose heartbeat is older than ``timeout`` become unknown: no new work."""
        with self._write(now) as session:
            silent = session.scalars(
                select(Node).where(
                    Node.health != NodeHealth.unknown,
                    (Node.last_heartbeat_at.is_(None)) | (Node.last_heartbeat_at < now - timeout),
                )
            ).all()
            for node in silent:
                node.health = NodeHealth.unknown
                _event(
                    session,
                    now,
                    "node-lost",
                    f"node {node.name} has not reported for "
                    f"{int(timeout.total_seconds())} s; it receives no new work",
                    node=node.name,
                    reason="heartbeat-lost",
                )
            return [n.name for n in silent]

    def record_samples(
        self,
        now: datetime,
        agent: str,
        samples: Iterable[Mapping[str, Any]],
        busy_utilization_pct: float = 5.0,
    ) -> list[str]:
        """Keep each GPU's latest sample, and the time of the latest one that showed it
        working (utilisation at or over ``busy_utilization_pct``); a GPU that NVML reports
        lost (or back) is an event.

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
                gpu.lost = lost
                gpu.sampled_at = now
                gpu.last_sample = dict(sample)
                if sample.get("utilization_gpu_pct", 0) >= busy_utilization_pct:
                    gpu.busy_at = now
            return sorted(by_uuid.keys() - {g.uuid for g in gpus})

    def record_xid(self, now: datetime, agent: str, uuid: str, xid: int) -> bool:
        """An XID error as NVML delivered it; False if the GPU is unknown."""
        with self._write(now) as session:
            gpu = session.get(Gpu, uuid)
            if gpu is None:
                return False
            _event(
                session,
                now,
                "gpu-xid",
                f"XID {xid} on GPU {uuid} (index {gpu.index}) of node {gpu.node.name}",
                reason=f"xid-{xid}",
                cause=agent,
                node=gpu.node.name,
                data={"uuid": uuid, "xid": xid, "index": gpu.index},
            )
            return True


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
        "gpu-lost" if lost else "gpu-back",
        message,
        reason="nvml-gpu-lost" if lost else "",
        cause=agent,
        node=gpu.node.name,
        data={"uuid": gpu.uuid, "index": gpu.index},
    )
