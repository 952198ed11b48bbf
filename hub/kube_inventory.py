"""The Kubernetes clusters' inventory as one of the controller's loops: every cluster's Node
watch (``clusters/node_watch.py``) written into the store by the leader, the sessions on
lost nodes ended, and the pods gpufleet made listed and deleted for the reconciler.

Only the controller holding the database lease writes; every controller watches, so one
that takes the lease over writes a complete listing of every cluster at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Enum, Float
from traitlets.config import Configurable

from ..clusters.kube_config import ClusterSettings
from ..clusters.node_watch import ClusterView, ClusterWatch, cordon_patch
from ..scheduler.errors import SchedulerError
from ..state.clusters import ClusterInventoryStore, ClusterNodeState
from ..state.cycle import Stop
from ..state.jobs import JobStore
from ..state.operations import NodeOperationStore
from .components import LoopComponent

CORDON_TRIES = 3  # a Node's status changes every few seconds; its spec seldom


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
    """The repositories the inventory writes the clusters' nodes to and ends the jobs of
    lost nodes through, and where it claims the recycles that delete a Node
    (``FleetStore``'s)."""

    clusters: ClusterInventoryStore
    jobs: JobStore
    node_operations: NodeOperationStore


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

    recycle_action = Enum(
        ["agent", "delete-node"],
        "agent",
        help="How a Kubernetes node is recycled once a recycle empties it (docs/recovery.md, "
        "'Maintenance'): 'agent': its node agent (the DaemonSet) runs "
        "c.NodeAgent.recycle_command on the node, then its diagnostics, as on the local "
        "backend; 'delete-node': the controller deletes the Node, for its node group "
        "(cluster autoscaler, Karpenter, a managed node pool) to replace the machine with a "
        "new node, which joins under a name of its own.",
    ).tag(config=True)

    def __init__(
        self,
        clusters: Sequence[ClusterSettings],
        store: ClusterState,
        *,
        now: Callable[[], datetime],
        kick: Callable[[], None],
        stop_sessions: Callable[[list[Stop]], None] = lambda stops: None,
        jobs_changed: Callable[[list[int]], None] = lambda workloads: None,
        parent: Configurable | None = None,
        **kwargs: Any,
    ):
        super().__init__(parent=parent, **kwargs)
        self.stop_sessions = stop_sessions
        # Jobs a lost node stopped or restarted: their cluster manager acts on them now.
        self.jobs_changed = jobs_changed
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
        self._pushed: set[tuple[str, datetime]] = set()  # recovery cordons made in clusters

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
                await self.push_recovery_cordons()
                await self.replace_recycled_nodes()

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
        restarts comes back sooner), once per loss; their jobs resume elsewhere."""
        for name, (since, why) in sorted(self.lost_since.items()):
            if name in self.acted_on or now - since < self.node_lost_grace_seconds:
                continue
            try:
                stops = self.store.clusters.stop_sessions_on_node(self.now(), name, why)
                jobs = self.store.jobs.lose_cluster_node(self.now(), name, why)
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("could not end the sessions and jobs of lost node %s", name)
                continue
            self.acted_on.add(name)
            if jobs.changed:
                self.log.warning(
                    "node %s %s: its jobs resume elsewhere",
                    name,
                    why,
                    extra={"workloads": jobs.changed},
                )
                self.jobs_changed(jobs.changed)
                self.kick()
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

        from ..clusters.manifests import COMMON_LABELS, MARKER_LABEL
        from ..recovery.processes import workload_marker

        if not watch.reachability.reachable or watch.api is None:
            return None
        # Sessions' and jobs' pods alike: every pod gpufleet made names who made it.
        managed_by = "app.kubernetes.io/managed-by"
        selector = f"{managed_by}={COMMON_LABELS[managed_by]}"
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

    async def push_recovery_cordons(self) -> None:
        """Make the recovery loop's cordons of Kubernetes nodes (made in the store when it
        blames a node) in their clusters, the one truth of a cordon: once each, or until
        the Node shows it. A cluster that refuses is tried again at the next pass."""
        try:
            wanted = await asyncio.to_thread(self.store.clusters.recovery_cordons, self.now())
        except (SQLAlchemyError, SchedulerError):
            self.log.exception("could not read the recovery loop's cordons")
            return
        self._pushed &= {(node, at) for node, _cluster, at in wanted}
        for node, cluster, at in wanted:
            watch = self.watches.get(cluster)
            seen = watch.view.nodes.get(node) if watch is not None else None
            if watch is None or seen is None or seen.unschedulable or (node, at) in self._pushed:
                continue
            try:
                await self.cordon(node, cluster, True)
            except Exception as e:  # noqa: BLE001 (an API server's refusal, or no answer)
                self.log.warning(
                    "could not cordon %s in cluster %s for the recovery loop: %s", node, cluster, e
                )
                continue
            self._pushed.add((node, at))
            self.log.info("cordoned %s in cluster %s for the recovery loop", node, cluster)

    async def replace_recycled_nodes(self) -> None:
        """Run the recycles asked of the clusters (``recycle_action`` 'delete-node'): delete
        each Node, and say so as the operation's end (a Node already gone counts)."""
        if self.recycle_action != "delete-node":
            return
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        operations = self.store.node_operations
        for name, watch in self.watches.items():
            try:
                nodes = await asyncio.to_thread(self.store.clusters.node_names, name)
                claimed = operations.claim_node_operations(self.now(), nodes, by_cluster=True)
            except (SQLAlchemyError, SchedulerError):
                self.log.exception("could not claim cluster %s's recycles", name)
                continue
            for operation in claimed:
                result, error = None, ""
                try:
                    await client.CoreV1Api(watch.api).delete_node(
                        operation.node, _request_timeout=15
                    )
                except ApiException as e:
                    if e.status != 404:
                        error = (
                            f"cluster {name} refused to delete Node {operation.node}: {e.reason}"
                        )
                except Exception as e:  # noqa: BLE001 - said as the operation's failure
                    error = f"cluster {name} did not answer: {e}"
                if not error:
                    result = {
                        "summary": f"Node {operation.node} deleted in cluster {name}",
                        "replaced": True,
                    }
                try:
                    operations.report_node_operation(
                        self.now(),
                        operation.id,
                        state="failed" if error else "done",
                        result=result,
                        error=error,
                    )
                except (SQLAlchemyError, SchedulerError):
                    self.log.exception("could not report recycle %s", operation.id)
                self.log.info(
                    "recycle of %s in cluster %s: %s", operation.node, name, error or "deleted"
                )

    async def cordon(self, node: str, cluster: str, cordoned: bool) -> None:
        """Cordon or uncordon the node in its cluster (``spec.unschedulable`` and gpufleet's
        taint, ``cordon_patch``): the one truth of a cordon, which the watch then brings
        into the fleet's inventory. A Node changed meanwhile is read again."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        core: Any = client.CoreV1Api(self.watches[cluster].api)
        for attempt in range(CORDON_TRIES):
            current = await core.read_node(node, _request_timeout=10, _preload_content=False)
            async with current:
                body = json.loads(await current.read())
            try:
                await core.patch_node(node, cordon_patch(body, cordoned), _request_timeout=10)
                return
            except ApiException as e:
                if e.status != 409 or attempt == CORDON_TRIES - 1:
                    raise
