"""The processes that watch the clusters in ``k8s_inventory.py``'s runs, each a process of
its own so that its CPU time is its own.

- ``controller``: gpufleet's ``KubeInventory`` on every cluster as the controller's
  identity, writing into a SQLite ``FleetStore`` as the leading controller does (its
  defaults). Its store (``ReportingStore``) prints a ``time.monotonic()`` stamp once
  ``sync_cluster_nodes`` has committed, with the nodes whose record changed: the moment
  the scheduler can see a change. SIGUSR1 starts a cProfile (``config["profile"]``),
  written at SIGTERM.
- ``watcher``: the baseline, a bare watcher (httpx, or aiohttp: ``config["client"]``):
  list, then a streaming watch of ``/api/v1/nodes`` on every cluster; each event
  JSON-parsed, the node's cordon and GPU count compared with the last ones, a stamp when
  they differ. Nothing else.

    .venv/bin/python bench/k8s_observers.py controller|watcher CONFIG.json

Their lines on stdout are ``@@kind {json}``: ``synced`` (controller), ``ready`` and
``seen`` (watcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import http.client
import json
import logging
import signal
import ssl
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from k8s_churn import say

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' Kubernetes tier
from gpufleet.clusters.kube_config import ClusterSettings
from gpufleet.hub.kube_inventory import KubeInventory
from gpufleet.state import db
from gpufleet.state.clusters import ClusterNodeState
from gpufleet.state.fleet import FleetStore
from tests.k8s.nodes import GPU_RESOURCE


# ------------------------------------------------------------- the controller child
class ReportingStore(FleetStore):
    """The store, telling the bench when a sync of a cluster's nodes has committed."""

    def sync_cluster_nodes(
        self,
        now: datetime,
        cluster: str,
        states: Iterable[ClusterNodeState],
        **kwargs: Any,
    ) -> list[str]:
        states = list(states)
        started = time.monotonic()
        changed = super().sync_cluster_nodes(now, cluster, states, **kwargs)
        done = time.monotonic()
        say(
            "synced",
            {
                "t": done,
                "took": done - started,
                "cluster": cluster,
                "states": len(states),
                "changed": changed,
            },
        )
        return changed


def controller(config: Mapping[str, Any]) -> None:
    """KubeInventory over every cluster into the store, as the leader; SIGUSR1 starts the
    profile (``config["profile"]``), SIGTERM ends it all."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine = db.make_engine(f"sqlite:///{config['database']}")
    store = ReportingStore(engine, "bench-controller", lease_ttl=timedelta(days=1))
    if not store.try_acquire_lease(datetime.now(UTC)):
        raise SystemExit("the bench's database lease is taken")
    profiler = cProfile.Profile(time.process_time) if config.get("profile") else None

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if profiler is not None:
            loop.add_signal_handler(signal.SIGUSR1, profiler.enable)
        settings = [
            ClusterSettings(name=name, kubeconfig=config["kubeconfig"], context=name)
            for name in config["clusters"]
        ]
        inventory = KubeInventory(
            settings,
            store,
            log=logging.getLogger("gpufleet.bench.inventory"),
            now=lambda: datetime.now(UTC),
            kick=lambda: None,
        )
        await inventory.start()
        writer = asyncio.create_task(inventory.run(lambda: True))
        try:
            await stop.wait()
        finally:
            if profiler is not None:
                profiler.disable()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            await inventory.close()

    asyncio.run(serve())
    if profiler is not None:
        profiler.dump_stats(config["profile"])
    engine.dispose()


# ---------------------------------------------------------------- the bare watcher
class NodeChanges:
    """The bare watcher's whole work per event of one cluster: parse it, compare the node's
    cordon and GPU count with the last ones seen, say when they differ."""

    def __init__(self, cluster: str, listed: Mapping[str, Any], events: Counter[str]):
        self.cluster = cluster
        self.last = {n["metadata"]["name"]: _what_changes(n) for n in listed["items"]}
        self.version = str(listed["metadata"]["resourceVersion"])
        self.events = events
        say("ready", {"cluster": cluster, "nodes": len(self.last)})

    def event(self, line: str | bytes) -> None:
        event = json.loads(line)
        self.events[self.cluster] += 1
        node = event["object"]
        if event["type"] == "ERROR":
            raise RuntimeError(f"{self.cluster}: watch error {node}")
        self.version = node["metadata"]["resourceVersion"]
        if event["type"] == "BOOKMARK":
            return
        key, now = node["metadata"]["name"], _what_changes(node)
        if self.last.get(key) != now:
            self.last[key] = now
            say(
                "seen",
                {
                    "t": time.monotonic(),
                    "cluster": self.cluster,
                    "node": key,
                    "events": sum(self.events.values()),
                },
            )

    def params(self) -> dict[str, str]:
        return {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "3600",
            "resourceVersion": self.version,
        }


async def _watch_httpx(cluster: Mapping[str, Any], events: Counter[str]) -> None:
    async with httpx.AsyncClient(
        base_url=str(cluster["server"]),
        verify=ssl.create_default_context(cafile=str(cluster["ca"])),
        headers={"Authorization": f"Bearer {cluster['token']}"},
        timeout=httpx.Timeout(30.0, read=None),
    ) as client:
        listed = (await client.get("/api/v1/nodes")).raise_for_status().json()
        changes = NodeChanges(str(cluster["name"]), listed, events)
        while True:
            async with client.stream("GET", "/api/v1/nodes", params=changes.params()) as r:
                async for line in r.aiter_lines():
                    changes.event(line)


async def _watch_aiohttp(cluster: Mapping[str, Any], events: Counter[str]) -> None:
    """The same over aiohttp, the transport under gpufleet's kubernetes_asyncio."""
    async with aiohttp.ClientSession(
        base_url=str(cluster["server"]),
        connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(cluster["ca"]))),
        headers={"Authorization": f"Bearer {cluster['token']}"},
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
    ) as session:
        async with session.get("/api/v1/nodes") as r:
            r.raise_for_status()
            changes = NodeChanges(str(cluster["name"]), await r.json(), events)
        while True:
            async with session.get("/api/v1/nodes", params=changes.params()) as r:
                r.raise_for_status()
                while line := await r.content.readline():
                    changes.event(line)


def _watch_threaded(cluster: Mapping[str, Any], events: Counter[str]) -> None:
    """The same with blocking reads in a thread (http.client over the ssl module): no
    event loop and no Python TLS layer per chunk."""
    host, _, port = str(cluster["server"]).removeprefix("https://").partition(":")
    context = ssl.create_default_context(cafile=str(cluster["ca"]))
    headers = {"Authorization": f"Bearer {cluster['token']}"}
    connection = http.client.HTTPSConnection(host, int(port or 443), context=context)
    connection.request("GET", "/api/v1/nodes", headers=headers)
    listed = connection.getresponse()
    changes = NodeChanges(str(cluster["name"]), json.loads(listed.read()), events)
    while True:
        query = urllib.parse.urlencode(changes.params())
        connection.request("GET", f"/api/v1/nodes?{query}", headers=headers)
        response = connection.getresponse()
        while line := response.readline():
            changes.event(line)


def watcher(config: Mapping[str, Any]) -> None:
    """List, then watch ``/api/v1/nodes`` on every cluster (with ``config["client"]``:
    httpx or aiohttp); a line when a node's cordon or GPU count differs from the last one
    seen."""
    if config["client"] == "thread":
        threads = [
            threading.Thread(target=_watch_threaded, args=(c, Counter()), daemon=True)
            for c in config["clusters"]
        ]
        for thread in threads:
            thread.start()
        threading.Event().wait()  # SIGTERM ends the process
        return
    watch = _watch_aiohttp if config["client"] == "aiohttp" else _watch_httpx

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        events: Counter[str] = Counter()
        watches = [asyncio.create_task(watch(c, events)) for c in config["clusters"]]
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *watches], return_when=asyncio.FIRST_COMPLETED)
        for task in [stopping, *watches]:
            task.cancel()
        for task in done:
            if task is not stopping and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    asyncio.run(serve())


def _what_changes(node: Mapping[str, Any]) -> tuple[bool, str | None]:
    spec, status = node.get("spec") or {}, node.get("status") or {}
    return bool(spec.get("unschedulable")), (status.get("allocatable") or {}).get(GPU_RESOURCE)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("controller", "watcher"):
        raise SystemExit(__doc__)
    config = json.loads(Path(args[1]).read_text())
    (controller if args[0] == "controller" else watcher)(config)


if __name__ == "__main__":
    main()
