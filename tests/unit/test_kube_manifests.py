"""The Kubernetes backend's manifests: literal outputs, the API's schemas, label escaping,
the NetworkPolicy's verdicts and the read-back comparison (no servers here)."""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.clusters.manifest_readback import dropped_fields
from gpufleet.clusters.manifests import (
    KUBE_DNS,
    USER_LABEL,
    WORKLOAD_LABEL,
    Endpoint,
    Peer,
    SessionPod,
    Toleration,
    Volume,
    is_label_value,
    label_value,
    parse_quantity,
    priority_class,
    session_labels,
    session_network_policy,
    session_pod,
)

from .netpol import Remote, policy_allows

# The oldest version the docs support and the newest the installed package bundles.
OLDEST_K8S = "1.25"
NEWEST_K8S = kubernetes_validate.latest_version()
MARKER = "5f0c3b6ad1e24e0f9d1f0b2a7c4e8d10"


def minimal(**changes: Any) -> SessionPod:
    fields: dict[str, Any] = dict(
        name="gpufleet-ann-42",
        namespace="gpufleet-sessions",
        cluster="cluster-a",
        node="a-gpu-1",
        workload_id=42,
        user="ann",
        project="vision",
        marker=MARKER,
        image="registry.example.org/gpufleet/session:1.0",
        uid=1000,
        gid=100,
        termination_grace_seconds=120,
    )
    fields.update(changes)
    return SessionPod(**fields)


FULL = minimal(
    user="ann@example.org",
    server_name="big run",
    node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    args=("jupyterhub-singleuser", "--ip=$(GPUFLEET_POD_IP)", "--port=8888"),
    env={"JUPYTERHUB_API_URL": "http://hub.hub.svc:8081/hub/api", "PRICE": "$5 $(HOME)"},
    image_pull_policy="IfNotPresent",
    image_pull_secrets=("registry-login",),
    base_url="/user/ann@example.org/big%20run/",
    fs_group=2000,
    gpus=2,
    cpu_request="2",
    cpu_limit="8",
    memory_request="16Gi",
    memory_limit="64Gi",
    tolerations=(
        Toleration("nvidia.com/gpu"),
        Toleration("dedicated", operator="Equal", value="research", effect="NoExecute", seconds=60),
    ),
    priority_class_name="gpufleet-session",
    termination_grace_seconds=600,
    volumes=(
        Volume("home", "/home/jovyan", "pvc", "home-ann"),
        Volume("env", "/opt/env", "pvc", "envs", sub_path="ann/vision"),
        Volume("dshm", "/dev/shm", "emptyDir", medium="Memory", size_limit="16Gi"),
        Volume("datasets", "/data", "hostPath", "/mnt/datasets", read_only=True),
    ),
    extra_labels={"component": "singleuser-server"},
    extra_annotations={"hub.jupyter.org/username": "ann@example.org"},
)

FULL_LABELS = {
    "app.kubernetes.io/managed-by": "gpufleet",
    "app.kubernetes.io/component": "session",
    "gpufleet.io/workload": "42",
    "gpufleet.io/user": "ann_40example.org",
    "gpufleet.io/project": "vision",
    "gpufleet.io/server": "big_20run",
    "gpufleet.io/cluster": "cluster-a",
    "gpufleet.io/marker": MARKER,
    "component": "singleuser-server",
}

FULL_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "gpufleet-ann-42",
        "namespace": "gpufleet-sessions",
        "labels": FULL_LABELS,
        "annotations": {
            "gpufleet.io/user": "ann@example.org",
            "gpufleet.io/project": "vision",
            "gpufleet.io/server": "big run",
            "gpufleet.io/cluster": "cluster-a",
            "gpufleet.io/marker": MARKER,
            "hub.jupyter.org/username": "ann@example.org",
        },
    },
    "spec": {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["a-gpu-1"]}
                            ]
                        }
                    ]
                }
            }
        },
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "dedicated",
                "operator": "Equal",
                "value": "research",
                "effect": "NoExecute",
                "tolerationSeconds": 60,
            },
        ],
        "priorityClassName": "gpufleet-session",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 600,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 100,
            "fsGroup": 2000,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "imagePullSecrets": [{"name": "registry-login"}],
        "containers": [
            {
                "name": "notebook",
                "image": "registry.example.org/gpufleet/session:1.0",
                "imagePullPolicy": "IfNotPresent",
                "args": ["jupyterhub-singleuser", "--ip=$(GPUFLEET_POD_IP)", "--port=8888"],
                "env": [
                    {
                        "name": "GPUFLEET_POD_IP",
                        "valueFrom": {
                            "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}
                        },
                    },
                    {"name": "GPUFLEET_WORKLOAD_ID", "value": "42"},
                    {"name": "GPUFLEET_SESSION_MARKER", "value": MARKER},
                    {
                        "name": "GPUFLEET_POD_NAME",
                        "valueFrom": {
                            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
                        },
                    },
                    {
                        "name": "GPUFLEET_POD_NAMESPACE",
                        "valueFrom": {
                            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}
                        },
                    },
                    {"name": "GPUFLEET_CONTAINER_NAME", "value": "notebook"},
                    {"name": "JUPYTERHUB_API_URL", "value": "http://hub.hub.svc:8081/hub/api"},
                    {"name": "PRICE", "value": "$$5 $$(HOME)"},
                ],
                "ports": [{"name": "notebook-port", "containerPort": 8888, "protocol": "TCP"}],
                "resources": {
                    "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                    "requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": "2"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": False,
                },
                "volumeMounts": [
                    {"name": "home", "mountPath": "/home/jovyan"},
                    {"name": "env", "mountPath": "/opt/env", "subPath": "ann/vision"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "datasets", "mountPath": "/data", "readOnly": True},
                ],
                "readinessProbe": {
                    "httpGet": {"path": "/user/ann@example.org/big%20run/api", "port": 8888},
                    "periodSeconds": 2,
                    "timeoutSeconds": 2,
                    "failureThreshold": 3,
                },
            }
        ],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": "home-ann"}},
            {"name": "env", "persistentVolumeClaim": {"claimName": "envs"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            {"name": "datasets", "hostPath": {"path": "/mnt/datasets", "type": "Directory"}},
        ],
    },
}


# ------------------------------------------------------------------ builders vs literals
def test_full_pod_is_the_literal() -> None:
    assert session_pod(FULL) == FULL_POD


def test_minimal_pod_is_the_literal() -> None:
    pod = minimal(gpu_resource="nvidia.com/mig-3g.40gb", server_name="")
    assert session_pod(pod) == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "gpufleet-ann-42",
            "namespace": "gpufleet-sessions",
            "labels": {
                "app.kubernetes.io/managed-by": "gpufleet",
                "app.kubernetes.io/component": "session",
                "gpufleet.io/workload": "42",
                "gpufleet.io/user": "ann",
                "gpufleet.io/project": "vision",
                "gpufleet.io/server": "",
                "gpufleet.io/cluster": "cluster-a",
                "gpufleet.io/marker": MARKER,
            },
            "annotations": {
                "gpufleet.io/user": "ann",
                "gpufleet.io/project": "vision",
                "gpufleet.io/server": "",
                "gpufleet.io/cluster": "cluster-a",
                "gpufleet.io/marker": MARKER,
            },
        },
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": ["a-gpu-1"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "priorityClassName": "gpufleet-session",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 120,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 100,
                "fsGroup": 100,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "notebook",
                    "image": "registry.example.org/gpufleet/session:1.0",
                    "env": [
                        {
                            "name": "GPUFLEET_POD_IP",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}
                            },
                        },
                        {"name": "GPUFLEET_WORKLOAD_ID", "value": "42"},
                        {"name": "GPUFLEET_SESSION_MARKER", "value": MARKER},
                        {
                            "name": "GPUFLEET_POD_NAME",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
                            },
                        },
                        {
                            "name": "GPUFLEET_POD_NAMESPACE",
                            "valueFrom": {
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}
                            },
                        },
                        {"name": "GPUFLEET_CONTAINER_NAME", "value": "notebook"},
                    ],
                    "ports": [{"name": "notebook-port", "containerPort": 8888, "protocol": "TCP"}],
                    "resources": {
                        "limits": {"nvidia.com/mig-3g.40gb": "1"},
                        "requests": {"nvidia.com/mig-3g.40gb": "1"},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": False,
                    },
                }
            ],
        },
    }


def test_priority_class_is_the_literal() -> None:
    assert priority_class("gpufleet-session", 1000, "gpufleet sessions") == {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": "gpufleet-session",
            "labels": {
                "app.kubernetes.io/managed-by": "gpufleet",
                "app.kubernetes.io/component": "session",
            },
        },
        "value": 1000,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": "gpufleet sessions",
    }


HUB_NAMESPACE = {"kubernetes.io/metadata.name": "hub"}
PROXY_PEER = Peer(pod_labels={"component": "proxy"}, namespace_labels=HUB_NAMESPACE)
HUB_API = Endpoint(Peer(pod_labels={"component": "hub"}, namespace_labels=HUB_NAMESPACE), (8081,))
CONTROLLER_API = Endpoint(
    Peer(pod_labels={"component": "gpufleet-controller"}, namespace_labels=HUB_NAMESPACE), (8003,)
)


def by_labels_policy() -> dict[str, Any]:
    return session_network_policy(
        minimal(), proxy=PROXY_PEER, hub=HUB_API, controller=CONTROLLER_API
    )


def by_address_policy() -> dict[str, Any]:
    return session_network_policy(
        minimal(),
        proxy=Peer(cidr="10.1.0.5/32"),
        hub=Endpoint(Peer(cidr="10.1.0.6/32"), (8081,)),
        controller=Endpoint(Peer(cidr="10.1.0.0/29", except_cidrs=("10.1.0.4/31",)), (8003,)),
        dns=None,
    )


def test_network_policy_by_labels_is_the_literal() -> None:
    hub_ns = {"matchLabels": {"kubernetes.io/metadata.name": "hub"}}
    assert by_labels_policy() == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "gpufleet-ann-42",
            "namespace": "gpufleet-sessions",
            "labels": session_labels(minimal()),
        },
        "spec": {
            "podSelector": {"matchLabels": {"gpufleet.io/workload": "42"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": hub_ns,
                            "podSelector": {"matchLabels": {"component": "proxy"}},
                        },
                        {
                            "namespaceSelector": hub_ns,
                            "podSelector": {"matchLabels": {"component": "hub"}},
                        },
                    ],
                    "ports": [{"protocol": "TCP", "port": 8888}],
                }
            ],
            "egress": [
                {
                    "to": [
                        {
                            "namespaceSelector": hub_ns,
                            "podSelector": {"matchLabels": {"component": "hub"}},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": 8081}],
                },
                {
                    "to": [
                        {
                            "namespaceSelector": hub_ns,
                            "podSelector": {"matchLabels": {"component": "gpufleet-controller"}},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": 8003}],
                },
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                            },
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
            ],
        },
    }


def test_network_policy_by_address_is_the_literal() -> None:
    spec = by_address_policy()["spec"]
    assert spec["ingress"] == [
        {
            "from": [{"ipBlock": {"cidr": "10.1.0.5/32"}}, {"ipBlock": {"cidr": "10.1.0.6/32"}}],
            "ports": [{"protocol": "TCP", "port": 8888}],
        }
    ]
    assert spec["egress"] == [
        {
            "to": [{"ipBlock": {"cidr": "10.1.0.6/32"}}],
            "ports": [{"protocol": "TCP", "port": 8081}],
        },
        {
            "to": [{"ipBlock": {"cidr": "10.1.0.0/29", "except": ["10.1.0.4/31"]}}],
            "ports": [{"protocol": "TCP", "port": 8003}],
        },
    ]


# ------------------------------------------------------------------ the API's schemas
MANIFESTS = {
    "full pod": lambda: session_pod(FULL),
    "minimal pod": lambda: session_pod(minimal()),
    "priority class": lambda: priority_class("gpufleet-session", 1000, "gpufleet sessions"),
    "policy by labels": by_labels_policy,
    "policy by address": by_address_policy,
}


@pytest.mark.parametrize("version", [OLDEST_K8S, NEWEST_K8S])
@pytest.mark.parametrize("which", sorted(MANIFESTS))
def test_manifests_validate_strictly(which: str, version: str) -> None:
    # It answers with the schema version it used: check that it is the one asked for.
    assert version.startswith(
        kubernetes_validate.validate(MANIFESTS[which](), version, strict=True)
    )


def test_strict_validation_catches_an_unknown_field() -> None:
    """So the test above proves something: strict mode refuses what the API lacks."""
    manifest = session_pod(minimal())
    manifest["spec"]["containers"][0]["securityContext"]["noSuchField"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, OLDEST_K8S, strict=True)


# ------------------------------------------------------------------ refusals
def test_root_is_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match=r"uid 0 is root.*set uid to the researcher's own"):
        minimal(uid=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus": 0}, "at least one GPU"),
        ({"gpu_resource": "gpu"}, "extended resource name"),
        ({"env": {"GPUFLEET_SESSION_MARKER": "x"}}, "set by gpufleet"),
        ({"env": {"A=B": "x"}}, "not a valid variable name"),
        ({"marker": ""}, "marker is empty"),
        ({"cpu_request": "4", "cpu_limit": "2"}, "cpu_request 4 is over cpu_limit 2"),
        ({"memory_limit": "lots"}, "not a Kubernetes quantity"),
        ({"name": "Ann"}, "pod name 'Ann' is not a DNS subdomain"),
        ({"namespace": "a.b"}, "not a DNS label"),
        ({"extra_labels": {"gpufleet.io/user": "x"}}, "gpufleet's"),
        ({"extra_labels": {"team": "a b"}}, "not a valid label value"),
        ({"base_url": "user/ann/"}, "must start with '/'"),
        ({"volumes": (Volume("a", "/x", "emptyDir"), Volume("b", "/x", "emptyDir"))}, "own"),
    ],
)
def test_bad_inputs_say_what_to_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        minimal(**changes)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Volume("home", "/home", "hostPath", "relative/path"), "absolute path"),
        (lambda: Volume("home", "home", "pvc", "claim"), "not absolute"),
        (lambda: Volume("home", "/home", "emptyDir", "x"), "takes no source"),
        (lambda: Volume("home", "/home", "pvc", "c", medium="Memory"), "emptyDir only"),
        (lambda: Peer(), "either pods"),
        (lambda: Peer(pod_labels={}, cidr="10.0.0.0/8"), "either pods"),
        (lambda: Peer(cidr="10.0.0.0/24", except_cidrs=("10.0.1.0/30",)), "not inside"),
        (lambda: Endpoint(Peer(cidr="10.0.0.1/32"), ()), "at least one port"),
        (lambda: Toleration("x", value="y"), "takes no value"),
        (lambda: priority_class("p", 2_000_000_000, ""), "out of range"),
    ],
)
def test_bad_parts_say_what_to_fix(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


# ------------------------------------------------------------------ label values
def unescape(value: str) -> str:
    """The inverse of label_value's escaped form (not of its hashed form)."""
    out, i = bytearray(), 0
    while i < len(value):
        if value[i] == "_":
            out.append(int(value[i + 1 : i + 3], 16))
            i += 3
        else:
            out += value[i].encode()
            i += 1
    return out.decode("utf-8", "surrogatepass")


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("ann", "ann"),
        ("Ann.Lee-2", "Ann.Lee-2"),
        ("", ""),
        ("ann@example.org", "ann_40example.org"),
        ("a_b", "a_5fb"),
        ("zoë", "zo_c3_ab"),
        # not a label value once escaped: a readable part, "_h", 20 hex digits of SHA-256
        ("-ann", "ann_hbe5b3289e7805a8a2584"),
        ("é", "x_h4a99557e4033c3539de2"),
        ("ann smith " * 10, "ann-smith-ann-smith-ann-smith-ann-smith-a_h9aa4f149c5c47dc9d034"),
    ],
)
def test_label_value_examples(raw: str, label: str) -> None:
    assert label_value(raw) == label


@given(st.text())
def test_label_values_are_valid_and_decode(raw: str) -> None:
    value = label_value(raw)
    assert is_label_value(value)
    if "_h" not in value:
        assert unescape(value) == raw


@given(st.lists(st.text(), unique=True, min_size=2, max_size=8))
def test_distinct_inputs_give_distinct_labels(raws: list[str]) -> None:
    assert len({label_value(r) for r in raws}) == len(raws)


def test_long_values_are_hashed_and_still_distinct() -> None:
    a, b = "x" * 70 + "a", "x" * 70 + "b"
    assert label_value(a) != label_value(b)
    assert all(is_label_value(label_value(v)) and len(label_value(v)) <= 63 for v in (a, b))


@given(user=st.text(), project=st.text(), server=st.text(), cluster=st.text(min_size=1))
def test_labels_round_trip_through_the_annotations(
    user: str, project: str, server: str, cluster: str
) -> None:
    metadata = session_pod(
        minimal(user=user, project=project, server_name=server, cluster=cluster)
    )["metadata"]
    for key, label in metadata["labels"].items():
        assert is_label_value(label)
        if key in metadata["annotations"]:
            assert label == label_value(metadata["annotations"][key])
    assert metadata["annotations"][USER_LABEL] == user


# ------------------------------------------------------------------ the policy's verdicts
SESSION_NS = "gpufleet-sessions"
SESSION_LABELS = session_labels(minimal())
HUB_NS_LABELS = {"kubernetes.io/metadata.name": "hub"}
PROXY = Remote("10.1.0.5", "hub", {"component": "proxy"}, HUB_NS_LABELS)
HUB = Remote("10.1.0.6", "hub", {"component": "hub"}, HUB_NS_LABELS)
CONTROLLER = Remote("10.1.0.7", "hub", {"component": "gpufleet-controller"}, HUB_NS_LABELS)
DNS = Remote(
    "10.96.0.10",
    "kube-system",
    {"k8s-app": "kube-dns"},
    {"kubernetes.io/metadata.name": "kube-system"},
)
REMOTES = {
    "proxy": PROXY,
    "hub": HUB,
    "controller": CONTROLLER,
    "dns": DNS,
    "apiserver": Remote("10.96.0.1", "default", {"component": "kube-apiserver"}, {}),
    "other kube-system pod": Remote(
        "10.96.0.20", "kube-system", {"k8s-app": "metrics"}, DNS.namespace_labels
    ),
    "other session": Remote("10.2.0.9", SESSION_NS, {**SESSION_LABELS, WORKLOAD_LABEL: "43"}, {}),
    "proxy-like pod elsewhere": Remote("10.3.0.5", "lab", {"component": "proxy"}, {}),
    "internet": Remote("93.184.216.34"),
    "cloud metadata": Remote("169.254.169.254"),
    "node": Remote("10.0.0.2"),
}
PORTS = (22, 53, 80, 443, 2379, 8000, 8001, 8003, 8081, 8888, 10250)


def allowed(policy: dict[str, Any], direction: Any) -> set[tuple[str, int, str]]:
    return {
        (name, port, protocol)
        for name, remote in REMOTES.items()
        for port in PORTS
        for protocol in ("TCP", "UDP")
        if policy_allows(
            [policy],
            namespace=SESSION_NS,
            pod_labels=SESSION_LABELS,
            direction=direction,
            remote=remote,
            port=port,
            protocol=protocol,
        )
    }


def test_policy_by_labels_allows_exactly_hub_controller_and_dns() -> None:
    policy = by_labels_policy()
    assert allowed(policy, "egress") == {
        ("hub", 8081, "TCP"),
        ("controller", 8003, "TCP"),
        ("dns", 53, "UDP"),
        ("dns", 53, "TCP"),
    }
    assert allowed(policy, "ingress") == {("proxy", 8888, "TCP"), ("hub", 8888, "TCP")}


def test_policy_by_address_allows_exactly_its_blocks() -> None:
    policy = by_address_policy()
    # The controller's /29 less its /31 holds 10.1.0.6 and .7 (hub and controller), not .5.
    assert allowed(policy, "egress") == {
        ("hub", 8081, "TCP"),
        ("hub", 8003, "TCP"),
        ("controller", 8003, "TCP"),
    }
    assert allowed(policy, "ingress") == {("proxy", 8888, "TCP"), ("hub", 8888, "TCP")}


def test_policy_isolates_only_its_own_pod() -> None:
    other = {**SESSION_LABELS, WORKLOAD_LABEL: "43"}
    for direction in ("ingress", "egress"):
        assert policy_allows(
            [by_labels_policy()],
            namespace=SESSION_NS,
            pod_labels=other,
            direction=direction,
            remote=REMOTES["internet"],
            port=443,
        )


def test_kube_dns_peer_is_the_default() -> None:
    assert by_labels_policy()["spec"]["egress"][2]["to"] == [KUBE_DNS.manifest()]


# ------------------------------------------------------------------ read-back
def as_read_back(manifest: dict[str, Any]) -> dict[str, Any]:
    """What an API server returns for a created pod: its own fields, defaults, admission's
    tolerations, canonical quantities."""
    got = copy.deepcopy(manifest)
    got["metadata"] |= {
        "uid": "d9c7",
        "resourceVersion": "812",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "managedFields": [{"manager": "gpufleet"}],
    }
    got["status"] = {"phase": "Pending"}
    spec = got["spec"]
    spec |= {"dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler", "priority": 1000}
    spec["tolerations"].append(
        {
            "key": "node.kubernetes.io/not-ready",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        }
    )
    container = spec["containers"][0]
    container |= {
        "terminationMessagePath": "/dev/termination-log",
        "imagePullPolicy": "IfNotPresent",
    }
    container["resources"]["limits"]["memory"] = "65536Mi"  # the same quantity, rewritten
    container["readinessProbe"] |= {"successThreshold": 1}
    container["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
    return got


def test_read_back_with_only_server_additions_drops_nothing() -> None:
    assert dropped_fields(session_pod(FULL), as_read_back(session_pod(FULL))) == []


def test_read_back_names_what_the_server_dropped_or_changed() -> None:
    sent = session_pod(FULL)
    got = as_read_back(sent)
    del got["spec"]["securityContext"]["seccompProfile"]
    last = len(got["spec"]["containers"][0]["env"]) - 1
    del got["spec"]["containers"][0]["env"][last]
    got["metadata"]["labels"]["gpufleet.io/user"] = "ann"
    got["spec"]["automountServiceAccountToken"] = True
    got["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "2500m"
    assert dropped_fields(sent, got) == [
        'metadata.labels["gpufleet.io/user"]',
        "spec.automountServiceAccountToken",
        "spec.securityContext.seccompProfile",
        f"spec.containers[0].env[{last}]",
        "spec.containers[0].resources.requests.cpu",
    ]


def test_read_back_of_a_priority_class_omits_its_false_default() -> None:
    sent = priority_class("gpufleet-session", 1000, "gpufleet sessions")
    got = {k: v for k, v in copy.deepcopy(sent).items() if k != "globalDefault"}
    assert dropped_fields(sent, got) == []
    assert dropped_fields(sent, {**got, "preemptionPolicy": "PreemptLowerPriority"}) == [
        "preemptionPolicy"
    ]


def test_read_back_keeps_false_security_fields_to_account() -> None:
    sent = session_pod(minimal())
    got = copy.deepcopy(sent)
    del got["spec"]["automountServiceAccountToken"]
    del got["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    assert dropped_fields(sent, got) == [
        "spec.automountServiceAccountToken",
        "spec.containers[0].securityContext.allowPrivilegeEscalation",
    ]


@pytest.mark.parametrize(
    ("quantity", "value"),
    [("2", "2"), ("500m", "0.5"), ("16Gi", str(16 * 2**30)), ("1e3", "1000"), ("1.5k", "1500")],
)
def test_quantities(quantity: str, value: str) -> None:
    assert parse_quantity(quantity) == Decimal(value)
