"""The Kubernetes clusters of a fleet: what ``c.FleetController.clusters`` says of each, and
an API client per cluster.

Both the controller (inventory, cordons) and the hub's KubeGPUSpawner (pods) read the same
list from ``jupyterhub_config.py``, so a cluster is named once and both talk to it the same
way. Each cluster gets its own ``kubernetes_asyncio`` client built from its own kubeconfig
file and context (or the in-cluster service account): never the library's process-wide
default configuration, which is what keeps KubeSpawner on one cluster.

A cluster entry::

    {"name": "us-east", "kubeconfig": "/etc/gpufleet/kube/us-east.yaml", "context": "gpu",
     "namespace": "gpufleet", "gpu_resource": "nvidia.com/gpu",
     "gpu_node_selector": {"nvidia.com/gpu.present": "true"},
     "pod_url": "http://{ip}:{port}"}

Everything but ``name`` and one of ``kubeconfig``/``in_cluster`` has a default; an unknown
key is an error (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .network_peers import ClusterNetwork

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
# GPU Feature Discovery's label for the GPU's model ("NVIDIA-A100-SXM4-80GB").
DEFAULT_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_ZONE_LABEL = "topology.kubernetes.io/zone"
# Extended resources are "<domain>/<name>"; MIG slices are "nvidia.com/mig-<profile>".
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_URL_FIELDS = {"ip", "port", "cluster", "namespace", "pod"}


class ClusterError(Exception):
    """Base class for what goes wrong with a configured Kubernetes cluster."""


class ClusterConfigError(ClusterError):
    """``c.FleetController.clusters`` cannot be used as written; the message names the
    cluster and what to fix."""


class ClusterSettings(BaseModel):
    """One Kubernetes cluster of the fleet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The cluster's name in gpufleet (pages, events, placement).")
    kubeconfig: str | None = Field(
        default=None, description="A kubeconfig file holding this cluster's credentials."
    )
    context: str | None = Field(
        default=None, description="The kubeconfig context to use; None: its current context."
    )
    in_cluster: bool = Field(
        default=False,
        description="Use the service account of the pod gpufleet runs in (the cluster it "
        "runs on) instead of a kubeconfig.",
    )
    namespace: str = Field(default="gpufleet", description="Where session pods are created.")
    gpu_resource: str = Field(
        default=DEFAULT_GPU_RESOURCE,
        description="The extended resource that counts GPUs on this cluster's nodes: "
        "nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-3g.40gb.",
    )
    gpu_node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels a node must carry to be one of the fleet's GPU nodes (and that "
        "session pods select); empty: every node with GPUs of gpu_resource.",
    )
    gpu_product_label: str = Field(
        default=DEFAULT_PRODUCT_LABEL, description="The node label naming the GPU model."
    )
    zone_label: str = Field(
        default=DEFAULT_ZONE_LABEL, description="The node label naming its zone."
    )
    gpu_type_names: dict[str, str] = Field(
        default_factory=dict,
        description="GPU type names by product label value, where the derived name "
        '("NVIDIA-A100-SXM4-80GB" → "A100-80GB") is not the one the quotas use.',
    )
    network: ClusterNetwork = Field(
        default_factory=ClusterNetwork,
        description="This cluster's own NetworkPolicy peers for its session and job pods "
        "(clusters/network_peers.py): {hub, controller, proxy, job_egress}, each over the "
        "fleet-wide option where given.",
    )
    pod_url: str = Field(
        default="http://{ip}:{port}",
        description="How the hub's proxy reaches a session pod: the pod IP (as on EKS with "
        "the VPC CNI) by default, or a URL template with {ip}, {port}, {cluster}, "
        "{namespace} and {pod} (an ingress per cluster).",
    )

    @field_validator("name", "namespace")
    @classmethod
    def _dns_label(cls, value: str, info: ValidationInfo) -> str:
        if not _DNS_LABEL.match(value):
            what = "cluster name" if info.field_name == "name" else "Kubernetes namespace name"
            raise ValueError(
                f"{value!r} is not a valid {what}: use lower-case letters, digits and "
                "dashes, at most 63 characters, starting and ending with a letter or digit"
            )
        return value

    @field_validator("gpu_resource")
    @classmethod
    def _resource(cls, value: str) -> str:
        if not _RESOURCE.match(value):
            raise ValueError(
                f"{value!r} is not an extended resource name such as nvidia.com/gpu or "
                "nvidia.com/mig-3g.40gb"
            )
        return value

    @field_validator("pod_url")
    @classmethod
    def _pod_url(cls, value: str) -> str:
        used = set(re.findall(r"{(\w*)}", value))
        unknown = used - _URL_FIELDS
        if unknown:
            raise ValueError(
                f"pod_url {value!r} uses {', '.join(sorted(unknown))}, which it may not: "
                "it may use only " + ", ".join(sorted(_URL_FIELDS))
            )
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"pod_url {value!r} must start with http:// or https://")
        return value

    @model_validator(mode="after")
    def _credentials(self) -> ClusterSettings:
        if self.in_cluster == bool(self.kubeconfig):
            raise ValueError(
                "give exactly one of kubeconfig (a file) and in_cluster (True: the pod's "
                "own service account)"
            )
        return self

    @property
    def mig_profile(self) -> str | None:
        """The MIG profile its GPU resource counts ("3g.40gb"), None for whole GPUs."""
        _, _, resource = self.gpu_resource.partition("/")
        return resource.removeprefix("mig-") if resource.startswith("mig-") else None

    def pod_address(self, *, ip: str, port: int, pod: str) -> str:
        """Where the proxy reaches a session pod of this cluster."""
        return self.pod_url.format(
            ip=ip, port=port, cluster=self.name, namespace=self.namespace, pod=pod
        )


def parse_clusters(entries: Sequence[Mapping[str, Any]]) -> tuple[ClusterSettings, ...]:
    """The configured clusters, checked whole: every problem of every entry is reported
    at once, each naming its cluster (or position) and what to fix."""
    problems: list[str] = []
    clusters: list[ClusterSettings] = []
    for position, entry in enumerate(entries):
        label = f"clusters[{position}]"
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            label = f"cluster {entry['name']!r}"
        try:
            clusters.append(ClusterSettings.model_validate(dict(entry)))
        except (ValidationError, TypeError, ValueError) as e:
            problems.extend(f"{label}: {line}" for line in _messages(e))
    names = [
        str(e["name"]) for e in entries if isinstance(e, Mapping) and isinstance(e.get("name"), str)
    ]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"cluster {name!r} is declared {names.count(name)} times")
    for cluster in clusters:
        if cluster.kubeconfig and not os.path.isfile(cluster.kubeconfig):
            problems.append(
                f"cluster {cluster.name!r}: kubeconfig {cluster.kubeconfig} does not exist "
                "or is not a file"
            )
    if problems:
        raise ClusterConfigError("; ".join(problems))
    return tuple(clusters)


def _messages(error: Exception) -> list[str]:
    if not isinstance(error, ValidationError):
        return [str(error)]
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = f"unknown key (the keys are {', '.join(ClusterSettings.model_fields)})"
        lines.append(f"{where}: {message}" if where else message)
    return lines


async def load_configuration(settings: ClusterSettings) -> Any:
    """This cluster's ``kubernetes_asyncio`` client configuration, from its kubeconfig
    file and context or the in-cluster service account. Nothing is contacted yet.

    Raises :class:`ClusterConfigError` when the kubeconfig cannot be loaded or lacks the
    context.
    """
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        if settings.in_cluster:
            config.load_incluster_config(client_configuration=configuration)
        else:
            await config.load_kube_config(
                config_file=settings.kubeconfig,
                context=settings.context,
                client_configuration=configuration,
                persist_config=False,
            )
    except (ConfigException, OSError, ValueError, KeyError, TypeError) as e:
        source = "the in-cluster service account" if settings.in_cluster else settings.kubeconfig
        context = f" (context {settings.context!r})" if settings.context else ""
        raise ClusterConfigError(
            f"cluster {settings.name!r}: cannot load {source}{context}: {e}"
        ) from e
    return configuration


async def check_loadable(clusters: Sequence[ClusterSettings]) -> None:
    """Load every cluster's credentials once (at start-up), reporting all that fail."""
    problems = []
    for settings in clusters:
        try:
            await load_configuration(settings)
        except ClusterConfigError as e:
            problems.append(str(e))
    if problems:
        raise ClusterConfigError("; ".join(problems))


async def api_client(settings: ClusterSettings) -> Any:
    """A new ``kubernetes_asyncio`` API client for this cluster alone (close it when done);
    raises :class:`ClusterConfigError` as :func:`load_configuration`."""
    from kubernetes_asyncio import client

    return client.ApiClient(await load_configuration(settings))
