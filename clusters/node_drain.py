"""What a drain of a Kubernetes node evicts, decided without I/O (the adapter is
``hub/kube_drains.py``).

A drain (docs/recovery.md, "Drain") stops gpufleet's own work on the node its own way:
sessions are snapshotted and stopped, jobs get the checkpoint signal with their grace and
restart elsewhere; those pods are gpufleet's to end. Everything else on the node is
evicted through the Eviction API, as ``kubectl drain`` does, so each PodDisruptionBudget
holds: an eviction it refuses (429) is asked again until the budget allows it. Left alone:

- pods a DaemonSet owns (it would put them back at once, and the node needs them: the
  node agent itself, the device plugin);
- mirror pods (the kubelet's static pods: the API server cannot remove them);
- pods that have ended, or are being deleted already;
- gpufleet's own pods (``app.kubernetes.io/managed-by``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .manifests import COMMON_LABELS

MANAGED_BY = "app.kubernetes.io/managed-by"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


@dataclass(frozen=True)
class NodePod:
    namespace: str
    name: str
    evict: bool  # whether a drain evicts it
    why_not: str = ""  # why it is left alone

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def read_node_pod(pod: Mapping[str, Any]) -> NodePod:
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    owners = metadata.get("ownerReferences") or []
    phase = (pod.get("status") or {}).get("phase", "")
    namespace, name = str(metadata.get("namespace", "")), str(metadata.get("name", ""))
    if labels.get(MANAGED_BY) == COMMON_LABELS[MANAGED_BY]:
        why = "gpufleet's own: stopped as a session or a job"
    elif any(o.get("kind") == "DaemonSet" for o in owners):
        why = "a DaemonSet's"
    elif MIRROR_ANNOTATION in (metadata.get("annotations") or {}):
        why = "a static (mirror) pod"
    elif phase in ("Succeeded", "Failed"):
        why = f"ended ({phase})"
    elif metadata.get("deletionTimestamp"):
        why = "being deleted"
    else:
        return NodePod(namespace, name, True)
    return NodePod(namespace, name, False, why)


def to_evict(pods: Iterable[Mapping[str, Any]]) -> list[NodePod]:
    """The pods of a node's listing a drain evicts, in name order."""
    read = (read_node_pod(p) for p in pods)
    return sorted((p for p in read if p.evict), key=lambda p: p.key)


def eviction(pod: NodePod, api_version: str = "policy/v1") -> dict[str, Any]:
    """The Eviction a drain posts for ``pod`` (``policy/v1beta1`` on API servers before
    1.22, which do not serve ``policy/v1``)."""
    return {
        "apiVersion": api_version,
        "kind": "Eviction",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
    }
