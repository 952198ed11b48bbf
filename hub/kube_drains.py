"""A drain's evictions on a Kubernetes node (``clusters/node_drain.py`` decides which pods).

The controller's drain cordons the node in its cluster and stops gpufleet's own sessions
and jobs there its own way; this evicts the rest through the Eviction API, as ``kubectl
drain`` does, until none is left, so a PodDisruptionBudget holds: a refused eviction (429)
is asked again every ``eviction_retry_seconds``, for at most ``eviction_deadline_seconds``.
Each step is an event on the node: each pod evicted, each pod whose eviction waits (once,
with the API server's words, which name the budget), the end, or giving up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

from traitlets import Float
from traitlets.config import LoggingConfigurable

from ..api.events import EventKind
from ..clusters.node_drain import NodePod, eviction, to_evict
from ..state.events import EventStore


class DrainState(Protocol):
    events: EventStore


class ClusterClients(Protocol):
    """The per-cluster API clients (``KubeInventory.watches[cluster].api``)."""

    @property
    def watches(self) -> Mapping[str, Any]: ...


class KubeDrains(LoggingConfigurable):
    eviction_retry_seconds = Float(
        5.0,
        min=0.1,
        help="Seconds between a drain's tries to evict the pods a PodDisruptionBudget does "
        "not let go yet (kubectl drain waits 5 s).",
    ).tag(config=True)

    eviction_deadline_seconds = Float(
        3600.0,
        min=1,
        help="A drain stops evicting after this long, with an event naming the pods left "
        "(the node stays cordoned: an admin decides).",
    ).tag(config=True)

    def __init__(
        self,
        clusters: ClusterClients,
        store: DrainState,
        now: Callable[[], datetime],
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.clusters = clusters
        self.store = store
        self.now = now
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # policy/v1 Eviction until a cluster's API server says it serves only v1beta1.
        self.versions: dict[str, str] = {}

    def start(self, node: str, cluster: str, by: str) -> None:
        """Evict what else runs on ``node``, in the background; a drain of a node being
        drained already goes on as it is."""
        running = self.tasks.get(node)
        if running is not None and not running.done():
            return
        self.tasks[node] = asyncio.create_task(self._drain(node, cluster, by))

    def _event(self, kind: EventKind, message: str, node: str, by: str, **data: Any) -> None:
        try:
            self.store.events.record_event(
                self.now(), kind, message, node=node, cause=by, data=data
            )
        except Exception:
            self.log.exception("could not record the drain event: %s", message)

    async def _drain(self, node: str, cluster: str, by: str) -> None:
        from kubernetes_asyncio import client

        core: Any = client.CoreV1Api(self.clusters.watches[cluster].api)
        deadline = time.monotonic() + self.eviction_deadline_seconds
        waiting_said: set[str] = set()
        evicted = 0
        while True:
            try:
                listed = await core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}",
                    _preload_content=False,
                    _request_timeout=15,
                )
                async with listed:
                    pods = json.loads(await listed.read()).get("items", [])
            except Exception as e:  # noqa: BLE001 - no answer: the next round asks again
                self.log.warning("drain of %s: cannot list its pods: %s", node, e)
                pods = None
            left = to_evict(pods) if pods is not None else None
            if left == []:
                self._event(
                    EventKind.NODE_DRAIN_DONE,
                    f"node {node}: every pod gpufleet does not run there was evicted "
                    f"({evicted} evicted by this drain)",
                    node,
                    by,
                    evicted=evicted,
                )
                return
            for pod in left or []:
                refused = await self._evict(core, cluster, pod)
                if refused is None:
                    evicted += 1
                    self._event(
                        EventKind.NODE_POD_EVICTED,
                        f"node {node}: pod {pod.key} evicted",
                        node,
                        by,
                        pod=pod.key,
                    )
                elif pod.key not in waiting_said:
                    waiting_said.add(pod.key)
                    self._event(
                        EventKind.NODE_EVICTION_WAITING,
                        f"node {node}: the eviction of pod {pod.key} waits: {refused}; "
                        f"asked again every {self.eviction_retry_seconds:g} s",
                        node,
                        by,
                        pod=pod.key,
                    )
            if time.monotonic() > deadline:
                names = ", ".join(p.key for p in left or [])
                self._event(
                    EventKind.NODE_EVICTION_GIVEN_UP,
                    f"node {node}: the drain stopped evicting after "
                    f"{self.eviction_deadline_seconds:g} s; still there: {names or 'unknown'}",
                    node,
                    by,
                )
                return
            await asyncio.sleep(self.eviction_retry_seconds)

    async def _evict(self, core: Any, cluster: str, pod: NodePod) -> str | None:
        """None once evicted (or gone); else why not, in the API server's words."""
        from kubernetes_asyncio.client.exceptions import ApiException

        version = self.versions.get(cluster, "policy/v1")
        for _ in range(2):
            try:
                await core.create_namespaced_pod_eviction(
                    pod.name, pod.namespace, eviction(pod, version), _request_timeout=15
                )
                return None
            except ApiException as e:
                said = _message(e)
                if e.status == 404 and "pods" in said:
                    return None  # gone meanwhile
                if e.status in (400, 404, 415, 422) and version == "policy/v1":
                    version = self.versions[cluster] = "policy/v1beta1"
                    continue  # an API server before 1.22
                return said or f"HTTP {e.status}"
            except Exception as e:  # noqa: BLE001 - no answer: asked again next round
                return f"the API server did not answer ({e})"
        return "the API server refused both versions of the Eviction"


def _message(error: Any) -> str:
    try:
        return str(json.loads(error.body).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        return str(error.reason or "")
