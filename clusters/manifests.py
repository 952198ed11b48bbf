"""The Kubernetes manifests of a gpufleet session: pure builders, plain data in, dicts out.

Nothing here does I/O or touches a Kubernetes client: the KubeGPUSpawner calls these from
``get_pod_manifest`` and friends, and the tests compare every result with a literal and
validate it against the API's schemas (``kubernetes-validate --strict``, 1.25 to the newest
version the package bundles).

Placement. The pod goes to the node the scheduler chose through a *required node affinity*
on the node's name (``matchFields`` on ``metadata.name``, as DaemonSets do), never through
``nodeName``: kube-scheduler then still checks that the GPUs, taints and selectors fit, and
a disagreement becomes a Pending pod with a reason instead of a pod the kubelet rejects.
The cluster's GPU node-selector labels are added as ``nodeSelector``.

Preemption. The pod names a priority class that :func:`priority_class` builds with
``preemptionPolicy: Never``: gpufleet's scheduler decides preemption, kube-scheduler never
evicts anything to place a session.

Labels. gpufleet's label keys all carry the prefix ``gpufleet.io/`` (:data:`LABEL_PREFIX`):
``workload`` (the workload id, which the NetworkPolicy selects), ``user``, ``project``,
``server`` (the server's name, empty for the default server), ``cluster`` and ``marker``
(the ``GPUFLEET_SESSION_MARKER`` of this start, as the local backend finds processes by it).
Label values must obey Kubernetes' rules, so they pass through :func:`label_value`, an
injective escaping; the raw values are kept under the same keys in the annotations.

The pod IP. ``GPUFLEET_POD_IP`` is set from the downward API (``status.podIP``) and is the
first variable of the container, so the caller's args can bind the server to it with
``--ip=$(GPUFLEET_POD_IP)``: Kubernetes expands ``$(VAR)`` in command and args itself.
The caller's env values are literal: every ``$`` in them is doubled, so Kubernetes'
expansion gives them back unchanged.

Containment (DESIGN.md): a researcher's code runs only in their own pod, non-root
(a uid of 0 is refused), without a service-account token (``automountServiceAccountToken:
false``), without service links, with no privilege escalation, no capabilities and the
runtime's seccomp profile, and a NetworkPolicy (:func:`session_network_policy`) that lets
it reach the hub and the controller only. Nothing in the test tiers enforces NetworkPolicy
(the cluster's network plugin does), so the unit tests evaluate the policy purely
(``tests/unit/netpol.py``) and check that it allows exactly what it should.

``restartPolicy: Never``: a server that exits ends its session. The hub's poll finds the
pod ended and stops the server: the pod is deleted and the GPUs are released once it is
gone. An in-place restart (``OnFailure``, KubeSpawner's default) would hold the GPUs through
a crash loop that neither the controller nor the culler sees, in a container whose
processes restarted without the session's snapshot being restored.

``readOnlyRootFilesystem: false``: researchers ``pip``/``conda install`` into the image's
environments and tools write to ``/tmp`` and caches; the snapshotter captures those
container filesystem changes. Containment rests on the non-root uid, no privilege
escalation and no capabilities, not on a read-only root.

``manifest_readback.dropped_fields`` compares a manifest with what an API server stored, to
find fields an older server silently drops (the 1.20 test server keeps every field built
here).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any, Literal

from ..clusters.workload_processes import MARKER_VARIABLE
from ..recovery.processes import (
    CONTAINER_VARIABLE,
    POD_NAME_VARIABLE,
    POD_NAMESPACE_VARIABLE,
    POD_VARIABLES,
)

Manifest = dict[str, Any]

LABEL_PREFIX = "gpufleet.io/"
WORKLOAD_LABEL = LABEL_PREFIX + "workload"
USER_LABEL = LABEL_PREFIX + "user"
PROJECT_LABEL = LABEL_PREFIX + "project"
SERVER_LABEL = LABEL_PREFIX + "server"
CLUSTER_LABEL = LABEL_PREFIX + "cluster"
MARKER_LABEL = LABEL_PREFIX + "marker"
# Every object built here carries these, so one selector finds what gpufleet made.
COMMON_LABELS: Mapping[str, str] = MappingProxyType(
    {"app.kubernetes.io/managed-by": "gpufleet", "app.kubernetes.io/component": "session"}
)

POD_IP_VARIABLE = "GPUFLEET_POD_IP"
WORKLOAD_VARIABLE = "GPUFLEET_WORKLOAD_ID"
RESERVED_VARIABLES = frozenset(
    {POD_IP_VARIABLE, WORKLOAD_VARIABLE, MARKER_VARIABLE, *POD_VARIABLES}
)
CONTAINER_NAME = "notebook"  # the metrics' container label (docs/architecture.md)
PORT_NAME = "notebook-port"  # KubeSpawner's name for it
NOTEBOOK_PORT = 8888
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_PRIORITY_CLASS = "gpufleet-session"
MAX_USER_PRIORITY = 1_000_000_000  # higher values are reserved for system classes

_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_LABEL_NAME = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z")
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*\Z"
)
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*\Z")
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?\Z"
)
_QUANTITY_SCALE = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6))},
    **{s: Decimal(10) ** e for s, e in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


# ------------------------------------------------------------------ names and values
def is_label_value(value: str) -> bool:
    """Kubernetes' rule: empty, or at most 63 of ``[A-Za-z0-9._-]``, alphanumeric at both ends."""
    return _LABEL_VALUE.match(value) is not None


def is_qualified_name(key: str) -> bool:
    """A label or annotation key: an optional DNS-subdomain prefix and ``/``, then a name."""
    prefix, _, name = key.rpartition("/")
    if prefix and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)):
        return False
    return _LABEL_NAME.match(name) is not None


_ESCAPE_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
_HASH_HEX = 20  # 80 bits of SHA-256: no collision among any realistic set of names


def label_value(raw: str) -> str:
    """``raw`` as a valid label value; distinct inputs give distinct outputs.

    Every character outside ``[A-Za-z0-9.-]`` (``_`` included) becomes ``_`` and the two
    lowercase hex digits of each of its UTF-8 bytes: ``alice@example.org`` gives
    ``alice_40example.org``, and the result decodes back unambiguously. When that result is
    not a label value (over 63 characters, or not alphanumeric at an end), the value is
    ``<readable part>_h<hash>``: ``_h`` never occurs in an escaped value (``_`` is always
    followed by a hex digit there), so the two forms never meet, and hashed values differ
    by their SHA-256 prefix. The raw value travels in the annotation of the same key.
    """
    escaped = "".join(
        c if c in _ESCAPE_SAFE else "".join(f"_{b:02x}" for b in c.encode("utf-8", "surrogatepass"))
        for c in raw
    )
    if is_label_value(escaped):
        return escaped
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
    readable = re.sub(r"[^A-Za-z0-9]+", "-", raw).strip("-")[: 63 - 2 - _HASH_HEX].strip("-")
    return f"{readable or 'x'}_h{digest}"


def parse_quantity(quantity: str | int | float) -> Decimal:
    """A Kubernetes resource quantity (``500m``, ``16Gi``, ``1e3``, ``2``) as a number."""
    match = _QUANTITY.match(str(quantity))
    if match is None:
        raise ValueError(
            f"{quantity!r} is not a Kubernetes quantity: write e.g. '500m' or '2' (CPU), "
            "'16Gi' (memory)"
        )
    number = Decimal(match["number"])  # the pattern admits only decimals
    suffix = match["suffix"] or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** int(suffix[1:])
    return number * _QUANTITY_SCALE.get(suffix, Decimal(1))


def check_dns_label(what: str, value: str) -> None:
    if not _DNS_LABEL.match(value):
        raise ValueError(
            f"{what} {value!r} is not a DNS label: use at most 63 lowercase letters, digits "
            "and '-', starting and ending with a letter or digit"
        )


def check_dns_subdomain(what: str, value: str) -> None:
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"{what} {value!r} is not a DNS subdomain: use lowercase letters, digits, '-' and "
            "'.', starting and ending with a letter or digit, at most 253 characters"
        )


def check_labels(what: str, labels: Mapping[str, str]) -> None:
    for key, value in labels.items():
        if not is_qualified_name(key):
            raise ValueError(f"{what}: {key!r} is not a valid label key")
        if not is_label_value(value):
            raise ValueError(
                f"{what}: the value {value!r} of {key!r} is not a valid label value "
                "(label_value() escapes any string into one)"
            )


def check_port(what: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{what} {port} is not a TCP/UDP port (1-65535)")


def frozen_mapping(obj: object, name: str) -> None:
    """Replace a dataclass's mapping field by a read-only copy, so 'frozen' means frozen."""
    object.__setattr__(obj, name, MappingProxyType(dict(getattr(obj, name))))


# ------------------------------------------------------------------ the pod's parts
VolumeKind = Literal["pvc", "hostPath", "emptyDir"]


@dataclass(frozen=True)
class Volume:
    """One volume of the session and where it is mounted (its home, its environment prefix,
    ``/dev/shm`` as a memory ``emptyDir`` for data loaders, ...).

    ``source`` is the claim's name (``pvc``) or the node's absolute path (``hostPath``; it
    must exist, owned by the session's uid: the restore creates it, and the kubelet refuses
    to start the pod rather than mount a root-owned directory it made itself).
    """

    name: str
    mount_path: str
    kind: VolumeKind
    source: str = ""
    sub_path: str = ""
    read_only: bool = False
    medium: Literal["", "Memory"] = ""  # emptyDir only
    size_limit: str = ""  # emptyDir only: a quantity such as "16Gi"

    def __post_init__(self) -> None:
        check_dns_label("volume name", self.name)
        if not self.mount_path.startswith("/"):
            raise ValueError(f"volume {self.name}: mount_path {self.mount_path!r} is not absolute")
        if self.kind == "pvc":
            check_dns_subdomain(f"volume {self.name}: claim name", self.source)
        elif self.kind == "hostPath":
            if not self.source.startswith("/"):
                raise ValueError(
                    f"volume {self.name}: a hostPath source must be an absolute path on the "
                    f"node, not {self.source!r}"
                )
        elif self.kind == "emptyDir":
            if self.source:
                raise ValueError(f"volume {self.name}: an emptyDir takes no source")
        else:
            raise ValueError(
                f"volume {self.name}: kind {self.kind!r} is none of pvc, hostPath, emptyDir"
            )
        if (self.medium or self.size_limit) and self.kind != "emptyDir":
            raise ValueError(f"volume {self.name}: medium and size_limit are for emptyDir only")
        if self.size_limit:
            parse_quantity(self.size_limit)

    def manifest(self) -> Manifest:
        source: Manifest
        if self.kind == "pvc":
            source = {"persistentVolumeClaim": {"claimName": self.source}}
        elif self.kind == "hostPath":
            source = {"hostPath": {"path": self.source, "type": "Directory"}}
        else:
            empty: Manifest = {}
            if self.medium:
                empty["medium"] = self.medium
            if self.size_limit:
                empty["sizeLimit"] = self.size_limit
            source = {"emptyDir": empty}
        return {"name": self.name, **source}

    def mount(self) -> Manifest:
        mount: Manifest = {"name": self.name, "mountPath": self.mount_path}
        if self.sub_path:
            mount["subPath"] = self.sub_path
        if self.read_only:  # omitted when false: the API server omits a false readOnly too
            mount["readOnly"] = True
        return mount


@dataclass(frozen=True)
class Toleration:
    """A taint the pod tolerates. ``seconds`` only with ``NoExecute``."""

    key: str
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str = ""
    seconds: int | None = None

    def __post_init__(self) -> None:
        if self.operator == "Exists" and self.value:
            raise ValueError(f"toleration {self.key}: operator Exists takes no value")
        if self.seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"toleration {self.key}: seconds applies to NoExecute only")

    def manifest(self) -> Manifest:
        toleration: Manifest = {"key": self.key, "operator": self.operator}
        if self.operator == "Equal":
            toleration["value"] = self.value
        toleration["effect"] = self.effect
        if self.seconds is not None:
            toleration["tolerationSeconds"] = self.seconds
        return toleration


# GPU node pools carry this taint (GKE, AKS, EKS GPU AMIs, the GPU operator's docs).
GPU_TOLERATION = Toleration(DEFAULT_GPU_RESOURCE)


@dataclass(frozen=True, kw_only=True)
class SessionPod:
    """What a session's pod is made of. Validated when made: a bad value raises ValueError
    with what to fix, before anything reaches an API server."""

    # where: the scheduler's choice
    name: str
    namespace: str
    cluster: str
    node: str
    node_selector: Mapping[str, str] = field(default_factory=dict)  # the cluster's GPU pool
    # whose and which
    workload_id: int
    user: str
    project: str
    server_name: str = ""
    marker: str  # GPUFLEET_SESSION_MARKER of this start
    # what runs
    image: str
    command: tuple[str, ...] = ()  # empty: the image's entrypoint
    args: tuple[str, ...] = ()  # e.g. ("jupyterhub-singleuser", "--ip=$(GPUFLEET_POD_IP)")
    env: Mapping[str, str] = field(default_factory=dict)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: tuple[str, ...] = ()
    port: int = NOTEBOOK_PORT
    base_url: str | None = None  # the server's base URL; given, a readiness probe on /api
    # as whom
    uid: int
    gid: int
    fs_group: int | None = None  # None: the gid
    # what it may use
    gpu_resource: str = DEFAULT_GPU_RESOURCE  # or a MIG resource, nvidia.com/mig-3g.40gb
    gpus: int = 1
    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None
    tolerations: tuple[Toleration, ...] = (GPU_TOLERATION,)
    priority_class_name: str = DEFAULT_PRIORITY_CLASS
    termination_grace_seconds: int  # long enough for the culler's final snapshot pass
    volumes: tuple[Volume, ...] = ()
    # for the caller's own selectors (KubeSpawner's component label, ...)
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    extra_annotations: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("node_selector", "env", "extra_labels", "extra_annotations"):
            frozen_mapping(self, name)
        for name in ("command", "args", "image_pull_secrets", "tolerations", "volumes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_dns_subdomain("pod name", self.name)
        check_dns_label("namespace", self.namespace)
        check_dns_subdomain("node name", self.node)
        check_dns_subdomain("priority class name", self.priority_class_name)
        if not self.cluster:
            raise ValueError("cluster is empty: give the name of the cluster the pod goes to")
        if self.workload_id < 0:
            raise ValueError(f"workload_id {self.workload_id} is negative")
        if not self.marker:
            raise ValueError(
                f"marker is empty: every start carries its own {MARKER_VARIABLE}, which the "
                "controller recorded with the request"
            )
        if not self.image:
            raise ValueError("image is empty: give the session's container image")
        check_port("port", self.port)
        if self.base_url is not None and not self.base_url.startswith("/"):
            raise ValueError(f"base_url {self.base_url!r} must start with '/' (e.g. /user/ann/)")
        if self.uid == 0:
            raise ValueError(
                "uid 0 is root, and sessions never run as root: set uid to the researcher's "
                "own non-zero uid (the account the controller records for them)"
            )
        for what, number in (("uid", self.uid), ("gid", self.gid), ("fs_group", self.fs_group)):
            if number is not None and number < 0:
                raise ValueError(f"{what} {number} is negative")
        if not is_qualified_name(self.gpu_resource) or "/" not in self.gpu_resource:
            raise ValueError(
                f"gpu_resource {self.gpu_resource!r} is not an extended resource name such as "
                f"{DEFAULT_GPU_RESOURCE} or nvidia.com/mig-3g.40gb"
            )
        if self.gpus < 1:
            raise ValueError(f"gpus is {self.gpus}: a session holds at least one GPU")
        for kind in ("cpu", "memory"):
            request, limit = getattr(self, f"{kind}_request"), getattr(self, f"{kind}_limit")
            for quantity in (request, limit):
                if quantity is not None:
                    parse_quantity(quantity)
            if (
                request is not None
                and limit is not None
                and (parse_quantity(request) > parse_quantity(limit))
            ):
                raise ValueError(f"{kind}_request {request} is over {kind}_limit {limit}")
        if self.termination_grace_seconds < 0:
            raise ValueError("termination_grace_seconds is negative")
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"env: {key!r} is not a valid variable name")
            if key in RESERVED_VARIABLES:
                raise ValueError(f"env: {key} is set by gpufleet; leave it out of env")
        check_labels("node_selector", self.node_selector)
        check_labels("extra_labels", self.extra_labels)
        for key in self.extra_annotations:
            if not is_qualified_name(key):
                raise ValueError(f"extra_annotations: {key!r} is not a valid annotation key")
        # gpufleet's keys keep gpufleet's meaning: selectors and the reconciler trust them.
        taken = [k for k in self.extra_labels if k.startswith(LABEL_PREFIX) or k in COMMON_LABELS]
        taken += [k for k in self.extra_annotations if k.startswith(LABEL_PREFIX)]
        if taken:
            raise ValueError(f"extra labels or annotations: {', '.join(taken)} are gpufleet's")
        names = [v.name for v in self.volumes]
        paths = [v.mount_path for v in self.volumes]
        if len(set(names)) != len(names) or len(set(paths)) != len(paths):
            raise ValueError("volumes: each volume needs a name and a mount path of its own")


# ------------------------------------------------------------------ builders
def session_labels(pod: SessionPod) -> dict[str, str]:
    """The pod's labels (also put on its NetworkPolicy): gpufleet's keys, escaped values."""
    return {
        **COMMON_LABELS,
        WORKLOAD_LABEL: str(pod.workload_id),
        USER_LABEL: label_value(pod.user),
        PROJECT_LABEL: label_value(pod.project),
        SERVER_LABEL: label_value(pod.server_name),
        CLUSTER_LABEL: label_value(pod.cluster),
        MARKER_LABEL: label_value(pod.marker),
        **pod.extra_labels,
    }


def session_annotations(pod: SessionPod) -> dict[str, str]:
    """The raw values behind the escaped labels, under the same keys."""
    return {
        USER_LABEL: pod.user,
        PROJECT_LABEL: pod.project,
        SERVER_LABEL: pod.server_name,
        CLUSTER_LABEL: pod.cluster,
        MARKER_LABEL: pod.marker,
        **pod.extra_annotations,
    }


def pod_identity_env(container: str) -> list[Manifest]:
    """What names the pod to the node agent's metrics (``pod``, ``namespace``,
    ``container``): read from the container's first process, as the runtime set it."""
    return [
        {
            "name": POD_NAME_VARIABLE,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
        },
        {
            "name": POD_NAMESPACE_VARIABLE,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}},
        },
        {"name": CONTAINER_VARIABLE, "value": container},
    ]


def _env(pod: SessionPod) -> list[Manifest]:
    # GPUFLEET_POD_IP comes first: $(VAR) expands only variables defined before it.
    env: list[Manifest] = [
        {
            "name": POD_IP_VARIABLE,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
        },
        {"name": WORKLOAD_VARIABLE, "value": str(pod.workload_id)},
        {"name": MARKER_VARIABLE, "value": pod.marker},
        *pod_identity_env(CONTAINER_NAME),
    ]
    # Doubling '$' keeps a value literal through Kubernetes' $(VAR) expansion.
    env += [{"name": k, "value": v.replace("$", "$$")} for k, v in pod.env.items()]
    return env


def _resources(pod: SessionPod) -> Manifest:
    # Requests equal limits for an extended resource; both are written so the manifest
    # reads as what it means and the server's read-back adds nothing to them.
    gpus = str(pod.gpus)
    limits: dict[str, str] = {pod.gpu_resource: gpus}
    requests: dict[str, str] = {pod.gpu_resource: gpus}
    for kind in ("cpu", "memory"):
        if (limit := getattr(pod, f"{kind}_limit")) is not None:
            limits[kind] = limit
        if (request := getattr(pod, f"{kind}_request")) is not None:
            requests[kind] = request
    return {"limits": dict(sorted(limits.items())), "requests": dict(sorted(requests.items()))}


def _container(pod: SessionPod) -> Manifest:
    """The session's one container: no privilege to gain, no capability."""
    container: Manifest = {"name": CONTAINER_NAME, "image": pod.image}
    if pod.image_pull_policy:
        container["imagePullPolicy"] = pod.image_pull_policy
    if pod.command:
        container["command"] = list(pod.command)
    if pod.args:
        container["args"] = list(pod.args)
    container |= {
        "env": _env(pod),
        "ports": [{"name": PORT_NAME, "containerPort": pod.port, "protocol": "TCP"}],
        "resources": _resources(pod),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": False,
        },
    }
    if pod.volumes:
        container["volumeMounts"] = [v.mount() for v in pod.volumes]
    if pod.base_url is not None:
        container["readinessProbe"] = {
            # /api answers without a token and is not counted as activity by the server,
            # so the probe never keeps an idle session from the culler.
            "httpGet": {"path": pod.base_url.rstrip("/") + "/api", "port": pod.port},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        }
    return container


def _pod_spec(pod: SessionPod) -> Manifest:
    """The pod's spec: on the node gpufleet chose, never restarted, as the user's ids."""
    spec: Manifest = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [pod.node]}
                            ]
                        }
                    ]
                }
            }
        },
    }
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [t.manifest() for t in pod.tolerations]
    spec |= {
        "priorityClassName": pod.priority_class_name,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": pod.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": pod.uid,
            "runAsGroup": pod.gid,
            "fsGroup": pod.gid if pod.fs_group is None else pod.fs_group,
            # Chown a volume only when its root is not the group's yet: a home with a conda
            # environment holds 10^5 files, and a recursive chown at every start takes minutes.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if pod.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in pod.image_pull_secrets]
    spec["containers"] = [_container(pod)]
    if pod.volumes:
        spec["volumes"] = [v.manifest() for v in pod.volumes]
    return spec


def session_pod(pod: SessionPod) -> Manifest:
    """The v1 Pod of a session (see the module's docstring for each choice)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "labels": session_labels(pod),
            "annotations": session_annotations(pod),
        },
        "spec": _pod_spec(pod),
    }


def priority_class(name: str, value: int, description: str) -> Manifest:
    """The PriorityClass of gpufleet's pods: never preempts (gpufleet's scheduler does),
    never the cluster's default."""
    check_dns_subdomain("priority class name", name)
    if not -(2**31) <= value <= MAX_USER_PRIORITY:
        raise ValueError(
            f"priority value {value} is out of range: classes other than the system's take "
            f"at most {MAX_USER_PRIORITY}"
        )
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name, "labels": dict(COMMON_LABELS)},
        "value": value,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": description,
    }


# ------------------------------------------------------------------ network policy
def _inside(inner: ipaddress.IPv4Network | ipaddress.IPv6Network, outer: Any) -> bool:
    return inner.subnet_of(outer)


@dataclass(frozen=True)
class Peer:
    """The other side of a NetworkPolicy rule: pods by their labels (in the policy's own
    namespace, or in the namespaces ``namespace_labels`` selects), or an IP block.

    ``Peer(pod_labels={"component": "proxy"}, namespace_labels={"kubernetes.io/metadata.name":
    "hub"})``, ``Peer(cidr="10.0.0.5/32")``. ``pod_labels=None`` with namespace labels: every
    pod of those namespaces.
    """

    pod_labels: Mapping[str, str] | None = None
    namespace_labels: Mapping[str, str] | None = None
    cidr: str = ""
    except_cidrs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        by_pods = self.pod_labels is not None or self.namespace_labels is not None
        if by_pods == bool(self.cidr):
            raise ValueError("a Peer is either pods (pod_labels/namespace_labels) or a cidr")
        for name in ("pod_labels", "namespace_labels"):
            if getattr(self, name) is not None:
                frozen_mapping(self, name)
                check_labels(f"Peer.{name}", getattr(self, name))
        object.__setattr__(self, "except_cidrs", tuple(self.except_cidrs))
        if self.cidr:
            block = ipaddress.ip_network(self.cidr)  # raises ValueError naming the bad value
            for inner in self.except_cidrs:
                network = ipaddress.ip_network(inner)
                if network.version != block.version or not _inside(network, block):
                    raise ValueError(f"except {inner} is not inside {self.cidr}")
        elif self.except_cidrs:
            raise ValueError("except_cidrs go with a cidr")

    def manifest(self) -> Manifest:
        if self.cidr:
            block: Manifest = {"cidr": self.cidr}
            if self.except_cidrs:
                block["except"] = list(self.except_cidrs)
            return {"ipBlock": block}
        peer: Manifest = {}
        if self.namespace_labels is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(self.namespace_labels)}
        if self.pod_labels is not None:
            peer["podSelector"] = {"matchLabels": dict(self.pod_labels)}
        return peer


@dataclass(frozen=True)
class Endpoint:
    """A service the session may reach: who serves it and on which ports."""

    peer: Peer
    ports: tuple[int, ...]
    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ports", tuple(self.ports))
        if not self.ports:
            raise ValueError("an Endpoint needs at least one port")
        for port in self.ports:
            check_port("Endpoint port", port)

    def rule(self) -> Manifest:
        return {
            "to": [self.peer.manifest()],
            "ports": [{"protocol": self.protocol, "port": p} for p in self.ports],
        }


# The cluster DNS as kubeadm, GKE, EKS and AKS label it. The namespace label exists from
# Kubernetes 1.21 on; with NodeLocal DNSCache give its peer (an ipBlock) instead.
KUBE_DNS = Peer(
    pod_labels={"k8s-app": "kube-dns"},
    namespace_labels={"kubernetes.io/metadata.name": "kube-system"},
)
DNS_PORT = 53


def dns_egress(dns: Peer | None) -> list[Manifest]:
    """The egress rule to the cluster's DNS (UDP and TCP 53); none for None."""
    if dns is None:
        return []
    ports = [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]
    return [{"to": [dns.manifest()], "ports": ports}]


def session_network_policy(
    pod: SessionPod,
    *,
    proxy: Peer,
    hub: Endpoint,
    controller: Endpoint,
    dns: Peer | None = KUBE_DNS,
    extra_egress: Sequence[Endpoint] = (),
) -> Manifest:
    """The NetworkPolicy of one session pod (selected by its workload label).

    Ingress: the notebook port, from the proxy and from the hub (JupyterHub's hub checks
    the server's URL itself before it reports a spawn done). Egress: the hub's API, the
    controller, DNS (unless ``dns`` is None) and ``extra_egress`` (an internal package
    mirror, say), nothing else. The kubelet's probes come from the node, which network
    plugins let through whatever the policy.
    """
    notebook_port = [{"protocol": "TCP", "port": pod.port}]
    dns_rules = dns_egress(dns)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "labels": session_labels(pod),
        },
        "spec": {
            "podSelector": {"matchLabels": {WORKLOAD_LABEL: str(pod.workload_id)}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [proxy.manifest(), hub.peer.manifest()], "ports": notebook_port}],
            "egress": [
                hub.rule(),
                controller.rule(),
                *dns_rules,
                *(e.rule() for e in extra_egress),
            ],
        },
    }
