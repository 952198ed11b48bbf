"""Fake GPU nodes: the Node objects and Leases a kubelet keeps (the pods are the test
kubelet's, ``kubelet.py``).

A ``FakeNode`` registers itself through the API server with its own kubelet identity
(``system:node:<name>``, so the Node authorizer and NodeRestriction treat it as a real
kubelet: it may change only its own Node and Lease), posts a kubelet-like status with
``nvidia.com/gpu`` capacity, and renews its Lease in ``kube-node-lease`` from a thread. The
labels are those a GPU node carries: GPU Feature Discovery's ``nvidia.com/gpu.product``
(NVML's model name with spaces as dashes, "NVIDIA-A100-SXM4-80GB") and its count and memory
labels, ``topology.kubernetes.io/zone`` and ``kubernetes.io/hostname``.

The renewer is a thread, not an asyncio task: the tier lives for the whole test session,
and synchronous tests running meanwhile must not starve it into a NotReady node. It renews
every ``RENEW_INTERVAL_S`` and, like a kubelet's status sync, posts Ready again when it finds
its node not Ready (after a pause, or a moment of starvation). Stopping it is how a test
makes a node NotReady (``Kubelet.pause()`` stops it together with the node's pod handling):
the real node-lifecycle controller then marks it Unknown and taints it within its grace
period. The GPU UUIDs are the ones gpufleet's node agent makes up for a declared node
(``declared_gpu_uuid``), so the test kubelet hands exactly those to pods, as NVIDIA's device
plugin would.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpufleet.agent.gpus import declared_gpu_uuid

from .pki import Identity, trust
from .processes import ManagedProcess, wait_until

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})
LEASE_NAMESPACE = "kube-node-lease"
RENEW_INTERVAL_S = 1.0
STATUS_CHECK_EVERY = 3  # renewals between checks that the node is still Ready
LEASE_DURATION_S = 40  # what a kubelet writes; the controller goes by its own grace period
KUBELET_VERSION = "v1.20.2"


def gfd_product(model: str) -> str:
    """GPU Feature Discovery's product label for an NVML model name."""
    return model.replace(" ", "-")


def micro_time(now: datetime.datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    now = now or datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NodeSpec:
    """What a fake GPU node is: its name, zone, GPUs and machine size."""

    name: str
    zone: str
    gpus: int = 4
    gpu_model: str = "NVIDIA A100-SXM4-80GB"  # NVML's name (the fake NVML library's default)
    gpu_memory_mib: int = 81920
    cpu: str = "32"
    memory: str = "256Gi"
    pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(declared_gpu_uuid(self.name, i) for i in range(self.gpus))

    def node_labels(self) -> dict[str, str]:
        return {
            HOSTNAME_LABEL: self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            ZONE_LABEL: self.zone,
            PRODUCT_LABEL: gfd_product(self.gpu_model),
            "nvidia.com/gpu.count": str(self.gpus),
            "nvidia.com/gpu.memory": str(self.gpu_memory_mib),
            "nvidia.com/gpu.present": "true",
            **self.labels,
        }

    def manifest(self) -> dict[str, Any]:
        """The Node a kubelet registers (the API server adds the not-ready taint)."""
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.node_labels()},
        }

    def status(self, now: datetime.datetime | None = None) -> dict[str, Any]:
        """A kubelet's status: resources with the device plugin's GPUs, Ready, no pressure."""
        stamp = rfc3339(now)
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": "500Gi",
            GPU_RESOURCE: str(self.gpus),
        }

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }

        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                condition("Ready", "True", "KubeletReady", "fake kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "nodeInfo": {
                "machineID": self.name,
                "systemUUID": self.name,
                "bootID": self.name,
                "kernelVersion": "test",
                "osImage": "gpufleet test node",
                "containerRuntimeVersion": "gpufleet-test://0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": KUBELET_VERSION,
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }


def ready_condition(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond  # type: ignore[no-any-return]
    return None


def is_ready(node: Mapping[str, Any]) -> bool:
    """Ready=True and neither the not-ready nor the unreachable taint."""
    cond = ready_condition(node)
    taints = {t.get("key") for t in node.get("spec", {}).get("taints") or []}
    return cond is not None and cond.get("status") == "True" and not taints & NOT_READY_TAINTS


class FakeNode:
    """A registered fake GPU node of one cluster, and the thread that keeps its lease.

    The node's test kubelet (``kubelet.py``) acts with its identity and GPU UUIDs, and
    stops and starts its renewer when it is paused and resumed."""

    def __init__(
        self, spec: NodeSpec, cluster: str, server: str, ca_path: Path, identity: Identity
    ) -> None:
        self.spec = spec
        self.cluster = cluster
        self.server = server
        self.ca_path = ca_path
        self.identity = identity
        self.last_error: str | None = None  # the renewer's last failure, for diagnosis
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def zone(self) -> str:
        return self.spec.zone

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return self.spec.gpu_uuids

    def __repr__(self) -> str:
        return f"FakeNode({self.name!r}, cluster={self.cluster!r}, zone={self.zone!r})"

    def client(self) -> httpx.Client:
        """An API client as this node's kubelet."""
        return httpx.Client(
            base_url=self.server,
            verify=trust(self.ca_path),
            headers={"Authorization": f"Bearer {self.identity.token}"},
            timeout=5.0,
        )

    def register(self) -> None:
        """Creates the Node (an existing one is kept) and posts its status."""
        with self.client() as api:
            r = api.post("/api/v1/nodes", json=self.spec.manifest())
            if r.status_code not in (201, 409):
                raise RuntimeError(f"registering node {self.name} in {self.cluster}: {r.text}")
            self.post_status(api)

    def post_status(self, api: httpx.Client) -> None:
        r = api.patch(
            f"/api/v1/nodes/{self.name}/status",
            json={"status": self.spec.status()},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        r.raise_for_status()

    # ------------------------------------------------------------------ the lease
    @property
    def renewing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_renewer(self) -> None:
        if self.renewing:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew_until_stopped, name=f"lease-{self.cluster}-{self.name}", daemon=True
        )
        self._thread.start()

    def stop_renewer(self) -> None:
        """Stops renewing; returns once no renewal can happen any more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self._thread = None

    def _renew_until_stopped(self) -> None:
        stop = self._stop
        with self.client() as api:
            tick = 0
            while not stop.is_set():
                try:
                    self._renew(api)
                    # On (re)start, then every few renewals: a node found not Ready is
                    # Ready again, as a kubelet's status sync makes it.
                    if tick % STATUS_CHECK_EVERY == 0:
                        node = api.get(f"/api/v1/nodes/{self.name}")
                        node.raise_for_status()
                        cond = ready_condition(node.json())
                        if cond is None or cond.get("status") != "True":
                            self.post_status(api)
                    self.last_error = None
                except httpx.HTTPError as e:
                    # The API server may be stopped by a test; keep trying, like a kubelet.
                    self.last_error = f"{type(e).__name__}: {e}"
                tick += 1
                stop.wait(RENEW_INTERVAL_S)

    def _renew(self, api: httpx.Client) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
        r = api.patch(
            f"{path}/{self.name}",
            json={"spec": {"renewTime": micro_time(), "holderIdentity": self.name}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if r.status_code != 404:
            r.raise_for_status()
            return
        node = api.get(f"/api/v1/nodes/{self.name}")
        node.raise_for_status()
        lease = {
            "metadata": {
                "name": self.name,
                # Owned by its Node, as a kubelet makes it: deleting the Node deletes it.
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.name,
                        "uid": node.json()["metadata"]["uid"],
                    }
                ],
            },
            "spec": {
                "holderIdentity": self.name,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": micro_time(),
            },
        }
        created = api.post(path, json=lease)
        if created.status_code != 409:
            created.raise_for_status()

    def wait_ready(
        self,
        api: httpx.Client,
        deadline_s: float,
        watched: Sequence[ManagedProcess] = (),
    ) -> None:
        """Waits until the node is Ready with the not-ready taint gone (the node-lifecycle
        controller removes it once it sees the Ready status)."""

        def ready() -> bool:
            try:
                r = api.get(f"/api/v1/nodes/{self.name}")
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and is_ready(r.json())

        wait_until(ready, f"node {self.name} Ready in {self.cluster}", deadline_s, watched)
