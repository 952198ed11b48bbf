"""The Kubernetes objects of one attempt of a training job: pure builders, plain data in,
dicts out.

An attempt of a job placed on a cluster is a **gang** (:class:`JobGang`): one pod per pod
of the job, each on the node the scheduler chose. A job of one pod is that pod alone (a
cluster creating hundreds of them at once makes one object each); a gang of several adds
what its pods share, named ``gf-job-<id>-a<attempt>`` (:func:`gang_name`) and deleted
with them (:func:`gang_objects`):

- a headless Service whose ``subdomain`` the pods name, so pod *i* is
  ``p<i>.<gang>.<namespace>.svc.cluster.local`` wherever it runs. It publishes pods that
  are not Ready yet: the master's name must resolve while its torchrun starts, and the
  launcher waits for its port, not for the pod to be Ready;
- a NetworkPolicy letting the gang's pods reach each other on any port.

Every job pod reads two files at :data:`LAUNCH_DIR`: the launcher
(``clusters/pod_launcher.py``), from one ConfigMap per cluster named after its content
(:func:`launcher_config_map`), and the job's script, from the pod's own annotation
(:data:`SCRIPT_ANNOTATION`, through the downward API) or, for a script too large for an
annotation, from a ConfigMap of the attempt's. One NetworkPolicy per namespace
(:func:`jobs_network_policy`) isolates every job pod: nothing reaches in, and out only the
hub, the controller, DNS and the egress the admin lists (the S3 endpoint of checkpoints);
so no other user's pod joins a rendezvous. Policies add up: a gang's own lets its pods
reach each other besides.

Each attempt has objects of its own, never reusing an earlier attempt's names: a pod of the
attempt before may still be terminating on a node that stopped answering, and a name it
still holds must not keep the next attempt from starting, nor answer its rendezvous.

The pods are the session pods' kin (``clusters/manifests.py`` has the reasons): a required
node affinity on the chosen node, the cluster's GPU node selector and taint toleration, the
GPU limit, a priority class with ``preemptionPolicy: Never``, the researcher's own non-root
uid, no service-account token, no service links, no privilege escalation, no capability,
the runtime's seccomp profile, and ``restartPolicy: Never``: a pod that ends ends its
attempt, and gpufleet decides what comes next. The grace period is the job's
(``grace_s``): SIGTERM is the checkpoint signal.

Labels: the sessions' (workload, user, project, cluster, marker: the pod's own part
marker, which the reconciler maps back to the job's) and ``gpufleet.io/attempt`` and
``gpufleet.io/pod-index``; ``app.kubernetes.io/component: job``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType

from ..api.jobs import RANK_LINE_PREFIX_TEMPLATE
from ..recovery.processes import POD_VARIABLES, part_marker
from .manifests import (
    CLUSTER_LABEL,
    DEFAULT_GPU_RESOURCE,
    GPU_TOLERATION,
    KUBE_DNS,
    LABEL_PREFIX,
    MARKER_LABEL,
    MARKER_VARIABLE,
    POD_IP_VARIABLE,
    PROJECT_LABEL,
    USER_LABEL,
    WORKLOAD_LABEL,
    WORKLOAD_VARIABLE,
    Endpoint,
    Manifest,
    Peer,
    Toleration,
    Volume,
    check_dns_label,
    check_dns_subdomain,
    check_labels,
    check_port,
    dns_egress,
    frozen_mapping,
    label_value,
    parse_quantity,
    pod_identity_env,
)

ATTEMPT_LABEL = LABEL_PREFIX + "attempt"
POD_INDEX_LABEL = LABEL_PREFIX + "pod-index"
JOB_LABELS: Mapping[str, str] = MappingProxyType(
    {"app.kubernetes.io/managed-by": "gpufleet", "app.kubernetes.io/component": "job"}
)
CONTAINER_NAME = "torchrun"
LAUNCH_DIR = "/var/run/gpufleet/job"  # the script and the launcher
LAUNCHER_KEY = "gpufleet-launch.py"
SCRIPT_ANNOTATION = LABEL_PREFIX + "script"
# A gang pod's attempt, marker, master and checkpoint (JSON), which the launcher reads from
# the file ``assignment`` (the downward API) and the cluster manager changes for a pod it
# keeps into the next attempt (:func:`keep_patch`).
ASSIGNMENT_ANNOTATION = LABEL_PREFIX + "assignment"
ASSIGNMENT_FILE = "assignment"
# A script up to this size travels in its pods' annotation; a larger one in a ConfigMap of
# the attempt's. Well under the API server's 256 KiB of annotations per object, because
# every pass of the cluster manager lists every job pod of its cluster, annotations and all.
INLINE_SCRIPT_BYTES = 16 * 1024
JOBS_NETWORK_POLICY_PREFIX = "gf-jobs-"
# What every job pod of a namespace shares (the launcher, the jobs' NetworkPolicy): not a
# gang's, so never taken for an attempt's leftover.
SHARED_LABELS: Mapping[str, str] = MappingProxyType(
    {"app.kubernetes.io/managed-by": "gpufleet", "app.kubernetes.io/component": "job-shared"}
)
RENDEZVOUS_PORT_NAME = "rendezvous"
HOST_IP_VARIABLE = "GPUFLEET_HOST_IP"
DEFAULT_JOB_PRIORITY_CLASS = "gpufleet-job"
# Variables the platform sets in every pod, which the job's own ``env`` cannot override.
PLATFORM_VARIABLES = frozenset(
    {
        POD_IP_VARIABLE,
        WORKLOAD_VARIABLE,
        MARKER_VARIABLE,
        *POD_VARIABLES,
        "GPUFLEET_JOB_ID",
        "GPUFLEET_JOB_NAME",
        "GPUFLEET_POD_INDEX",
        "GPUFLEET_PODS",
        "GPUFLEET_GPUS_PER_POD",
        "GPUFLEET_MASTER_ADDR",
        "GPUFLEET_MASTER_PORT",
        "GPUFLEET_RENDEZVOUS_TIMEOUT",
        "GPUFLEET_SCRIPT",
        "GPUFLEET_CHECKPOINT_URI",
        "GPUFLEET_ATTEMPT",
        "GPUFLEET_RESUME_FROM",
        "GPUFLEET_PROGRESS_URL",
        "PYTHONUNBUFFERED",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        "GPUFLEET_HOST_IP",
        "GPUFLEET_KEEP_WAIT_S",
    }
)


@functools.cache
def launcher_text() -> str:
    """The launcher every job pod runs first (:func:`launcher_config_map` holds it). Read
    once: every pod's manifest names it by its digest."""
    return (Path(__file__).parent / "pod_launcher.py").read_text(encoding="utf-8")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def launcher_config_map_name() -> str:
    """Named after its content: a new gpufleet's pods get its launcher, while the pods of
    the one before keep theirs."""
    return f"gf-job-launcher-{_digest(launcher_text())}"


def gang_name(workload_id: int, attempt: int) -> str:
    """The name of an attempt's Service, NetworkPolicy and script ConfigMap, where it has
    them; its pods' names add ``-<index>``."""
    return f"gf-job-{workload_id}-a{attempt}"


@dataclass(frozen=True)
class S3Checkpoints:
    """How job pods reach checkpoints in S3 with their user's own keys, which an admin
    scoped to the user's prefix (docs/jobs.md, "Checkpoints in S3"): the keys are in the
    Secret ``secret`` of the job's namespace, under ``<user_key>.access_key`` and
    ``<user_key>.secret_key`` (the user's KubeSpawner slug, as in home volume paths)."""

    secret: str
    endpoint: str = ""  # empty: AWS's
    region: str = "us-east-1"
    user_key: str = ""  # the gang's user's, set per gang

    def env(self) -> list[Manifest]:
        """The variables boto3 reads, the keys from the Secret (never in the manifest)."""
        if not self.user_key:
            raise ValueError("no user key to read the job's S3 credentials under")

        def key(variable: str, part: str) -> Manifest:
            reference = {"name": self.secret, "key": f"{self.user_key}.{part}"}
            return {"name": variable, "valueFrom": {"secretKeyRef": reference}}

        env = [
            key("AWS_ACCESS_KEY_ID", "access_key"),
            key("AWS_SECRET_ACCESS_KEY", "secret_key"),
            {"name": "AWS_DEFAULT_REGION", "value": self.region},
        ]
        if self.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": self.endpoint})
        return env


@dataclass(frozen=True, kw_only=True)
class JobGang:
    """What one attempt of a job is made of on its cluster. Validated when made: a bad
    value raises ValueError with what to fix, before anything reaches an API server."""

    # whose and which
    workload_id: int
    attempt: int
    job_name: str
    user: str
    project: str
    marker: str  # the job's process marker; pod i carries its part ``<marker>.<i>``
    # where: one node per pod, the scheduler's choice
    cluster: str
    namespace: str
    nodes: tuple[str, ...]
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # what runs
    image: str
    python: str
    script_name: str
    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    checkpoint_uri: str = ""
    # For checkpoints in S3: the Secret (in the job's namespace) holding each user's own
    # keys, and where S3 is; its user's keys alone reach the pods' environment.
    s3: S3Checkpoints | None = None
    resume_from: str = ""
    rendezvous_port: int = 29500
    rendezvous_timeout_s: int = 600
    # Where ranks report progress: the node agent's port on the pod's node, which
    # $(GPUFLEET_HOST_IP) names (the downward API's status.hostIP); "" for nowhere.
    progress_url: str = ""
    # The master's address when it is not pod 0's name under this attempt's Service: the
    # address of a pod 0 kept from an attempt before (its name is that attempt's).
    master_addr: str = ""
    # Pods kept from attempts before (by index): patched into this one, never created.
    kept: frozenset[int] = frozenset()
    # How long a gang pod whose torchrun failed waits to be kept for the next attempt.
    keep_wait_s: float = 30.0
    # as whom
    uid: int
    gid: int
    # what it may use
    gpus_per_pod: int
    gpu_resource: str = DEFAULT_GPU_RESOURCE
    memory_limit: str | None = None  # per pod; out of memory is then the kernel's verdict
    cpu_limit: str | None = None
    tolerations: tuple[Toleration, ...] = (GPU_TOLERATION,)
    priority_class_name: str = DEFAULT_JOB_PRIORITY_CLASS
    grace_seconds: int = 30
    volumes: tuple[Volume, ...] = ()

    def __post_init__(self) -> None:
        for name in ("node_selector", "env"):
            frozen_mapping(self, name)
        for name in ("nodes", "args", "tolerations", "volumes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.workload_id < 0 or self.attempt < 1:
            raise ValueError(f"workload {self.workload_id}, attempt {self.attempt}: out of range")
        check_dns_label("namespace", self.namespace)
        check_dns_subdomain("priority class name", self.priority_class_name)
        if not self.nodes:
            raise ValueError("nodes is empty: a gang has at least one pod")
        for node in self.nodes:
            check_dns_subdomain("node name", node)
        for what in ("cluster", "marker", "image", "user"):
            if not getattr(self, what):
                raise ValueError(f"{what} is empty")
        if not PurePosixPath(self.python).is_absolute():
            raise ValueError(f"python {self.python!r} is not an absolute path in the image")
        if not self.script_name or "/" in self.script_name or self.script_name.startswith("."):
            raise ValueError(f"script name {self.script_name!r} is not a plain file name")
        if self.script_name == LAUNCHER_KEY:
            raise ValueError(f"script name {LAUNCHER_KEY} is gpufleet's launcher's")
        check_port("rendezvous_port", self.rendezvous_port)
        if self.uid == 0:
            raise ValueError(
                "uid 0 is root, and a job's ranks never run as root: give the researcher's "
                "own non-zero uid"
            )
        if self.gpus_per_pod < 1:
            raise ValueError(f"gpus_per_pod is {self.gpus_per_pod}: each pod holds a GPU")
        for quantity in (self.memory_limit, self.cpu_limit):
            if quantity is not None:
                parse_quantity(quantity)
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds is negative")
        if not self.kept <= set(range(len(self.nodes))):
            raise ValueError(f"kept pods {sorted(self.kept)} are not all pods of the gang")
        if self.checkpoint_uri.startswith("s3://") and self.s3 is None:
            raise ValueError(
                f"the job's checkpoints are in S3 ({self.checkpoint_uri}) and its pods have no "
                "credentials for it: name the Secret of the users' S3 keys in "
                "c.KubeJobs.checkpoint_credentials_secret"
            )
        taken = sorted(set(self.env) & PLATFORM_VARIABLES)
        if taken:
            raise ValueError(f"env: {', '.join(taken)} are set by gpufleet; leave them out")
        check_labels("node_selector", self.node_selector)

    @property
    def name(self) -> str:
        return gang_name(self.workload_id, self.attempt)

    @property
    def pods(self) -> int:
        return len(self.nodes)

    def pod_name(self, index: int) -> str:
        return f"{self.name}-{index}"

    @property
    def script_inline(self) -> bool:
        """Whether the script travels in the pods' annotation (else in a ConfigMap)."""
        return len(self.script.encode()) <= INLINE_SCRIPT_BYTES

    def master_address(self) -> str:
        """Pod 0's stable name, as the cluster's DNS answers it ('localhost' for a job of
        one pod, whose torchrun needs no Service: it rendezvouses with itself)."""
        if self.pods == 1:
            return "localhost"
        if self.master_addr:
            return self.master_addr
        return f"p0.{self.name}.{self.namespace}.svc.cluster.local"

    def assignment(self, index: int) -> str:
        """Pod ``index``'s :data:`ASSIGNMENT_ANNOTATION` (read by ``pod_launcher.py``)."""
        return json.dumps(
            {
                "attempt": self.attempt,
                "marker": part_marker(self.marker, index),
                "master_addr": self.master_address(),
                "master_port": self.rendezvous_port,
                "resume_from": self.resume_from,
            },
            sort_keys=True,
        )


# ------------------------------------------------------------------ labels
def gang_labels(gang: JobGang) -> dict[str, str]:
    """The labels of every object of the attempt; the Service and the policy select the
    first two gpufleet keys."""
    return {
        **JOB_LABELS,
        WORKLOAD_LABEL: str(gang.workload_id),
        ATTEMPT_LABEL: str(gang.attempt),
        USER_LABEL: label_value(gang.user),
        PROJECT_LABEL: label_value(gang.project),
        CLUSTER_LABEL: label_value(gang.cluster),
    }


def _selector(gang: JobGang) -> dict[str, str]:
    return {WORKLOAD_LABEL: str(gang.workload_id), ATTEMPT_LABEL: str(gang.attempt)}


def _metadata(gang: JobGang, name: str, **extra: str) -> Manifest:
    return {
        "name": name,
        "namespace": gang.namespace,
        "labels": {**gang_labels(gang), **extra},
        "annotations": {USER_LABEL: gang.user, PROJECT_LABEL: gang.project},
    }


# ------------------------------------------------------------------ the shared objects
def launcher_config_map(namespace: str) -> Manifest:
    """The launcher, one ConfigMap per namespace (:func:`launcher_config_map_name`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": launcher_config_map_name(),
            "namespace": namespace,
            "labels": dict(SHARED_LABELS),
        },
        "data": {LAUNCHER_KEY: launcher_text()},
    }


def jobs_network_policy(
    namespace: str,
    *,
    hub: Endpoint,
    controller: Endpoint,
    dns: Peer | None = KUBE_DNS,
    extra_egress: Sequence[Endpoint] = (),
) -> Manifest:
    """Every job pod of the namespace: nothing reaches in; out, only the hub, the
    controller, DNS and ``extra_egress``. A gang's own policy adds its pods to each
    other. Named after what it allows (``gf-jobs-<digest>``): where the admin changes the
    egress, the cluster manager makes the new one, then deletes the old, so no moment
    leaves a job pod without one."""
    spec = {
        "podSelector": {"matchLabels": dict(JOB_LABELS)},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [],
        "egress": [
            hub.rule(),
            controller.rule(),
            *dns_egress(dns),
            *(e.rule() for e in extra_egress),
        ],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": JOBS_NETWORK_POLICY_PREFIX + _digest(json.dumps(spec, sort_keys=True)),
            "namespace": namespace,
            "labels": dict(SHARED_LABELS),
        },
        "spec": spec,
    }


def gang_config_map(gang: JobGang) -> Manifest:
    """A script too large for an annotation, as the file of the pods' :data:`LAUNCH_DIR`."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(gang, gang.name),
        "data": {gang.script_name: gang.script},
    }


def gang_service(gang: JobGang) -> Manifest:
    """The headless Service that gives each pod its stable name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(gang, gang.name),
        "spec": {
            "clusterIP": "None",
            "selector": _selector(gang),
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": RENDEZVOUS_PORT_NAME,
                    "port": gang.rendezvous_port,
                    "targetPort": gang.rendezvous_port,
                    "protocol": "TCP",
                }
            ],
        },
    }


def gang_network_policy(gang: JobGang) -> Manifest:
    """The attempt's NetworkPolicy: its pods reach each other on every port (torchrun's
    store, the collectives' own ports). What else they reach is the namespace's
    (:func:`jobs_network_policy`)."""
    own = Peer(pod_labels=_selector(gang))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(gang, gang.name),
        "spec": {
            "podSelector": {"matchLabels": _selector(gang)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [own.manifest()]}],
            "egress": [{"to": [own.manifest()]}],
        },
    }


def gang_objects(gang: JobGang) -> list[Manifest]:
    """What the attempt's pods share, created before them: nothing for a job of one pod
    whose script fits its annotation."""
    objects = [] if gang.script_inline else [gang_config_map(gang)]
    if gang.pods > 1:
        objects += [gang_service(gang), gang_network_policy(gang)]
    return objects


# ------------------------------------------------------------------ the pods
def _env(gang: JobGang, index: int) -> list[Manifest]:
    platform = {
        WORKLOAD_VARIABLE: str(gang.workload_id),
        MARKER_VARIABLE: part_marker(gang.marker, index),
        "GPUFLEET_JOB_ID": str(gang.workload_id),
        "GPUFLEET_JOB_NAME": gang.job_name,
        "GPUFLEET_POD_INDEX": str(index),
        "GPUFLEET_PODS": str(gang.pods),
        "GPUFLEET_GPUS_PER_POD": str(gang.gpus_per_pod),
        "GPUFLEET_MASTER_ADDR": gang.master_address(),
        "GPUFLEET_MASTER_PORT": str(gang.rendezvous_port),
        "GPUFLEET_RENDEZVOUS_TIMEOUT": str(gang.rendezvous_timeout_s),
        "GPUFLEET_SCRIPT": f"{LAUNCH_DIR}/{gang.script_name}",
        "GPUFLEET_CHECKPOINT_URI": gang.checkpoint_uri,
        "GPUFLEET_ATTEMPT": str(gang.attempt),
        "GPUFLEET_RESUME_FROM": gang.resume_from,
        "PYTHONUNBUFFERED": "1",
        # Every line a rank writes carries its rank: the node agent splits the pod's
        # output into the ranks' streams by it (agent/kube_pods.py).
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_LINE_PREFIX_TEMPLATE,
    }
    env: list[Manifest] = [
        {
            "name": POD_IP_VARIABLE,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
        },
        {
            "name": HOST_IP_VARIABLE,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}},
        },
        *pod_identity_env(CONTAINER_NAME),
    ]
    # Doubling '$' keeps a value literal through Kubernetes' $(VAR) expansion.
    env += [{"name": k, "value": v.replace("$", "$$")} for k, v in platform.items()]
    if gang.pods > 1:
        env.append({"name": "GPUFLEET_KEEP_WAIT_S", "value": f"{gang.keep_wait_s:g}"})
    if gang.progress_url:  # the admin's, expanded: it names $(GPUFLEET_HOST_IP)
        env.append({"name": "GPUFLEET_PROGRESS_URL", "value": gang.progress_url})
    if gang.s3 is not None and gang.checkpoint_uri.startswith("s3://"):
        env += gang.s3.env()
    env += [{"name": k, "value": v.replace("$", "$$")} for k, v in gang.env.items()]
    return env


def _resources(gang: JobGang) -> Manifest:
    limits = {gang.gpu_resource: str(gang.gpus_per_pod)}
    if gang.memory_limit is not None:
        limits["memory"] = gang.memory_limit
    if gang.cpu_limit is not None:
        limits["cpu"] = gang.cpu_limit
    # Requests equal limits: the pod is Guaranteed where both are set, and the server's
    # read-back adds nothing.
    return {"limits": dict(sorted(limits.items())), "requests": dict(sorted(limits.items()))}


def _container(gang: JobGang, index: int) -> Manifest:
    container: Manifest = {
        "name": CONTAINER_NAME,
        "image": gang.image,
        "command": [gang.python, f"{LAUNCH_DIR}/{LAUNCHER_KEY}"],
    }
    if gang.args:
        container["args"] = [a.replace("$", "$$") for a in gang.args]
    container |= {
        "env": _env(gang, index),
        "resources": _resources(gang),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": False,
        },
        "volumeMounts": [
            {"name": "gpufleet-job", "mountPath": LAUNCH_DIR, "readOnly": True},
            *(v.mount() for v in gang.volumes),
        ],
        # A container that fails says why in its last lines of output: the kubelet puts
        # them in its termination message, which becomes the job's reason.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if index == 0 and gang.pods > 1:
        container["ports"] = [
            {
                "name": RENDEZVOUS_PORT_NAME,
                "containerPort": gang.rendezvous_port,
                "protocol": "TCP",
            }
        ]
    return container


def _launch_volume(gang: JobGang) -> Manifest:
    """:data:`LAUNCH_DIR`: the launcher, the script and a gang pod's assignment, read-only."""
    downward = []
    if gang.script_inline:
        downward.append((gang.script_name, SCRIPT_ANNOTATION))
    if gang.pods > 1:
        downward.append((ASSIGNMENT_FILE, ASSIGNMENT_ANNOTATION))
    sources: list[Manifest] = [{"configMap": {"name": launcher_config_map_name()}}]
    if not gang.script_inline:
        sources.append({"configMap": {"name": gang.name}})
    if downward:
        items = [
            {
                "path": path,
                "fieldRef": {
                    "apiVersion": "v1",
                    "fieldPath": f"metadata.annotations['{annotation}']",
                },
            }
            for path, annotation in downward
        ]
        sources.append({"downwardAPI": {"items": items}})
    return {"name": "gpufleet-job", "projected": {"defaultMode": 0o444, "sources": sources}}


def gang_pod(gang: JobGang, index: int) -> Manifest:
    """Pod ``index`` of the attempt, on ``gang.nodes[index]``."""
    if not 0 <= index < gang.pods:
        raise ValueError(f"pod index {index} is not one of the gang's {gang.pods} pods")
    marker = part_marker(gang.marker, index)
    metadata = _metadata(gang, gang.pod_name(index), **{POD_INDEX_LABEL: str(index)})
    metadata["labels"][MARKER_LABEL] = label_value(marker)
    metadata["annotations"][MARKER_LABEL] = marker
    if gang.script_inline:
        metadata["annotations"][SCRIPT_ANNOTATION] = gang.script
    if gang.pods > 1:
        metadata["annotations"][ASSIGNMENT_ANNOTATION] = gang.assignment(index)
    spec: Manifest = {}
    if gang.pods > 1:  # its stable name, p<i>.<gang>, under the gang's Service
        spec |= {"hostname": f"p{index}", "subdomain": gang.name}
    spec |= {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {
                                    "key": "metadata.name",
                                    "operator": "In",
                                    "values": [gang.nodes[index]],
                                }
                            ]
                        }
                    ]
                }
            }
        },
    }
    if gang.node_selector:
        spec["nodeSelector"] = dict(gang.node_selector)
    if gang.tolerations:
        spec["tolerations"] = [t.manifest() for t in gang.tolerations]
    spec |= {
        "priorityClassName": gang.priority_class_name,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": gang.grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": gang.uid,
            "runAsGroup": gang.gid,
            "fsGroup": gang.gid,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(gang, index)],
        "volumes": [_launch_volume(gang), *(v.manifest() for v in gang.volumes)],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": spec,
    }


def keep_patch(gang: JobGang, index: int) -> Manifest:
    """The patch that makes a pod kept from an attempt before pod ``index`` of this one:
    its attempt and marker, and the assignment its launcher runs next. Its name, and the
    stable name under its own attempt's Service, stay (``hostname`` and ``subdomain``
    cannot change)."""
    marker = part_marker(gang.marker, index)
    return {
        "metadata": {
            "labels": {ATTEMPT_LABEL: str(gang.attempt), MARKER_LABEL: label_value(marker)},
            "annotations": {MARKER_LABEL: marker, ASSIGNMENT_ANNOTATION: gang.assignment(index)},
        }
    }
