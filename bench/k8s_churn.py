"""Hundreds of fake GPU nodes per cluster, kept alive the way kubelets keep theirs.

The test tier's ``FakeNode`` (``tests/k8s/nodes.py``) is one node with its own kubelet
token and its own renewer thread: right for a handful of nodes, not for a thousand. This
driver registers ``count`` nodes per cluster in bulk as the cluster's admin (Node, status,
Lease owned by the Node, as a kubelet makes them; the manifests and statuses are
``NodeSpec``'s), then renews every node's status and its Lease once a ``period`` (10 s, a
kubelet's ``nodeStatusUpdateFrequency`` and its lease renew interval), spread evenly over
the period: node *i*'s status at ``i / count`` of the period, its Lease half a period later.

A status renewal is the strategic-merge patch a kubelet sends when only the heartbeat moved
(each condition's ``lastHeartbeatTime``); a Lease renewal is a merge patch of ``renewTime``.
Neither changes what gpufleet reads of a node. One asyncio loop and an aiohttp session per
cluster (a bounded number of connections) do it all; the renewals in flight per cluster are
bounded too, so a server that cannot keep up shows as lag (how late a renewal went out
against the plan; a constant lag is harmless, a growing one means the planned rate is not
reached) and as gaps (the time between two successful renewals of one node's status or
Lease: what the node-lifecycle controller judges a node by, against its 40 s grace). The
driver reports them once a period on stdout (``@@churn {...}`` JSON lines), with the
renewals done, the errors and the requests' latency (waiting for a connection included).

Run by ``bench/k8s_inventory.py`` as a process of its own (its CPU time is then its own):

    .venv/bin/python bench/k8s_churn.py CONFIG.json

CONFIG: ``{"period": 10, "connections": 32, "clusters": [{"name", "server", "ca", "token",
"count"}]}``. ``@@registered {...}`` is printed once every node exists with its status
and Lease; SIGTERM stops it after a last ``@@churn`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import signal
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' Kubernetes tier
from tests.k8s.nodes import LEASE_DURATION_S, LEASE_NAMESPACE, NodeSpec, micro_time, rfc3339

MARK = "@@"
ZONES = 3
GPUS = 8
CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
IN_FLIGHT = 64  # renewals in flight per cluster (at least 2 per connection) before it lags


def node_specs(cluster: str, count: int) -> list[NodeSpec]:
    """``count`` GPU nodes of ``cluster`` (8 GPUs each, over 3 zones): names like
    ``a-0001`` for cluster ``cluster-a``."""
    prefix = cluster.rsplit("-", 1)[-1]
    return [
        NodeSpec(f"{prefix}-{i:04d}", f"zone-{prefix}{i % ZONES}", gpus=GPUS) for i in range(count)
    ]


def heartbeat_patch(now: datetime.datetime | None = None) -> dict[str, Any]:
    """What a kubelet patches when only its heartbeat changed: every condition's
    ``lastHeartbeatTime`` (a strategic-merge patch; conditions merge by type)."""
    stamp = rfc3339(now)
    return {
        "status": {
            "$setElementOrder/conditions": [{"type": t} for t in CONDITIONS],
            "conditions": [{"type": t, "lastHeartbeatTime": stamp} for t in CONDITIONS],
        }
    }


def lease_manifest(name: str, uid: str) -> dict[str, Any]:
    """A node's Lease, owned by its Node as a kubelet makes it."""
    return {
        "metadata": {
            "name": name,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}],
        },
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": micro_time(),
        },
    }


STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
MERGE = {"Content-Type": "application/merge-patch+json"}


@dataclass
class Stats:
    """One period's renewals: counts, lateness of each start, request latencies."""

    status: int = 0
    lease: int = 0
    errors: int = 0
    last_error: str = ""
    lag: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)

    def summary(self, elapsed: float) -> dict[str, Any]:
        return {
            "t": round(elapsed, 2),
            "status": self.status,
            "lease": self.lease,
            "errors": self.errors,
            "last_error": self.last_error,
            "lag_p99": _quantile(self.lag, 0.99),
            "lag_max": max(self.lag, default=0.0),
            "gap_p99": _quantile(self.gaps, 0.99),
            "gap_max": round(max(self.gaps, default=0.0), 4),
            "latency_p50": _quantile(self.latency, 0.5),
            "latency_p99": _quantile(self.latency, 0.99),
        }


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 4)


class ClusterChurn:
    """One cluster's nodes, registered and renewed through one aiohttp session."""

    def __init__(self, config: dict[str, Any], connections: int):
        self.name = str(config["name"])
        self.server = str(config["server"])
        self.specs = node_specs(self.name, int(config["count"]))
        context = ssl.create_default_context(cafile=str(config["ca"]))
        self.session = aiohttp.ClientSession(
            base_url=self.server,
            connector=aiohttp.TCPConnector(ssl=context, limit=connections),
            headers={"Authorization": f"Bearer {config['token']}"},
            timeout=aiohttp.ClientTimeout(total=30),
        )
        self.in_flight = asyncio.Semaphore(max(IN_FLIGHT, 2 * connections))
        self.renewed: dict[tuple[str, str], float] = {}  # (node, kind): last success

    async def close(self) -> None:
        await self.session.close()

    async def register(self, spec: NodeSpec) -> None:
        """The Node (an existing one is kept), its status, and its Lease."""
        async with self.session.post("/api/v1/nodes", json=spec.manifest()) as r:
            if r.status == 409:
                async with self.session.get(f"/api/v1/nodes/{spec.name}") as got:
                    got.raise_for_status()
                    node = await got.json()
            elif r.status == 201:
                node = await r.json()
            else:
                raise RuntimeError(f"registering {spec.name} in {self.name}: {await r.text()}")
        path = f"/api/v1/nodes/{spec.name}/status"
        async with self.session.patch(path, json={"status": spec.status()}, headers=STRATEGIC) as r:
            r.raise_for_status()
        lease = lease_manifest(spec.name, node["metadata"]["uid"])
        async with self.session.post(LEASES, json=lease) as r:
            if r.status not in (201, 409):
                raise RuntimeError(f"the Lease of {spec.name} in {self.name}: {await r.text()}")

    async def renew(self, spec: NodeSpec, kind: str, period: list[Stats]) -> None:
        """One renewal, counted in the period it completes in (``period[0]``)."""
        started = time.monotonic()
        try:
            if kind == "status":
                request = self.session.patch(
                    f"/api/v1/nodes/{spec.name}/status", json=heartbeat_patch(), headers=STRATEGIC
                )
            else:
                request = self.session.patch(
                    f"{LEASES}/{spec.name}",
                    json={"spec": {"renewTime": micro_time()}},
                    headers=MERGE,
                )
            async with request as r:
                await r.read()
                r.raise_for_status()
        except (aiohttp.ClientError, TimeoutError) as e:
            stats = period[0]
            stats.errors += 1
            stats.last_error = f"{self.name} {kind} {spec.name}: {type(e).__name__}: {e}"
        else:
            done = time.monotonic()
            stats = period[0]
            stats.latency.append(done - started)
            last = self.renewed.get((spec.name, kind))
            if last is not None:
                stats.gaps.append(done - last)
            self.renewed[spec.name, kind] = done
            if kind == "status":
                stats.status += 1
            else:
                stats.lease += 1
        finally:
            self.in_flight.release()


async def register_all(clusters: Sequence[ClusterChurn], connections: int) -> None:
    """Every node of every cluster, ``connections`` at a time per cluster."""

    async def one_cluster(cluster: ClusterChurn) -> None:
        queue = list(cluster.specs)

        async def worker() -> None:
            while queue:
                await cluster.register(queue.pop())

        await asyncio.gather(*(worker() for _ in range(connections)))

    await asyncio.gather(*(one_cluster(c) for c in clusters))


async def renew_forever(
    clusters: Sequence[ClusterChurn], period: float, stop: asyncio.Event
) -> None:
    """Each node's status at ``i / n`` of the period and its Lease half a period later, on
    every cluster at once; a ``@@churn`` line per period."""
    schedule: list[tuple[float, ClusterChurn, NodeSpec, str]] = []
    for cluster in clusters:
        n = len(cluster.specs)
        for i, spec in enumerate(cluster.specs):
            offset = period * i / n
            schedule.append((offset, cluster, spec, "status"))
            schedule.append(((offset + period / 2) % period, cluster, spec, "lease"))
    schedule.sort(key=lambda item: item[0])
    began = time.monotonic()
    stats = [Stats()]
    tasks: set[asyncio.Task[None]] = set()
    turn = 0
    while not stop.is_set():
        base = began + turn * period
        for offset, cluster, spec, kind in schedule:
            due = base + offset
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
            await cluster.in_flight.acquire()
            stats[0].lag.append(max(0.0, time.monotonic() - due))
            task = asyncio.create_task(cluster.renew(spec, kind, stats))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:
            say("churn", stats[0].summary(time.monotonic() - began))
            stats[0] = Stats()
            turn += 1
            continue
        break
    if tasks:
        await asyncio.wait(tasks, timeout=10)
    say("churn", stats[0].summary(time.monotonic() - began))


def say(kind: str, data: dict[str, Any]) -> None:
    sys.stdout.write(f"{MARK}{kind} {json.dumps(data)}\n")
    sys.stdout.flush()


async def drive(config: dict[str, Any]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    connections = int(config.get("connections", 32))
    clusters = [ClusterChurn(c, connections) for c in config["clusters"]]
    try:
        started = time.monotonic()
        await register_all(clusters, connections)
        count = sum(len(c.specs) for c in clusters)
        say("registered", {"nodes": count, "seconds": round(time.monotonic() - started, 2)})
        await renew_forever(clusters, float(config["period"]), stop)
    finally:
        for cluster in clusters:
            await cluster.close()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(__doc__)
    asyncio.run(drive(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    main()
