"""The tier's self-tests, nodes and scheduling: fake GPU nodes are Ready with their GPUs,
the real kube-scheduler places GPU pods by node affinity and GPU count (and says why it
cannot), and the real node-lifecycle controller marks a node whose lease stops NotReady."""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid

import pytest
from kubernetes_asyncio import client

from .control_plane import NAMESPACE, NODE_MONITOR_GRACE_S, Cluster, ControlPlane
from .kube import eventually, kube_client, pod_in
from .nodes import (
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    NOT_READY_TAINTS,
    PRODUCT_LABEL,
    ZONE_LABEL,
    NodeSpec,
)
from .tier import CLUSTER_A, CLUSTER_B, TIER_NODES

pytestmark = pytest.mark.k8s

SCHEDULE_DEADLINE_S = 30.0
# The controller notices a silent lease within its grace period plus a 1 s monitor pass; the
# rest is slack for a loaded machine.
NOT_READY_DEADLINE_S = NODE_MONITOR_GRACE_S + 20.0


async def test_nodes_offer_their_gpus_and_are_ready(k8s_tier: ControlPlane) -> None:
    for name, specs in TIER_NODES.items():
        cluster = k8s_tier[name]
        async with kube_client(cluster.kubeconfig("admin"), name) as api:
            core = client.CoreV1Api(api)
            leases = client.CoordinationV1Api(api)
            for spec in specs:
                node = await core.read_node(spec.name)
                assert node.status.allocatable[GPU_RESOURCE] == str(spec.gpus)
                assert node.status.capacity[GPU_RESOURCE] == str(spec.gpus)
                labels = node.metadata.labels
                assert labels[PRODUCT_LABEL] == "NVIDIA-A100-SXM4-80GB"
                assert labels[ZONE_LABEL] == spec.zone
                assert labels[HOSTNAME_LABEL] == spec.name
                assert _ready(node) == "True"
                assert not _taints(node) & NOT_READY_TAINTS
                lease = await leases.read_namespaced_lease(spec.name, "kube-node-lease")
                age = datetime.datetime.now(datetime.UTC) - lease.spec.renew_time
                assert age < datetime.timedelta(seconds=NODE_MONITOR_GRACE_S)
                assert cluster.nodes[spec.name].gpu_uuids == spec.gpu_uuids
                assert len(set(spec.gpu_uuids)) == spec.gpus


async def test_scheduler_binds_a_gpu_pod_to_its_affine_node(
    spawner_a: client.CoreV1Api,
) -> None:
    target = "a-gpu-2"
    async with pod_in(spawner_a, NAMESPACE, _gpu_pod("two-gpus", gpus=2, node=target)) as name:

        async def bound_node() -> str | None:
            pod = await spawner_a.read_namespaced_pod(name, NAMESPACE)
            return pod.spec.node_name

        node = await eventually(bound_node, f"pod {name} bound", SCHEDULE_DEADLINE_S)
        assert node == target
        pod = await spawner_a.read_namespaced_pod(name, NAMESPACE)
        scheduled = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        assert [c.status for c in scheduled] == ["True"]


async def test_a_pod_wanting_more_gpus_than_any_node_stays_pending(
    spawner_a: client.CoreV1Api,
) -> None:
    most = max(s.gpus for s in TIER_NODES[CLUSTER_A])
    async with pod_in(spawner_a, NAMESPACE, _gpu_pod("too-many", gpus=most + 1)) as name:

        async def failed_scheduling() -> str | None:
            events = await spawner_a.list_namespaced_event(
                NAMESPACE, field_selector=f"involvedObject.name={name}"
            )
            for e in events.items:
                if e.reason == "FailedScheduling":
                    return e.message
            return None

        message = await eventually(
            failed_scheduling, f"a FailedScheduling event for {name}", SCHEDULE_DEADLINE_S
        )
        assert f"Insufficient {GPU_RESOURCE}" in message
        pod = await spawner_a.read_namespaced_pod(name, NAMESPACE)
        assert pod.spec.node_name is None
        assert pod.status.phase == "Pending"


async def test_a_node_whose_lease_stops_goes_not_ready(
    cluster_b: Cluster, admin_b: client.CoreV1Api
) -> None:
    # A node of its own, so the tier's shared nodes stay Ready for every other test.
    spec = NodeSpec(cluster_b.spare_node_name(), "zone-c", gpus=2)
    node = await asyncio.to_thread(cluster_b.add_node, spec)
    try:
        assert _ready(await admin_b.read_node(node.name)) == "True"
        await asyncio.to_thread(node.stop_renewer)
        stopped = time.monotonic()

        async def unreachable() -> bool:
            n = await admin_b.read_node(node.name)
            return _ready(n) == "Unknown" and "node.kubernetes.io/unreachable" in _taints(n)

        await eventually(unreachable, f"{node.name} NotReady and tainted", NOT_READY_DEADLINE_S)
        # The controller's grace period ran out: its last renewal was at most one renewal
        # interval before the stop.
        assert time.monotonic() - stopped >= NODE_MONITOR_GRACE_S - 2
        # The shared nodes kept renewing and stay Ready.
        for spec in TIER_NODES[CLUSTER_B]:
            assert _ready(await admin_b.read_node(spec.name)) == "True"

        # Renewing again (a kubelet coming back) makes it Ready and untainted again.
        node.start_renewer()

        async def ready_again() -> bool:
            n = await admin_b.read_node(node.name)
            return _ready(n) == "True" and not _taints(n) & NOT_READY_TAINTS

        await eventually(ready_again, f"{node.name} Ready again", NOT_READY_DEADLINE_S)
    finally:
        await asyncio.to_thread(cluster_b.remove_node, node.name)


def _ready(node: client.V1Node) -> str | None:
    """The status of the node's Ready condition: "True", "False", "Unknown" or None."""
    for cond in node.status.conditions or []:
        if cond.type == "Ready":
            return str(cond.status)
    return None


def _taints(node: client.V1Node) -> set[str]:
    return {t.key for t in node.spec.taints or []}


def _gpu_pod(prefix: str, gpus: int, node: str | None = None) -> client.V1Pod:
    """A pod asking for ``gpus`` GPUs, pinned to ``node`` by required node affinity."""
    affinity = None
    if node is not None:
        term = client.V1NodeSelectorTerm(
            match_expressions=[
                client.V1NodeSelectorRequirement(key=HOSTNAME_LABEL, operator="In", values=[node])
            ]
        )
        affinity = client.V1Affinity(
            node_affinity=client.V1NodeAffinity(
                required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                    node_selector_terms=[term]
                )
            )
        )
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=f"{prefix}-{uuid.uuid4().hex[:8]}"),
        spec=client.V1PodSpec(
            affinity=affinity,
            automount_service_account_token=False,
            containers=[
                client.V1Container(
                    name="main",
                    image="busybox",
                    command=["sleep", "infinity"],
                    resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: str(gpus)}),
                )
            ],
        ),
    )
