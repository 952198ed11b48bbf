"""A test kubelet for a fake GPU node: runs the pods bound to it, for real, on this machine.

It acts with its node's own kubelet identity (``system:node:<name>``), so the Node
authorizer and NodeRestriction limit it exactly as they limit a real kubelet: it sees the
pods bound to its node, may change only their status and delete them, and reads only the
Secrets, ConfigMaps, claims and volumes they name. It lists the pods bound to its node
(``fieldSelector=spec.nodeName=<node>``), then watches from that list's resourceVersion,
and lists again when the watch's history is gone (410) or after a pause.

Each pod is a :class:`~.pods.PodWorker` on a thread of its own: admission (the node's GPU
UUIDs, as NVIDIA's device plugin hands them out, in ``NVIDIA_VISIBLE_DEVICES``), a loopback
address of its own as the pod IP (the node's with ``hostNetwork``), volumes, init
containers, containers in gpufleet's session sandbox as the pod's ``runAsUser`` (in the
kubelet's pid namespace with ``hostPID``; :mod:`.containers`), with the API server's
address (``KUBERNETES_SERVICE_HOST``), each in a memory cgroup of its own with its memory
limit (:mod:`.memory`: OOMKilled), readiness, restarts, termination with the
grace period, and the pod's status and Events. Threads, not asyncio, as the node's lease
renewer: synchronous tests running meanwhile cannot starve it.

Each pod's ``/etc/hosts`` is the kubelet's, with its peers' names under a headless Service
and its namespace's Services' names, as the cluster's DNS would answer them
(:mod:`.names`); the kubelet's
:class:`~.names.PeerDirectory` watches EndpointSlices for them as the tier's DNS identity
(``dns``), which a node's own identity may not.

``pause()`` stops everything a kubelet does for the API: pod handling and the node's Lease
and status (``FakeNode``'s renewer), so the real node-lifecycle controller finds the node
NotReady and taints it unreachable, as when a kubelet hangs; the containers keep running,
as they do under a hung kubelet. ``resume()`` starts both again, lists the pods again and
reposts their statuses. ``stop()`` kills every process it started and removes its files.

What a test reads: :meth:`Kubelet.logs` (a container's stdout and stderr, every run of it,
kept after the pod is gone until the kubelet stops) and :attr:`Kubelet.problems` (any bug
of the kubelet's own threads, which a test fixture can assert empty).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpufleet.recovery.fake_nvml import LIBRARY_NAME, FakeGpu, write_control
from gpufleet.snapshotter.sandbox import DEFAULT_SESSION_PREFIX, default_session_env, remove_tree

from . import memory
from .containers import SandboxSettings
from .cri_logs import read_cri
from .names import PeerDirectory
from .nodes import GPU_RESOURCE, FakeNode
from .pki import Identity, trust
from .pods import PodWorker
from .resources import DeviceTable, NodeContext, PodAddresses

WATCH_TIMEOUT_S = 5  # the server ends each watch after this; a stopped watch notices then
RETRY_S = 0.5


@dataclass(frozen=True)
class KubeletSettings:
    """What the tier's kubelets share: where their files live (each kubelet's under
    ``<directory>/<cluster>/<node>``; sandboxes are probed in ``directory``), the pool of
    pod addresses, the sessions' base environment that plays every image but those
    ``images`` names (repository: the environment that plays it), and the fake NVML
    library (None: pods get no NVML)."""

    directory: Path
    addresses: PodAddresses
    base_env: Path = Path(default_session_env())
    prefix: Path = Path(DEFAULT_SESSION_PREFIX)
    fake_nvml_library: Path | None = None
    images: Mapping[str, Path] = field(default_factory=dict)

    def sandbox(self) -> SandboxSettings:
        return SandboxSettings(self.directory, self.base_env, self.prefix, self.images)


def api_service_env(api: httpx.URL) -> dict[str, str]:
    """The variables by which a pod's in-cluster client finds the API server."""
    port = str(api.port or 443)
    return {
        "KUBERNETES_SERVICE_HOST": str(api.host),
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
    }


class Kubelet:
    """The test kubelet of one fake node (see the module docstring).

    ``devices``: the device IDs it hands out, by resource name (default: the node's GPU
    UUIDs as ``nvidia.com/gpu``). A resource the node does not advertise yet (a MIG profile,
    ``nvidia.com/mig-1g.10gb``) is added to its capacity at ``start()``, as a device plugin
    registers it, so the scheduler can place pods that ask for it.

    ``dns``: the identity its peer directory reads EndpointSlices and Services as (None:
    pods' hosts files hold no peers).
    """

    def __init__(
        self,
        node: FakeNode,
        settings: KubeletSettings,
        devices: Mapping[str, Sequence[str]] | None = None,
        dns: Identity | None = None,
    ) -> None:
        self.node = node
        self.settings = settings
        self.dns = dns
        self.directory = settings.directory / node.cluster / node.name
        served = dict(devices) if devices is not None else {GPU_RESOURCE: node.gpu_uuids}
        self.devices = DeviceTable(served)
        self.last_error: str | None = None  # the watch's last failure, for diagnosis
        self._workers: dict[str, PodWorker] = {}
        self._done: set[str] = set()  # uids of pods it is finished with: later events are stale
        self._log_dirs: dict[tuple[str, str], Path] = {}  # (namespace, pod) -> the newest's
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._relist = threading.Event()
        self._api: httpx.Client | None = None
        self._ctx: NodeContext | None = None
        self._watch_thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.node.name

    def __repr__(self) -> str:
        return f"Kubelet({self.name!r}, cluster={self.node.cluster!r})"

    # -------------------------------------------------------------- life
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._api = self.node.client()
        problem = memory.available()
        cgroups = None if problem else memory.MemoryCgroups()
        if cgroups is not None:
            cgroups.sweep()  # what a crashed test process left
        self._ctx = NodeContext(
            node=self.name,
            api=self._api,
            sandbox=self.settings.sandbox(),
            directory=self.directory / "pods",
            logs=self.directory / "logs",
            devices=self.devices,
            addresses=self.settings.addresses,
            fake_nvml_dir=self._fake_nvml(),
            memory=cgroups,
            memory_problem=problem or "",
            forget=self._forget,
            api_service_env=api_service_env(self._api.base_url),
        )
        if self.dns is not None:
            self._ctx.peers = PeerDirectory(
                f"{self.node.cluster}-{self.name}", self._dns_client, self._ctx.problems
            )
            self._ctx.peers.start()
        self._advertise()
        self._watch_thread = threading.Thread(
            target=self._watch, name=f"kubelet-{self.node.cluster}-{self.name}", daemon=True
        )
        self._watch_thread.start()

    def pause(self) -> None:
        """Stops handling pods and renewing the node's Lease and status; returns once no
        handling is under way. The containers keep running."""
        self._context.gate.close()
        self.node.stop_renewer()

    def resume(self) -> None:
        """Renews the Lease and handles pods again: lists them again and reposts each
        status (the node-lifecycle controller marked them not Ready meanwhile)."""
        self.node.start_renewer()
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.repost()
        self._relist.set()
        self._context.gate.open()

    @property
    def paused(self) -> bool:
        return not self._context.gate.is_open

    def stop(self) -> None:
        """Kills every process it started and removes its files (logs included)."""
        if self._ctx is None:
            return
        self._ctx.gate.close()
        self._ctx.stopping.set()
        self._stopped.set()
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop()
        for worker in workers:
            worker.thread.join(timeout=5.0)
        if self._ctx.peers is not None:
            self._ctx.peers.stop()
        if self._ctx.memory is not None:
            self._ctx.memory.close()  # what is still in use, the next start's sweep removes
        if self._watch_thread is not None:
            # It ends by itself within WATCH_TIMEOUT_S (or when the API server stops) and
            # handles nothing meanwhile: the gate is closed.
            self._watch_thread.join(timeout=0.2)
        if self._api is not None:
            self._api.close()
        if self.directory.exists():
            remove_tree(self.directory)

    # -------------------------------------------------------------- what tests read
    @property
    def problems(self) -> list[str]:
        """Tracebacks of the kubelet's own threads that died (a bug here, not in a pod)."""
        return list(self._context.problems)

    def logs(self, namespace: str, pod: str, container: str) -> str:
        """What ``container`` of the newest pod called ``pod`` in ``namespace`` wrote to its
        stdout and stderr, every run of it ("" before it started)."""
        with self._lock:
            newest = self._log_dirs.get((namespace, pod))
        if newest is None:
            raise FileNotFoundError(f"{self.name} has run no pod {namespace}/{pod}")
        if not newest.exists():  # removed with its pod: set aside (cri_logs.set_aside)
            newest = newest.parent.parent / "removed" / newest.name
        runs = sorted((newest / container).glob("*.log"), key=lambda p: int(p.stem))
        return "".join(read_cri(run) for run in runs)

    def held_devices(self) -> dict[str, frozenset[str]]:
        """The devices each live pod holds, by pod uid."""
        return self.devices.held()

    @property
    def _context(self) -> NodeContext:
        if self._ctx is None:
            raise RuntimeError(f"{self!r} was not started")
        return self._ctx

    @property
    def memory_cgroups(self) -> memory.MemoryCgroups | None:
        """Its containers' memory cgroups (None where the machine has no memory controller)."""
        return self._context.memory

    # -------------------------------------------------------------- the node
    def _dns_client(self) -> httpx.Client:
        assert self.dns is not None
        return httpx.Client(
            base_url=self.node.server,
            verify=trust(self.node.ca_path),
            headers={"Authorization": f"Bearer {self.dns.token}"},
            timeout=5.0,
        )

    def _fake_nvml(self) -> Path | None:
        """The node's fake NVML directory: the library and a control file that declares the
        node's GPUs (their UUIDs are the ones handed to pods), readable by every uid."""
        library = self.settings.fake_nvml_library
        if library is None:
            return None
        directory = self.directory / "nvml"
        directory.mkdir(mode=0o755, exist_ok=True)
        shutil.copy2(library, directory / LIBRARY_NAME)
        gpus = [
            FakeGpu(u, index=i, name=self.node.spec.gpu_model)
            for i, u in enumerate(self.node.gpu_uuids)
        ]
        write_control(directory / "control", gpus)
        os.chmod(directory / "control", 0o644)
        return directory

    def _advertise(self) -> None:
        """Adds resource names it serves that the node does not advertise to its capacity
        (a strategic merge patch: the renewer's own status posts keep them)."""
        extra = {
            name: str(len(ids)) for name, ids in self.devices.served.items() if name != GPU_RESOURCE
        }
        if not extra:
            return
        r = self._context.api.patch(
            f"/api/v1/nodes/{self.name}/status",
            json={"status": {"capacity": extra, "allocatable": extra}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        r.raise_for_status()

    # -------------------------------------------------------------- the watch
    def _watch(self) -> None:
        ctx = self._context
        try:
            with self.node.client() as api:
                version = ""
                while not self._stopped.is_set():
                    if not ctx.gate.is_open:
                        self._relist.set()
                        self._stopped.wait(0.1)
                        continue
                    try:
                        if self._relist.is_set() or not version:
                            self._relist.clear()
                            version = self._list(api)
                        version = self._follow(api, version)
                    except httpx.HTTPError as e:
                        self.last_error = f"{type(e).__name__}: {e}"
                        version = ""
                        self._stopped.wait(RETRY_S)
        except BaseException:
            ctx.problems.append(f"{self!r} watch: {traceback.format_exc()}")
            raise

    def _pods_path(self) -> tuple[str, dict[str, str]]:
        return "/api/v1/pods", {"fieldSelector": f"spec.nodeName={self.name}"}

    def _list(self, api: httpx.Client) -> str:
        """Every pod bound to the node, seen afresh; workers of pods no longer there are told
        they are deleted. The list's resourceVersion, or "" when paused meanwhile."""
        path, params = self._pods_path()
        r = api.get(path, params=params)
        r.raise_for_status()
        listed = r.json()
        if not self._context.gate.enter():
            return ""
        try:
            present = {}
            for pod in listed.get("items") or []:
                present[pod["metadata"]["uid"]] = pod
                self._observe("MODIFIED", pod)
            with self._lock:
                missing = [w for uid, w in self._workers.items() if uid not in present]
            for worker in missing:
                worker.observe(None)
        finally:
            self._context.gate.leave()
        return str(listed["metadata"]["resourceVersion"])

    def _follow(self, api: httpx.Client, version: str) -> str:
        """Watches from ``version`` until the server ends the watch; the last version seen,
        or "" when the history is gone (410) or events came while paused (list again)."""
        if not version:
            return ""
        path, params = self._pods_path()
        params = {
            **params,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = httpx.Timeout(5.0, read=WATCH_TIMEOUT_S + 10.0)
        with api.stream("GET", path, params=params, timeout=timeout) as response:
            if response.status_code == 410:
                return ""
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event: dict[str, Any] = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return ""  # 410 Gone (expired history), or another failure: list again
                version = str(obj.get("metadata", {}).get("resourceVersion", version))
                if kind == "BOOKMARK":
                    continue
                if self._stopped.is_set() or not self._context.gate.enter():
                    return ""
                try:
                    self._observe(str(kind), obj)
                finally:
                    self._context.gate.leave()
        return version

    def _observe(self, kind: str, pod: Mapping[str, Any]) -> None:
        uid = str(pod["metadata"]["uid"])
        with self._lock:
            if uid in self._done:
                return
            worker = self._workers.get(uid)
            if worker is None and kind != "DELETED":
                worker = PodWorker(self._context, pod)
                self._workers[uid] = worker
                self._log_dirs[worker.namespace, worker.name] = worker.log_dir
                worker.thread.start()
                return
        if worker is not None:
            worker.observe(None if kind == "DELETED" else pod)

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._workers.pop(uid, None)
            self._done.add(uid)
