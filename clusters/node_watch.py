"""Each Kubernetes cluster's GPU nodes, watched into the fleet's one state of the world.

For every cluster of ``c.FleetController.clusters`` the controller keeps a watch on its Node
objects (list, then watch from that resourceVersion; a relist after "410 Gone") and a probe
of its API server. What a node is — zone, GPU type and count, Ready, cordoned — is read by
the pure :func:`observe_node`; only a change of that reading is written, so the status and
Lease renewals a thousand kubelets make every few seconds cost a JSON parse each, no
database write.

A cluster whose API server does not answer for ``unreachable_after`` seconds (probe, list
or watch failing all that time) makes its nodes unknown, with an event; the other
clusters' watches and writes go on, each cluster being its own task with its own client.
When it answers again, a fresh complete listing says what its nodes are.

Only the controller holding the database lease writes; every controller watches, so one
that takes the lease over writes a complete listing of every cluster at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..recovery.nvml import gpu_type_of
from ..state.clusters import ClusterNodeState
from .kube_config import ClusterSettings, api_client
from .node_stream import Endpoint, NodeStream, WatchExpired

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "P": 1e15, "E": 1e18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
NOT_READY_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
# gpufleet's cordon, beside spec.unschedulable: it stays when someone's ``kubectl uncordon``
# clears the latter, and it says who cordoned the node and why (its value is escaped).
CORDON_TAINT = "gpufleet.io/cordoned"


def parse_quantity(text: str | int | float | None) -> float:
    """A Kubernetes resource quantity ("32", "500m", "256Gi") as a number; 0 for none."""
    if text is None or text == "":
        return 0.0
    return _quantity(str(text))


@functools.lru_cache(maxsize=1024)
def _quantity(text: str) -> float:
    # Cached: a thousand kubelets report the same few quantities every few seconds.
    match = _QUANTITY.match(text.strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    return float(match.group(1)) * _SUFFIXES[match.group(2)]


def gpu_type_of_product(product: str, memory_mib: float, settings: ClusterSettings) -> str:
    """The fleet's GPU type for GPU Feature Discovery's product label, named as the node
    agent names what NVML reports ("NVIDIA-A100-SXM4-80GB" → "A100-80GB"); a MIG resource
    counts slices of that type ("A100-80GB:3g.40gb")."""
    if product in settings.gpu_type_names:
        whole = settings.gpu_type_names[product]
    else:
        whole = _derived_type(product, memory_mib)
    profile = settings.mig_profile
    return f"{whole}:{profile}" if profile else whole


@functools.lru_cache(maxsize=256)
def _derived_type(product: str, memory_mib: float) -> str:
    # GFD writes NVML's name with spaces as dashes; the vendor prefix is a word.
    model = (
        "NVIDIA " + product.removeprefix("NVIDIA-") if product.startswith("NVIDIA-") else product
    )
    return gpu_type_of(model, int(memory_mib * 2**20), {})


def observe_node(node: Mapping[str, Any], settings: ClusterSettings) -> ClusterNodeState | None:
    """What a Node object says of a GPU node of the fleet; None for a node that is not one
    (the selector's labels missing, or neither GPUs of the cluster's resource nor a GPU
    product label)."""
    metadata = node.get("metadata") or {}
    labels: dict[str, str] = dict(metadata.get("labels") or {})
    if any(labels.get(k) != v for k, v in settings.gpu_node_selector.items()):
        return None
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    capacity = status.get("capacity") or {}
    product = labels.get(settings.gpu_product_label, "")
    if settings.gpu_resource not in capacity and not product:
        return None
    gpus = int(parse_quantity(allocatable.get(settings.gpu_resource, 0)))
    memory_mib = parse_quantity(labels.get("nvidia.com/gpu.memory", 0))
    ready, why = _readiness(node)
    return ClusterNodeState(
        name=str(metadata["name"]),
        zone=labels.get(settings.zone_label) or "default",
        gpu_type=gpu_type_of_product(product, memory_mib, settings) if product else "unknown",
        gpus=gpus,
        ready=ready,
        unschedulable=is_cordoned(node),
        why_not_ready=why,
        cpus=parse_quantity(allocatable.get("cpu")),
        memory_bytes=int(parse_quantity(allocatable.get("memory"))),
        labels=labels,
    )


def is_cordoned(node: Mapping[str, Any]) -> bool:
    """A cordon is ``spec.unschedulable`` (``kubectl cordon``'s) or gpufleet's taint."""
    spec = node.get("spec") or {}
    taints = spec.get("taints") or []
    return bool(spec.get("unschedulable")) or any(t.get("key") == CORDON_TAINT for t in taints)


def cordon_patch(node: Mapping[str, Any], cordoned: bool) -> dict[str, Any]:
    """The strategic merge patch that cordons a Node (``spec.unschedulable`` and gpufleet's
    ``NoSchedule`` taint) or uncordons it (both gone, the other taints kept). A node's
    taints are replaced as a whole, so the patch carries the ``resourceVersion`` it was
    computed from: a change in between makes it fail (409) rather than drop a taint."""
    spec = node.get("spec") or {}
    taints = [dict(t) for t in spec.get("taints") or [] if t.get("key") != CORDON_TAINT]
    if cordoned:
        taints.append({"key": CORDON_TAINT, "value": "true", "effect": "NoSchedule"})
    return {
        "metadata": {"resourceVersion": str((node.get("metadata") or {}).get("resourceVersion"))},
        "spec": {"unschedulable": cordoned, "taints": taints},
    }


def _readiness(node: Mapping[str, Any]) -> tuple[bool, str]:
    """Ready, or why not: the Ready condition as the kubelet or the node-lifecycle
    controller last wrote it, and the taints the latter adds for a node it lost."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    taints = [t.get("key") for t in (node.get("spec") or {}).get("taints") or []]
    lost = [t for t in NOT_READY_TAINTS if t in taints]
    if ready is None:
        return False, "no Ready condition yet"
    if ready.get("status") != "True":
        text = ready.get("message") or ready.get("reason") or f"Ready={ready.get('status')}"
        return False, f"{ready.get('reason', 'NotReady')}: {text}"
    if lost:
        return False, f"tainted {lost[0]}"
    return True, ""


@dataclass
class Reachability:
    """Whether an API server answers: it stops answering after failing continuously for
    ``after`` seconds, and answers again at its first success."""

    after: float
    reachable: bool = True
    failing_since: float | None = None
    why: str = ""

    def record(self, ok: bool, now: float, why: str = "") -> bool:
        """Note one attempt; True when this changes ``reachable``."""
        if ok:
            self.failing_since = None
            self.why = ""
            if self.reachable:
                return False
            self.reachable = True
            return True
        self.why = why
        if self.failing_since is None:
            self.failing_since = now
        if self.reachable and now - self.failing_since >= self.after:
            self.reachable = False
            return True
        return False


@dataclass
class ClusterView:
    """One cluster's nodes as last seen, and what the store has not been told yet."""

    settings: ClusterSettings
    nodes: dict[str, ClusterNodeState] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    complete: bool = False  # the next write is a complete listing
    listed: bool = False  # a complete listing has been read since the last failure
    reachability_changed: bool = False

    def seen(self, name: str, state: ClusterNodeState | None) -> bool:
        """A node's new reading (None: deleted, or no longer one of the fleet's)."""
        if state is None:
            if self.nodes.pop(name, None) is None:
                return False
            self.changed.discard(name)
            self.gone.add(name)
            return True
        if self.nodes.get(name) == state:
            return False
        self.nodes[name] = state
        self.gone.discard(name)
        self.changed.add(name)
        return True

    def relisted(self, states: Sequence[ClusterNodeState]) -> None:
        self.nodes = {s.name: s for s in states}
        self.changed = set(self.nodes)
        self.gone = set()
        self.complete = True
        self.listed = True


class ClusterWatch:
    """The list-watch of one cluster's Node objects and the probe of its API server."""

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        changed: Callable[[], None],
        log: logging.Logger,
        unreachable_after: float,
        probe_interval: float,
        watch_timeout: int = 300,
    ):
        self.view = ClusterView(settings)
        self.reachability = Reachability(unreachable_after)
        self._changed = changed
        self.log = log
        self.probe_interval = probe_interval
        self.watch_timeout = watch_timeout
        self.api: Any = None
        self.listings = 0  # complete listings read: the first, then one per watch lost
        self._tasks: list[asyncio.Task[None]] = []
        self._watch_task: asyncio.Task[None] | None = None
        # The watch is read in a thread of its own (hub/node_stream.py); a reading it
        # delivers counts only while its stream is the current one.
        self._reader: ThreadPoolExecutor | None = None
        self._stream: NodeStream | None = None

    @property
    def name(self) -> str:
        return self.view.settings.name

    async def start(self) -> None:
        self.api = await api_client(self.view.settings)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"watch-{self.name}")
        self._watch_task = asyncio.create_task(self._watch_forever())
        self._tasks.append(asyncio.create_task(self._probe_forever()))

    async def close(self) -> None:
        for task in [*self._tasks, self._watch_task]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._stream is not None:
            self._stream.close()
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        if self.api is not None:
            await self.api.close()

    def _record(self, ok: bool, why: str = "") -> None:
        if self.reachability.record(ok, time.monotonic(), why):
            self.view.reachability_changed = True
            if self.reachability.reachable:
                self.log.info("cluster %s answers again", self.name)
                self._restart_watch()  # a watch stuck on a hung server must not linger
            else:
                self.log.warning("cluster %s does not answer: %s", self.name, why)
            self._changed()

    def _restart_watch(self) -> None:
        if self._watch_task is not None and not self._watch_task.done():
            self._watch_task.cancel()
        self._watch_task = asyncio.create_task(self._watch_forever())

    async def _probe_forever(self) -> None:
        from kubernetes_asyncio import client

        version = client.VersionApi(self.api)
        while True:
            try:
                await version.get_code(_request_timeout=max(self.probe_interval, 1.0))
            except Exception as e:  # noqa: BLE001 - any failure to answer is "not answering"
                self._record(False, _describe(e))
            else:
                self._record(True)
            await asyncio.sleep(self.probe_interval)

    async def _watch_forever(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._list()
                backoff = 0.5
                while True:
                    version = await self._watch(version)
            except WatchExpired:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - an unexpected failure must not end the watch
                self.view.listed = False
                self._record(False, _describe(e))
                self.log.debug("cluster %s: node watch failed: %s", self.name, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def _selector(self) -> dict[str, str]:
        chosen = self.view.settings.gpu_node_selector
        selector = ",".join(f"{k}={v}" for k, v in sorted(chosen.items()))
        return {"label_selector": selector} if selector else {}

    async def _list(self) -> str:
        from kubernetes_asyncio import client

        core: Any = client.CoreV1Api(self.api)
        # Raw JSON (no models): the watch parses thousands of Node objects a minute.
        response: Any = await core.list_node(
            **self._selector(), _preload_content=False, _request_timeout=30
        )
        async with response:
            body = json.loads(await response.read())
        states = [observe_node(n, self.view.settings) for n in body.get("items", [])]
        self.view.relisted([s for s in states if s is not None])
        self.listings += 1
        self._record(True)
        self._changed()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        """Follow changes from ``version`` until the server ends the watch, in the
        watch's own thread; returns the last version seen."""
        try:
            endpoint = await Endpoint.of(self.api.configuration)
        except ValueError:
            return await self._watch_on_loop(version)
        query = {"labelSelector": s} if (s := self._selector().get("label_selector")) else {}
        stream = self._stream = NodeStream(endpoint, query, self.watch_timeout)
        loop = asyncio.get_running_loop()
        settings = self.view.settings

        def seen(name: str, state: ClusterNodeState | None) -> None:
            if self._stream is stream and self.view.seen(name, state):
                self._changed()

        def deliver(name: str, state: ClusterNodeState | None) -> None:
            loop.call_soon_threadsafe(seen, name, state)

        def observe(node: Mapping[str, Any]) -> ClusterNodeState | None:
            return observe_node(node, settings)

        try:
            return await loop.run_in_executor(
                self._reader,
                stream.follow,
                version,
                dict(self.view.nodes),
                observe,
                deliver,
            )
        finally:
            stream.close()  # a cancelled watch's thread stops reading
            if self._stream is stream:
                self._stream = None

    async def _watch_on_loop(self, version: str) -> str:
        """The watch through the event loop (``kubernetes_asyncio``), for a configuration
        the thread's reader cannot follow."""
        from kubernetes_asyncio import client

        core: Any = client.CoreV1Api(self.api)
        response: Any = await core.list_node(
            **self._selector(),
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _preload_content=False,
            _request_timeout=self.watch_timeout + 30,
        )
        async with response:
            async for line in _lines(response.content):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired(obj.get("message", "410 Gone"))
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                version = str(obj.get("metadata", {}).get("resourceVersion", version))
                if kind == "BOOKMARK":
                    continue
                name = str(obj["metadata"]["name"])
                state = None if kind == "DELETED" else observe_node(obj, self.view.settings)
                if self.view.seen(name, state):
                    self._changed()
        return version


async def _lines(stream: Any) -> AsyncIterator[bytes]:
    """The lines of a watch stream, however long (a Node lists its images): no line
    limit applies here, where aiohttp's ``readline`` has one (twice its read buffer)."""
    pending = b""
    async for chunk in stream.iter_any():
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def _describe(error: BaseException) -> str:
    status = getattr(error, "status", None)
    if status is not None:
        reason = getattr(error, "reason", "") or ""
        if status == 403:
            return f"403 Forbidden: gpufleet's identity may not read nodes here ({reason})"
        return f"{status} {reason}".strip()
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
