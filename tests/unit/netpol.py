"""A pure NetworkPolicy evaluator: may this pod exchange a connection with that peer on
that port, by the rules of ``networking.k8s.io/v1``? The tests check the session's policy
with it; nothing in the test tiers enforces NetworkPolicy (that is the network plugin's work).

Covered: pod selection by namespace and ``podSelector``, ``policyTypes`` (with the API's
default when absent), peers by ``podSelector``/``namespaceSelector``/``ipBlock`` (with
``except``), ports by number, protocol and ``endPort``. Named ports admit nothing here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Remote:
    """The other end of a connection as a NetworkPolicy sees it: an address, and when it is
    a pod of the cluster, its namespace and the labels of both."""

    ip: str = ""
    namespace: str | None = None  # None: not a pod (the internet, a node, ...)
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector's verdict; the empty selector selects everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        verdict = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not verdict:
            return False
    return True


def _peer_admits(peer: Mapping[str, Any], remote: Remote, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        if not remote.ip:
            return False
        address = ipaddress.ip_address(remote.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except") or []
        )
    if remote.namespace is None:
        return False
    namespaces = peer.get("namespaceSelector")
    if namespaces is None:
        in_namespace = remote.namespace == policy_namespace
    else:
        in_namespace = _selects(namespaces, remote.namespace_labels)
    pods = peer.get("podSelector")
    return in_namespace and (pods is None or _selects(pods, remote.pod_labels))


def _port_admits(ports: Sequence[Mapping[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if wanted is None:
            return True
        # A named port would need the pod's spec to resolve: it admits nothing here.
        if isinstance(wanted, int) and wanted <= port <= entry.get("endPort", wanted):
            return True
    return False


def policy_allows(
    policies: Sequence[Mapping[str, Any]],
    *,
    namespace: str,
    pod_labels: Mapping[str, str],
    direction: Literal["ingress", "egress"],
    remote: Remote,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether ``policies`` let the pod (``namespace``, ``pod_labels``) exchange a
    connection with ``remote`` on ``port`` (the pod's port for ingress, the remote's for
    egress), by the NetworkPolicy rules: a pod that no policy selects for a direction is
    open that way; otherwise some rule of a selecting policy must admit both peer and port.
    """
    policy_type = "Ingress" if direction == "ingress" else "Egress"
    peers_key = "from" if direction == "ingress" else "to"
    isolated = False
    for policy in policies:
        spec = policy["spec"]
        if policy["metadata"]["namespace"] != namespace:
            continue
        if not _selects(spec.get("podSelector") or {}, pod_labels):
            continue
        types = spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])
        if policy_type not in types:
            continue
        isolated = True
        for rule in spec.get(direction) or []:
            peers = rule.get(peers_key)
            peer_ok = not peers or any(
                _peer_admits(p, remote, policy["metadata"]["namespace"]) for p in peers
            )
            if peer_ok and _port_admits(rule.get("ports"), port, protocol):
                return True
    return not isolated
