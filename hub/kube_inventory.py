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
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float
from traitlets.config import Configurable

from ..agent.gpus import gpu_type_of
from ..scheduler.errors import SchedulerError
from ..spawner.clusters import ClusterSettings, api_client
from ..state.clusters import ClusterInventoryStore, ClusterNodeState
from ..state.cycle import Stop
from .components import LoopComponent
from .node_stream import Endpoint, NodeStream, WatchExpired

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "P": 1e15, "E": 1e18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
NOT_READY_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


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
        unschedulable=bool((node.get("spec") or {}).get("unschedulable", False)),
        why_not_ready=why,
        cpus=parse_quantity(allocatable.get("cpu")),
        memory_bytes=int(parse_quantity(allocatable.get("memory"))),
        labels=labels,
    )


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


@dataclass(frozen=True)
class _Write:
    """What one cluster's flush writes: its reachability (reachable, why) if that changed;
    its changed nodes, the names of its deleted ones and whether the listing is complete,
    if any node changed."""

    reach: tuple[bool, str] | None
    nodes: tuple[list[ClusterNodeState], list[str], bool] | None


@dataclass(frozen=True)
class _GpufleetPod:
    """A pod gpufleet made, as the reconciler reads it: its workload's process marker,
    where it is, and whether its deletion has begun (it may still run meanwhile)."""

    marker: str
    namespace: str
    name: str
    terminating: bool


class ClusterState(Protocol):
    """The repository the inventory writes the clusters' nodes to (``FleetStore``'s)."""

    clusters: ClusterInventoryStore


class KubeInventory(LoopComponent):
    """The watches of every configured cluster, written into the store by the leader."""

    unreachable_after = Float(
        20.0,
        help="A cluster whose API server has not answered for this many seconds makes its "
        "nodes unknown (no new work) until it answers again; the other clusters go on.",
    ).tag(config=True)

    probe_interval = Float(
        5.0, help="Seconds between checks that each cluster's API server answers."
    ).tag(config=True)

    node_lost_grace_seconds = Float(
        60.0,
        help="A Kubernetes node that is not Ready, or deleted, for this many seconds ends "
        "the sessions on it, each with an event naming the node. Their GPUs stay held "
        "until the pod is gone (a pod on a node that does not answer may still run).",
    ).tag(config=True)

    def __init__(
        self,
        clusters: Sequence[ClusterSettings],
        store: ClusterState,
        *,
        now: Callable[[], datetime],
        kick: Callable[[], None],
        stop_sessions: Callable[[list[Stop]], None] = lambda stops: None,
        parent: Configurable | None = None,
        **kwargs: Any,
    ):
        super().__init__(parent=parent, **kwargs)
        self.stop_sessions = stop_sessions
        # Nodes not Ready or deleted, since when (monotonic), and why; and those whose
        # sessions were already told to end. A node that is Ready again leaves both.
        self.lost_since: dict[str, tuple[float, str]] = {}
        self.acted_on: set[str] = set()
        self.store = store
        self.now = now
        self.kick = kick
        self._wanted = asyncio.Event()
        self.watches = {
            c.name: ClusterWatch(
                c,
                changed=self._wanted.set,
                log=self.log,
                unreachable_after=self.unreachable_after,
                probe_interval=self.probe_interval,
            )
            for c in clusters
        }
        self._was_leader = False

    async def start(self) -> None:
        for watch in self.watches.values():
            await watch.start()

    async def close(self) -> None:
        for watch in self.watches.values():
            await watch.close()

    async def run(self, is_leader: Callable[[], bool], interval: float = 1.0) -> None:
        """Write what changed as soon as it changed (and at least every ``interval``)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), interval)
            self._wanted.clear()
            leader = is_leader()
            if leader and not self._was_leader:
                for watch in self.watches.values():
                    watch.view.reachability_changed = True
                    watch.view.changed = set(watch.view.nodes)
                    watch.view.complete = watch.view.listed
            self._was_leader = leader
            if leader and await self.flush_in_thread():
                self.kick()
            if leader:
                self.end_sessions_on_lost_nodes(time.monotonic())

    def flush(self) -> bool:
        """Tell the store what changed; True if a node's record changed. A write that
        fails is retried whole (as a complete listing) at the next flush."""
        taken = [(w, self._take(w)) for w in self.watches.values()]
        return self._recorded(taken, self._write_all(taken))

    async def flush_in_thread(self) -> bool:
        """``flush`` with the database writes in a thread: a first listing of hundreds of
        nodes takes seconds to write, which the event loop (the watches, the API) must not
        wait for. What to write is taken on the loop, where the watches change it."""
        taken = [(w, self._take(w)) for w in self.watches.values()]
        if all(write.reach is None and write.nodes is None for _watch, write in taken):
            return False  # the usual case between changes: no thread for nothing
        written = await asyncio.to_thread(self._write_all, taken)
        return self._recorded(taken, written)

    def _take(self, watch: ClusterWatch) -> _Write:
        """What the store must hear of one cluster, taken out of its view. Runs on the
        event loop."""
        view = watch.view
        reach = None
        if view.reachability_changed:
            reach = (watch.reachability.reachable, watch.reachability.why)
            view.reachability_changed = False
        if not watch.reachability.reachable or not (view.changed or view.gone):
            return _Write(reach, None)
        self._note_lost(view, time.monotonic())
        changed, gone, complete = view.changed, view.gone, view.complete
        view.changed, view.gone, view.complete = set(), set(), False
        nodes = [view.nodes[n] for n in sorted(changed) if n in view.nodes]
        return _Write(reach, (nodes, sorted(gone), complete))

    def _write_all(self, taken: list[tuple[ClusterWatch, _Write]]) -> list[bool | None]:
        """Per cluster: whether a node's record changed; None where the write failed."""
        results: list[bool | None] = []
        for watch, write in taken:
            settings = watch.view.settings
            changed = False
            try:
                if write.reach is not None:
                    changed |= self.store.clusters.set_cluster_reachable(
                        self.now(), settings.name, write.reach[0], write.reach[1]
                    )
                if write.nodes is not None:
                    nodes, gone, complete = write.nodes
                    changed |= bool(
                        self.store.clusters.sync_cluster_nodes(
                            self.now(),
                            settings.name,
                            nodes,
                            gone=gone,
                            complete=complete,
                            context=settings.context,
                        )
                    )
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("could not record cluster %s's nodes", settings.name)
                results.append(None)
                continue
            results.append(changed)
        return results

    def _recorded(
        self, taken: list[tuple[ClusterWatch, _Write]], written: list[bool | None]
    ) -> bool:
        """After the writes (on the loop): a cluster whose write failed is written whole
        at the next flush."""
        for (watch, _write), result in zip(taken, written, strict=True):
            if result is None:
                view = watch.view
                view.changed = set(view.nodes)
                view.complete = view.listed
                view.reachability_changed = True
        return any(bool(r) for r in written)

    def _note_lost(self, view: ClusterView, now: float) -> None:
        """Which of the cluster's nodes are lost to it (not Ready, or deleted), since when.
        Only what a reachable API server says counts: an outage of the API server is not
        the loss of its nodes."""
        cluster = view.settings.name
        for name in view.gone:
            self.lost_since.setdefault(name, (now, f"was deleted from cluster {cluster}"))
        for name in view.changed:
            state = view.nodes.get(name)
            if state is None:
                continue
            if state.ready:
                self.lost_since.pop(name, None)
                self.acted_on.discard(name)
            else:
                why = f"of cluster {cluster} is not Ready ({state.why_not_ready})"
                self.lost_since.setdefault(name, (now, why))

    def end_sessions_on_lost_nodes(self, now: float) -> None:
        """End the sessions of nodes lost for ``node_lost_grace_seconds`` (a kubelet that
        restarts comes back sooner), once per loss."""
        for name, (since, why) in sorted(self.lost_since.items()):
            if name in self.acted_on or now - since < self.node_lost_grace_seconds:
                continue
            try:
                stops = self.store.clusters.stop_sessions_on_node(self.now(), name, why)
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("could not end the sessions of lost node %s", name)
                continue
            self.acted_on.add(name)
            if stops:
                self.log.warning(
                    "node %s %s: ending its sessions",
                    name,
                    why,
                    extra={"workloads": [s.workload_id for s in stops]},
                )
                self.stop_sessions(stops)

    async def live_pod_markers(self) -> frozenset[str] | None:
        """The process markers of every pod gpufleet made in any cluster (a pod on a node
        that does not answer may still run); None when a cluster cannot list its pods."""
        markers: set[str] = set()
        for watch in self.watches.values():
            pods = await self._gpufleet_pods(watch)
            if pods is None:
                return None
            markers.update(pod.marker for pod in pods)
        return frozenset(markers)

    async def delete_pods_with_marker(self, marker: str) -> int:
        """Delete gpufleet's pods carrying ``marker`` in every cluster that answers (the
        reconciler's ``orphan-pods``), with their own grace period; how many. A pod already
        being deleted is left to finish (asking again would change nothing, and the
        reconciler would report the same repair every pass until it is gone)."""
        from kubernetes_asyncio import client

        deleted = 0
        for watch in self.watches.values():
            for pod in await self._gpufleet_pods(watch) or []:
                if pod.marker != marker or pod.terminating:
                    continue
                try:
                    await client.CoreV1Api(watch.api).delete_namespaced_pod(
                        pod.name, pod.namespace, _request_timeout=15
                    )
                    deleted += 1
                except Exception as e:  # noqa: BLE001 - logged; the next pass tries again
                    self.log.warning(
                        "cluster %s: could not delete pod %s/%s: %s",
                        watch.name,
                        pod.namespace,
                        pod.name,
                        e,
                    )
        return deleted

    async def _gpufleet_pods(self, watch: ClusterWatch) -> list[_GpufleetPod] | None:
        """Every pod gpufleet made in the cluster; None when it cannot list them."""
        from kubernetes_asyncio import client

        from ..recovery.processes import workload_marker
        from ..spawner.kube_manifests import COMMON_LABELS, MARKER_LABEL

        if not watch.reachability.reachable or watch.api is None:
            return None
        selector = ",".join(f"{k}={v}" for k, v in sorted(COMMON_LABELS.items()))
        core: Any = client.CoreV1Api(watch.api)
        try:
            response: Any = await core.list_pod_for_all_namespaces(
                label_selector=selector, _preload_content=False, _request_timeout=15
            )
            async with response:
                body = json.loads(await response.read())
        except Exception as e:  # noqa: BLE001 - any failure means "cannot say"
            self.log.warning("cluster %s: cannot list gpufleet's pods: %s", watch.name, e)
            return None
        pods = []
        for pod in body.get("items", []):
            metadata = pod.get("metadata") or {}
            found = (metadata.get("annotations") or {}).get(MARKER_LABEL)
            if found:
                pods.append(
                    _GpufleetPod(
                        workload_marker(str(found)),
                        metadata.get("namespace", ""),
                        metadata["name"],
                        terminating=bool(metadata.get("deletionTimestamp")),
                    )
                )
        return pods

    async def cordon(self, node: str, cluster: str, cordoned: bool) -> None:
        """Set the node's ``spec.unschedulable`` in its cluster: the one truth of a cordon,
        which the watch then brings into the fleet's inventory."""
        from kubernetes_asyncio import client

        watch = self.watches[cluster]
        await client.CoreV1Api(watch.api).patch_node(
            node, {"spec": {"unschedulable": cordoned}}, _request_timeout=10
        )
