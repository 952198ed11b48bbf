"""Who session and job pods may reach, and who may reach them, as configured: the hub's and
the controller's options (``c.KubeGPUSpawner.network_*``, ``c.KubeJobs.network_*``) and a
cluster's own (``c.FleetController.clusters[].network``), which wins where it is given.

A fleet of several clusters needs the latter: its platform runs in one cluster, whose pods'
labels mean nothing in another, so the other clusters' pods reach the hub and the
controller at addresses (an internal load balancer's) that only they know.

Each peer is ``{cidr, except_cidrs}`` or ``{pod_labels, namespace_labels}``; an endpoint
adds ``{ports}``. Pure: configuration in, :class:`~.manifests.Peer` and
:class:`~.manifests.Endpoint` out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .manifests import Endpoint, Peer


class ClusterNetwork(BaseModel):
    """A cluster's own peers for its session and job pods (empty: the fleet-wide option)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hub: dict[str, Any] = Field(
        default_factory=dict,
        description="The hub's API as this cluster's pods reach it (c.KubeGPUSpawner."
        "network_hub, c.KubeJobs.network_hub for this cluster alone).",
    )
    controller: dict[str, Any] = Field(
        default_factory=dict,
        description="The controller as this cluster's pods reach it (network_controller).",
    )
    proxy: dict[str, Any] = Field(
        default_factory=dict,
        description="Who may reach this cluster's session pods besides the hub "
        "(c.KubeGPUSpawner.network_proxy).",
    )
    job_egress: list[dict[str, Any]] | None = Field(
        default=None,
        description="Where this cluster's job pods may go besides the platform "
        "(c.KubeJobs.network_egress); None: the fleet-wide list.",
    )

    @model_validator(mode="after")
    def _peers(self) -> ClusterNetwork:
        """A bad peer is refused when the configuration is read, naming it."""
        given = {"hub": self.hub, "controller": self.controller, "proxy": self.proxy}
        given |= {f"job_egress[{i}]": e for i, e in enumerate(self.job_egress or ())}
        for name, spec in given.items():
            if not spec:
                continue
            try:
                peer_from_config(spec)
                [int(p) for p in spec.get("ports", ())]
            except (ValueError, TypeError) as e:
                raise ValueError(f"network.{name}: {e}") from e
        return self


def peer_from_config(spec: Mapping[str, Any]) -> Peer:
    """A NetworkPolicy peer from its configuration: {cidr, except_cidrs} or {pod_labels,
    namespace_labels}."""
    return Peer(
        pod_labels=spec.get("pod_labels"),
        namespace_labels=spec.get("namespace_labels"),
        cidr=str(spec.get("cidr", "")),
        except_cidrs=tuple(spec.get("except_cidrs", ())),
    )


def url_port(url: str) -> int:
    parsed = urlparse(url)
    return parsed.port or (443 if parsed.scheme == "https" else 80)


def address_peer(url: str, option: str) -> Peer:
    """The host of ``url`` as a one-address peer; a host that is a name, not an address,
    cannot be one, and the error says to give ``option`` instead."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        return Peer(cidr=str(ipaddress.ip_network(host)))
    except ValueError:
        raise ValueError(
            f"{url} names its host {host!r}, not an address, so a NetworkPolicy cannot "
            f"allow it by default: give {option} (the pods or the address block behind it)"
        ) from None


def address_endpoint(url: str, option: str, *specs: Mapping[str, Any] | None) -> Endpoint:
    """The first given of ``specs`` as an endpoint ({ports} default to ``url``'s port), or
    by default the host and port of ``url`` as a one-address peer (``option``: what to set
    where that host is a name)."""
    port = url_port(url)
    for spec in specs:
        if spec:
            ports = tuple(int(p) for p in spec.get("ports", (port,)))
            return Endpoint(peer_from_config(spec), ports)
    return Endpoint(address_peer(url, option), (port,))


def egress_endpoints(specs: Sequence[Mapping[str, Any]]) -> tuple[Endpoint, ...]:
    return tuple(
        Endpoint(peer_from_config(e), tuple(int(p) for p in e.get("ports", ()))) for e in specs
    )
