"""KubeGPUSpawner: KubeSpawner 7 behind the gpufleet queue, on several Kubernetes clusters.

The handshake is :mod:`.handshake`'s: the request waits in the controller's queue (position
and reason on the spawn page) until the scheduler places it on a node of one of the fleet's
clusters. Then the pod goes to that cluster and node, built by the pure
:func:`.kube_manifests.session_pod` (required node affinity, so kube-scheduler still checks
it; the GPU limit; a priority class that never preempts; non-root; no service-account
token) with its NetworkPolicy, and the pod's events become progress messages.

What differs from KubeSpawner: KubeSpawner loads one process-wide client configuration and
shares one pod and one event reflector per namespace, so every server lives on one cluster
(kubespawner#516). Here each cluster of ``c.FleetController.clusters`` has its own API
client (its kubeconfig and context), and reflectors are keyed by cluster, so one hub spawns
on any of them; a server's cluster is in its saved state, and survives a hub restart.

GPUs are released only once the pod is gone (``_nothing_left_running``): a pod that may
still run keeps its GPUs allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from functools import partial
from typing import Any

import httpx
from jupyterhub.spawner import Spawner
from jupyterhub.utils import exponential_backoff
from kubespawner import KubeSpawner
from kubespawner.reflector import ResourceReflector
from kubespawner.spawner import EventReflector, PodReflector
from tornado import web
from traitlets import Bool, Dict, Float, Integer, List, Unicode, default

from ..clusters import workload_processes
from ..clusters.kube_config import ClusterConfigError, ClusterSettings, api_client, parse_clusters
from ..clusters.manifests import (
    KUBE_DNS,
    SessionPod,
    Volume,
    session_network_policy,
    session_pod,
)
from ..clusters.network_peers import address_endpoint, peer_from_config
from ..snapshotter.runner import SnapshotFailed
from .client import WorkloadStatus
from .handshake import GPUQueueSpawner
from .kube_snapshots import KubeSnapshotMixin

__all__ = ["KubeGPUSpawner"]

# One API client per cluster and event loop, shared by every spawner of the hub.
_clients: dict[tuple[int, str], Any] = {}


class _ClusterReflectorMixin(ResourceReflector):
    """A KubeSpawner reflector on the API client it is given, not the process-wide one."""

    def __init__(self, *args: Any, api: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.api = api


class ClusterPodReflector(_ClusterReflectorMixin, PodReflector):
    pass


class ClusterEventReflector(_ClusterReflectorMixin, EventReflector):
    pass


class KubeGPUSpawner(KubeSnapshotMixin, GPUQueueSpawner, KubeSpawner):
    clusters = List(
        Dict(),
        help="The fleet's Kubernetes clusters; by default c.FleetController.clusters, so "
        "the controller and the spawner name them once (docs/kubernetes.md).",
    ).tag(config=True)

    @default("clusters")
    def _default_clusters(self) -> list[dict[str, Any]]:
        return list(self.config.FleetController.get("clusters", []))

    termination_grace_seconds = Integer(
        60,
        help="Seconds a session pod gets between SIGTERM and SIGKILL when it stops: long "
        "enough for the server to save what it must.",
    ).tag(config=True)

    session_priority_class = Unicode(
        "gpufleet-session",
        help="The PriorityClass of session pods. Create it with preemptionPolicy: Never "
        "(docs/kubernetes.md): gpufleet decides preemption, kube-scheduler never does.",
    ).tag(config=True)

    session_volumes = List(
        Dict(),
        help="Volumes of every session pod: {name, mount_path, kind: pvc|hostPath|emptyDir, "
        "source, sub_path, read_only, medium, size_limit}; {username} and {servername} in "
        "source and sub_path are the server's (escaped as KubeSpawner escapes them).",
    ).tag(config=True)

    network_proxy = Dict(
        help="Who may reach a session pod besides the hub: {cidr} or {pod_labels, "
        "namespace_labels}. Default: the hub's own address.",
    ).tag(config=True)

    network_hub = Dict(
        help="The hub's API as sessions reach it: {cidr} or {pod_labels, namespace_labels}, "
        "and {ports}. Default: the host and port of the hub's API URL.",
    ).tag(config=True)

    network_controller = Dict(
        help="gpufleet's controller as sessions reach it, as network_hub. Default: the host "
        "and port of controller_api_url.",
    ).tag(config=True)

    network_dns = Bool(
        True, help="Let session pods reach kube-dns in kube-system (UDP and TCP 53)."
    ).tag(config=True)

    readiness_interval = Float(
        0.05,
        help="Seconds between probes of a starting server once its pod runs: the spawn "
        "ends as soon as the server answers through its pod's address.",
    ).tag(config=True)

    session_extension = Bool(
        True,
        help="Start the session's server with gpufleet's server extension (activity for "
        "the culler, its notices); the image must have gpufleet installed.",
    ).tag(config=True)

    @default("delete_grace_period")
    def _default_delete_grace_period(self) -> int:
        return int(self.termination_grace_seconds)

    @default("cmd")
    def _default_cmd(self) -> list[str]:
        return ["jupyterhub-singleuser"]

    def __init__(self, *args: Any, **kwargs: Any):
        # Not KubeSpawner.__init__: it loads one process-wide client configuration (and
        # fails where there is none). A cluster's client is chosen at placement.
        Spawner.__init__(self, *args, **kwargs)
        self.pod_name = self._expand_user_properties(self.pod_name_template)
        self.dns_name = self.dns_name_template.format(namespace=self.namespace, name=self.pod_name)
        self.secret_name = self._expand_user_properties(self.secret_name_template)
        self.pvc_name = self._expand_user_properties(self.pvc_name_template)
        self._pvc_exists = False
        if getattr(self, "port", 0) == 0:
            self.port = 8888  # KubeSpawner's default port, as its __init__ sets it
        self._start_future: Any = None
        self.api: Any = None
        self._uid = self._gid = 0

    # -------------------------------------------------------------- clusters
    _known_clusters: dict[str, ClusterSettings] | None = None

    def cluster_settings(self, name: str) -> ClusterSettings:
        # Parsed once per spawner (it checks the kubeconfig files): poll asks on every call.
        if self._known_clusters is None:
            try:
                self._known_clusters = {c.name: c for c in parse_clusters(self.clusters)}
            except ClusterConfigError as e:
                raise web.HTTPError(500, f"c.FleetController.clusters: {e}") from e
        known = self._known_clusters
        if name not in known:
            raise web.HTTPError(
                500,
                f"the scheduler placed this server on cluster {name!r}, which is not in "
                "c.FleetController.clusters of the hub: give the hub the same list as the "
                "controller",
            )
        return known[name]

    async def _use_cluster(self, name: str) -> ClusterSettings:
        """Talk to cluster ``name`` from now on (its namespace, its shared client)."""
        from kubernetes_asyncio import client

        settings = self.cluster_settings(name)
        key = (id(asyncio.get_running_loop()), name)
        if key not in _clients:
            try:
                _clients[key] = await api_client(settings)
            except ClusterConfigError as e:
                raise web.HTTPError(503, str(e)) from e
        self.cluster_name = name
        self.namespace = settings.namespace
        self.dns_name = self.dns_name_template.format(namespace=self.namespace, name=self.pod_name)
        self.api = client.CoreV1Api(_clients[key])
        return settings

    def _get_reflector_key(self, kind: str) -> Any:
        return (self.cluster_name, kind, self.namespace)

    async def _start_watching_pods(self, replace: bool = False) -> Any:
        return await self._start_reflector(
            kind="pods",
            reflector_class=ClusterPodReflector,
            labels={"component": self.component_label},
            omit_namespace=False,
            replace=replace,
            api=self.api,
        )

    async def _start_watching_events(self, replace: bool = False) -> Any:
        return await self._start_reflector(
            kind="events",
            reflector_class=ClusterEventReflector,
            fields={"involvedObject.kind": "Pod"},
            omit_namespace=False,
            replace=replace,
            api=self.api,
        )

    async def load_user_options(self) -> None:
        """The form's options are gpufleet's (project, GPU type and count, profile), which
        the controller checked; KubeSpawner's profile list does not apply."""

    # -------------------------------------------------------------- manifests
    def session_pod(self) -> SessionPod:
        settings = self.cluster_settings(self.cluster_name)
        assert self.workload_id is not None
        args = [*self.get_args(), "--ip=$(GPUFLEET_POD_IP)", f"--port={self.port}"]
        if self.session_extension:
            args.append("--ServerApp.jpserver_extensions=gpufleet.culler.session_extension=True")
        env = {k: v for k, v in self.get_env().items() if k not in _SET_BY_THE_POD}
        return SessionPod(
            name=self.pod_name,
            namespace=self.namespace,
            cluster=self.cluster_name,
            node=self.node_name,
            node_selector=settings.gpu_node_selector,
            workload_id=self.workload_id,
            user=self.user.name,
            project=str(self.user_options.get("project", "")),
            server_name=self.name,
            marker=self.marker,
            image=self.image,
            command=tuple(self.cmd or ()),
            args=tuple(args),
            env=env,
            image_pull_policy=self.image_pull_policy or None,
            port=self.port,
            base_url=self.server.base_url if self.server else None,
            uid=self._uid,
            gid=self._gid,
            gpu_resource=settings.gpu_resource,
            gpus=len(self.gpu_uuids),
            priority_class_name=self.session_priority_class,
            termination_grace_seconds=int(self.termination_grace_seconds),
            volumes=tuple(self._volumes()),
            extra_labels={"component": self.component_label},
        )

    def _volumes(self) -> list[Volume]:
        volumes = []
        for spec in self.session_volumes:
            fields = dict(spec)
            for key in ("source", "sub_path"):
                if key in fields:
                    fields[key] = self._expand_user_properties(str(fields[key]))
            volumes.append(Volume(**fields))
        return volumes

    async def get_pod_manifest(self) -> Any:
        try:
            return session_pod(self.session_pod())
        except ValueError as e:
            raise web.HTTPError(500, f"the session's pod cannot be built: {e}") from e

    async def _make_create_pod_request(self, pod: dict[str, Any], request_timeout: float) -> bool:
        """Create the pod (a manifest dict, not KubeSpawner's V1Pod). A pod of the same name
        left from an earlier start is deleted first and the creation retried: through
        KubeSpawner's stop, not this class's, which would release the new start's GPUs."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await asyncio.wait_for(
                self.api.create_namespaced_pod(self.namespace, pod), request_timeout
            )
            return True
        except TimeoutError:
            return False
        except ApiException as e:
            if e.status != 409:
                raise
        self.log.info(
            "deleting the stale pod %s/%s before creating it", self.namespace, self.pod_name
        )
        await KubeSpawner.stop(self, now=True)
        return False

    def network_policy(self) -> dict[str, Any]:
        """The session pod's policy: its cluster's own peers where it has them, else the
        options' (docs/kubernetes.md, "NetworkPolicy")."""
        own = self.cluster_settings(self.cluster_name).network
        option = "c.KubeGPUSpawner.network_{} or the cluster's network.{}"
        hub = address_endpoint(
            self.hub.api_url, option.format("hub", "hub"), own.hub, self.network_hub
        )
        controller = address_endpoint(
            self.controller_api_url,
            option.format("controller", "controller"),
            own.controller,
            self.network_controller,
        )
        proxy_spec = own.proxy or self.network_proxy
        return session_network_policy(
            self.session_pod(),
            proxy=peer_from_config(proxy_spec) if proxy_spec else hub.peer,
            hub=hub,
            controller=controller,
            dns=KUBE_DNS if self.network_dns else None,
        )

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        if self.workload_id is not None:
            env["GPUFLEET_NODE"] = self.node_name
            env["GPUFLEET_CLUSTER"] = self.cluster_name
            env["GPUFLEET_PROJECT"] = str(self.user_options.get("project", ""))
            env["GPUFLEET_CONTROLLER_API_URL"] = self.controller_api_url
        return env

    def _get_pod_url(self, pod: dict[str, Any]) -> str:
        settings = self.cluster_settings(self.cluster_name)
        return settings.pod_address(
            ip=pod["status"]["podIP"], port=self._get_pod_port(pod), pod=pod["metadata"]["name"]
        )

    # -------------------------------------------------------------- start
    async def start(self) -> Any:
        return await self._start_when_placed(self._start_pod)

    async def _start_pod(self, status: WorkloadStatus) -> str:
        from kubernetes_asyncio.client.exceptions import ApiException

        await self._use_cluster(self.cluster_name)
        self._report(
            f"GPUs assigned: {len(self.gpu_uuids)} × {status.gpu_type} on "
            f"{self.node_name} in cluster {self.cluster_name}",
            25,
        )
        account = await self._until_answered(
            lambda: self.controller.account(self.user.name), self.queue_timeout
        )
        self._uid, self._gid = int(account["uid"]), int(account["gid"])
        notice = await self._restore_on_node()
        self._server_started = True  # from here on a failure deletes the policy and the pod
        await self._apply_network_policy()
        try:
            self._start_future = asyncio.ensure_future(self._start())
            url = await self._start_future
        except ApiException as e:
            raise _api_error(self.cluster_name, "create the session's pod", e) from e
        self._stop_renewing()
        workload_id = status.id
        sources = self.snapshot_sources() if self.snapshot_volumes else None
        await self._until_answered(
            lambda: self.controller.running(workload_id, sources, notice), 120
        )
        self._report("Server is up", 100)
        return str(url)

    async def _stop_server(self, now: bool) -> None:
        if self.api is not None:
            await KubeSpawner.stop(self, now=now)
            await self._delete_network_policy()

    async def _apply_network_policy(self) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        policy = self.network_policy()
        networking: Any = client.NetworkingV1Api(self.api.api_client)
        try:
            await networking.create_namespaced_network_policy(self.namespace, policy)
        except ApiException as e:
            if e.status != 409:
                raise _api_error(self.cluster_name, "create the session's NetworkPolicy", e) from e
            await networking.replace_namespaced_network_policy(
                self.pod_name, self.namespace, policy
            )

    async def _start(self) -> str:
        """Create the pod, then return its URL once its server answers there.

        Not KubeSpawner's wait for the pod's Ready condition: that polls with a back-off
        growing to 5 s, after a readiness probe period, and the hub then checks the URL
        again; here the server is probed every ``readiness_interval`` once the pod runs,
        as the local backend probes its server.
        """
        await asyncio.gather(self._start_watching_pods(), self._start_watching_events())
        # Earlier pods of this server (a restart) keep their events: show only this one's.
        events = self.events
        if events:
            self._last_event = events[-1]["metadata"]["uid"]
        follower = asyncio.create_task(self._follow_pod_events())
        try:
            pod = await self.get_pod_manifest()
            key = f"{self.namespace}/{self.pod_name}"
            await exponential_backoff(
                partial(self._make_create_pod_request, pod, self.k8s_api_request_timeout),
                f"could not create pod {key}",
                timeout=self.k8s_api_request_retry_timeout,
            )
            return await self._until_answering(key)
        finally:
            follower.cancel()

    async def _until_answering(self, key: str) -> str:
        deadline = time.monotonic() + self.start_timeout
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                pod = self.pod_reflector.pods.get(key)
                status = (pod or {}).get("status") or {}
                if status.get("phase") in ("Failed", "Succeeded"):
                    raise web.HTTPError(
                        500, f"pod {key} ended before its server answered: {_why_ended(status)}"
                    )
                if pod is not None and status.get("phase") == "Running" and status.get("podIP"):
                    url = self._get_pod_url(pod)
                    try:
                        answer = await client.get(f"{url}{self.server.base_url}api")
                        if answer.status_code < 500:
                            self.pod_id = pod["metadata"]["uid"]
                            return url
                    except httpx.TransportError:
                        pass
                await asyncio.sleep(self.readiness_interval)
        raise TimeoutError(f"pod {key} did not answer within {self.start_timeout} s")

    async def _follow_pod_events(self) -> None:
        """The pod's events (scheduled, image, started, FailedScheduling...) as progress."""
        seen = 0
        while True:
            events = self.events
            if len(events) < seen:
                seen = 0  # the reflector was replaced: its list starts again
            for event in events[seen:]:
                reason = event.get("reason") or event.get("type") or ""
                self._report(f"{reason}: {event.get('message', '')}", 50)
            seen = len(events)
            await asyncio.sleep(0.5)

    # -------------------------------------------------------------- poll and stop
    async def poll(self) -> int | None:
        if self.api is None:
            if not self.cluster_name:
                return 0
            await self._use_cluster(self.cluster_name)
        result: int | None = await KubeSpawner.poll(self)
        return result

    async def stop(self, now: bool = False) -> None:
        if self.api is None and self.cluster_name:
            await self._use_cluster(self.cluster_name)
        snapshotted = self.workload_id is not None and bool(self.snapshot_volumes)
        if snapshotted and self.snapshot_container_layer:
            # The container's layer goes with the pod: it is read while the pod runs.
            try:
                await self._pass_on_node("stop", container=True)
            except SnapshotFailed as e:
                self.log.warning(
                    "the snapshot of %s before its stop failed (its volumes are still "
                    "snapshotted once the pod is gone): %s",
                    self._log_name,
                    e,
                )
        await self._stop_server(now=now)
        if snapshotted:
            await self._save_then_release()
            return
        await self._release("stopped", "")

    async def _delete_network_policy(self) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            await client.NetworkingV1Api(self.api.api_client).delete_namespaced_network_policy(
                self.pod_name, self.namespace
            )

    async def _nothing_left_running(self) -> bool:
        if self.api is None:
            return True
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            pod = await self.api.read_namespaced_pod(self.pod_name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return True
            self.log.error(
                "could not tell whether pod %s/%s of workload %s is gone (%s); its GPUs stay "
                "allocated",
                self.namespace,
                self.pod_name,
                self.workload_id,
                e.reason,
            )
            return False
        self.log.error(
            "pod %s/%s of workload %s still exists (phase %s); its GPUs stay allocated until "
            "it is gone",
            self.namespace,
            self.pod_name,
            self.workload_id,
            pod.status.phase if pod.status else "unknown",
        )
        return False


# The device plugin sets these in the container: a spawner's value would be wrong there.
_SET_BY_THE_POD = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "GPUFLEET_POD_IP",
        "GPUFLEET_WORKLOAD_ID",
        workload_processes.MARKER_VARIABLE,
    }
)


def _why_ended(status: dict[str, Any]) -> str:
    """A pod's own account of why it ended: its reason, else its container's."""
    if status.get("reason") or status.get("message"):
        return f"{status.get('reason', '')} {status.get('message', '')}".strip()
    for container in status.get("containerStatuses") or []:
        ended = (container.get("state") or {}).get("terminated")
        if ended:
            return (
                f"container {container.get('name')} exited {ended.get('exitCode')} "
                f"({ended.get('reason', '')}) {ended.get('message', '')}"
            ).strip()
    return str(status.get("phase"))


def _api_error(cluster: str, what: str, error: Any) -> web.HTTPError:
    if error.status == 403:
        return web.HTTPError(
            503,
            f"cluster {cluster} does not let gpufleet's spawner {what} (403 Forbidden): grant "
            "its identity the Role in docs/kubernetes.md",
        )
    return web.HTTPError(503, f"cluster {cluster} could not {what}: {error.status} {error.reason}")
