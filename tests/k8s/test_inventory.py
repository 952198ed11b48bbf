"""The controller's view of both clusters, against the real API servers: every GPU node
found with its zone, type and GPUs; cordons one truth both ways; nodes added, deleted and
NotReady; one cluster cut off while the other goes on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from gpufleet.clusters.kube_config import ClusterSettings
from gpufleet.clusters.node_watch import cordon_patch
from gpufleet.hub.kube_inventory import KubeInventory
from gpufleet.state import db
from gpufleet.state.clusters import slot_uuid
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Cluster as ClusterRow
from gpufleet.state.models import Event, Gpu, Node, NodeHealth, Zone

from .control_plane import ControlPlane
from .kube import eventually
from .nodes import NodeSpec
from .partition import Partition
from .pki import KubeContext, write_kubeconfig
from .tier import CLUSTER_A, CLUSTER_B

pytestmark = pytest.mark.k8s

UNREACHABLE_AFTER_S = 2.0


@pytest.fixture
def partition(k8s_tier: ControlPlane) -> Iterator[Partition]:
    """The way from the controller to cluster-b's API server, which a test may cut."""
    cut = Partition(k8s_tier[CLUSTER_B].ports["apiserver"])
    try:
        yield cut
    finally:
        cut.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FleetStore]:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'gpufleet.sqlite'}")
    db.upgrade(engine)
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(datetime.now(UTC))
    try:
        yield store
    finally:
        engine.dispose()


@pytest.fixture
async def inventory(
    k8s_tier: ControlPlane, partition: Partition, store: FleetStore, tmp_path: Path
) -> AsyncIterator[KubeInventory]:
    """The controller's watches of both clusters as gpufleet's controller identity,
    cluster-b's through the partition, writing into a real store."""
    b = k8s_tier[CLUSTER_B]
    through = write_kubeconfig(
        tmp_path / "b-through-partition.kubeconfig",
        b.ca.cert_path,
        [KubeContext(b.name, partition.address, b.identities["controller"])],
        current=b.name,
    )
    clusters = [
        ClusterSettings(name=CLUSTER_A, kubeconfig=str(k8s_tier.kubeconfig), context=CLUSTER_A),
        ClusterSettings(name=CLUSTER_B, kubeconfig=str(through)),
    ]
    kube = KubeInventory(
        clusters,
        store,
        log=logging.getLogger("gpufleet.test.inventory"),
        now=lambda: datetime.now(UTC),
        kick=lambda: None,
        unreachable_after=UNREACHABLE_AFTER_S,
        probe_interval=0.3,
    )
    await kube.start()
    writer = asyncio.create_task(kube.run(lambda: True, interval=0.2))
    try:
        yield kube
    finally:
        writer.cancel()
        await kube.close()


def node_row(store: FleetStore, name: str) -> tuple[str, str, str, NodeHealth, bool, int] | None:
    """(cluster, zone, GPU type, health, cordoned, GPUs present) of a node, as recorded."""
    with store.read() as session:
        row = session.execute(
            select(ClusterRow.name, Zone.name, Node.gpu_type, Node.health, Node.cordoned, Node.id)
            .join(Zone, Node.zone_id == Zone.id)
            .join(ClusterRow, Zone.cluster_id == ClusterRow.id)
            .where(Node.name == name)
        ).first()
        if row is None:
            return None
        present = session.scalars(
            select(Gpu.uuid).where(Gpu.node_id == row[5], Gpu.present.is_(True))
        ).all()
        return (row[0], row[1], row[2], row[3], row[4], len(present))


def recorded(store: FleetStore, name: str, expected: object) -> Callable[[], object]:
    async def probe() -> bool:
        return node_row(store, name) == expected

    return probe


def set_unschedulable(plane: ControlPlane, cluster: str, node: str, value: bool) -> None:
    """What `kubectl cordon` does: a patch of the Node's spec, as the cluster's admin."""
    with plane[cluster].rest() as api:
        r = api.patch(
            f"/api/v1/nodes/{node}",
            json={"spec": {"unschedulable": value}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        r.raise_for_status()


def api_unschedulable(plane: ControlPlane, cluster: str, node: str) -> bool:
    with plane[cluster].rest() as api:
        r = api.get(f"/api/v1/nodes/{node}")
        r.raise_for_status()
        return bool(r.json()["spec"].get("unschedulable", False))


async def test_every_clusters_gpu_nodes_are_found_with_zone_type_and_gpus(
    inventory: KubeInventory, store: FleetStore
) -> None:
    ok = NodeHealth.ok
    await eventually(
        recorded(store, "a-gpu-1", (CLUSTER_A, "zone-a", "A100-80GB", ok, False, 4)),
        "a-gpu-1 recorded",
        15.0,
    )
    await eventually(
        recorded(store, "a-gpu-2", (CLUSTER_A, "zone-b", "A100-80GB", ok, False, 4)),
        "a-gpu-2 recorded",
        15.0,
    )
    await eventually(
        recorded(store, "b-gpu-1", (CLUSTER_B, "zone-c", "A100-80GB", ok, False, 4)),
        "b-gpu-1 recorded",
        15.0,
    )
    with store.read() as session:
        uuids = session.scalars(select(Gpu.uuid).join(Node).where(Node.name == "b-gpu-1"))
        assert sorted(uuids) == [slot_uuid(CLUSTER_B, "b-gpu-1", i) for i in range(4)]


def taints_of(plane: ControlPlane, cluster: str, node: str) -> list[str]:
    with plane[cluster].rest() as api:
        spec = api.get(f"/api/v1/nodes/{node}").json()["spec"]
    return [t["key"] for t in spec.get("taints") or []]


async def test_a_cordon_is_one_truth_in_kubernetes_and_gpufleet(
    inventory: KubeInventory, store: FleetStore, k8s_tier: ControlPlane
) -> None:
    ok = NodeHealth.ok
    free = (CLUSTER_A, "zone-b", "A100-80GB", ok, False, 4)
    cordoned = (CLUSTER_A, "zone-b", "A100-80GB", ok, True, 4)
    await eventually(recorded(store, "a-gpu-2", free), "a-gpu-2 recorded", 15.0)
    listings = inventory.watches[CLUSTER_A].listings
    try:
        # A large Node (as one that lists many images) comes through the watch too.
        with k8s_tier[CLUSTER_A].rest() as api:
            api.patch(
                "/api/v1/nodes/a-gpu-2",
                json={"metadata": {"annotations": {"example.org/padding": "x" * 200_000}}},
                headers={"Content-Type": "application/strategic-merge-patch+json"},
            ).raise_for_status()
        set_unschedulable(k8s_tier, CLUSTER_A, "a-gpu-2", True)  # kubectl cordon
        await eventually(recorded(store, "a-gpu-2", cordoned), "kubectl's cordon seen", 5.0)
        # Seen through the watch, not by listing again after the watch broke on it.
        assert inventory.watches[CLUSTER_A].listings == listings
        # gpufleet's uncordon is Kubernetes' (the controller's own identity patches it).
        await inventory.cordon("a-gpu-2", CLUSTER_A, False)
        assert not api_unschedulable(k8s_tier, CLUSTER_A, "a-gpu-2")
        await eventually(recorded(store, "a-gpu-2", free), "the uncordon seen", 5.0)
        await inventory.cordon("a-gpu-2", CLUSTER_A, True)
        assert api_unschedulable(k8s_tier, CLUSTER_A, "a-gpu-2")
        assert "gpufleet.io/cordoned" in taints_of(k8s_tier, CLUSTER_A, "a-gpu-2")
        await eventually(recorded(store, "a-gpu-2", cordoned), "gpufleet's cordon seen", 5.0)
        # Someone's kubectl uncordon clears spec.unschedulable: gpufleet's taint keeps
        # the node cordoned, for kube-scheduler and in gpufleet's inventory alike.
        with k8s_tier[CLUSTER_A].rest() as api:  # kubectl uncordon, and a label to see it by
            api.patch(
                "/api/v1/nodes/a-gpu-2",
                json={
                    "metadata": {"labels": {"example.org/uncordoned": "yes"}},
                    "spec": {"unschedulable": False},
                },
                headers={"Content-Type": "application/strategic-merge-patch+json"},
            ).raise_for_status()
        view = inventory.watches[CLUSTER_A].view

        async def seen() -> bool:
            state = view.nodes.get("a-gpu-2")
            return state is not None and "example.org/uncordoned" in state.labels

        await eventually(seen, "the kubectl uncordon seen by the watch", 5.0)
        assert view.nodes["a-gpu-2"].unschedulable
        assert node_row(store, "a-gpu-2") == cordoned
        await inventory.cordon("a-gpu-2", CLUSTER_A, False)
        assert "gpufleet.io/cordoned" not in taints_of(k8s_tier, CLUSTER_A, "a-gpu-2")
        await eventually(recorded(store, "a-gpu-2", free), "the taint gone", 5.0)
    finally:
        with k8s_tier[CLUSTER_A].rest() as api:  # uncordoned whatever failed above
            node = api.get("/api/v1/nodes/a-gpu-2").json()
            api.patch(
                "/api/v1/nodes/a-gpu-2",
                json={"spec": cordon_patch(node, False)["spec"]},
                headers={"Content-Type": "application/strategic-merge-patch+json"},
            ).raise_for_status()
        with k8s_tier[CLUSTER_A].rest() as api:
            api.patch(
                "/api/v1/nodes/a-gpu-2",
                json={
                    "metadata": {
                        "annotations": {"example.org/padding": None},
                        "labels": {"example.org/uncordoned": None},
                    }
                },
                headers={"Content-Type": "application/strategic-merge-patch+json"},
            ).raise_for_status()
    await eventually(recorded(store, "a-gpu-2", free), "uncordoned again", 5.0)


async def test_nodes_added_stopped_and_deleted_are_seen(
    inventory: KubeInventory, store: FleetStore, k8s_tier: ControlPlane
) -> None:
    b = k8s_tier[CLUSTER_B]
    name = b.spare_node_name()
    b.add_node(NodeSpec(name, "zone-d", gpus=2))
    try:
        ready = (CLUSTER_B, "zone-d", "A100-80GB", NodeHealth.ok, False, 2)
        await eventually(recorded(store, name, ready), f"{name} found", 10.0)

        b.kubelet(name).pause()  # its kubelet hangs: the node-lifecycle controller notices
        lost = (CLUSTER_B, "zone-d", "A100-80GB", NodeHealth.unhealthy, False, 2)
        await eventually(recorded(store, name, lost), f"{name} not Ready", 30.0)
        with store.read() as session:
            said = session.scalars(
                select(Event.message).where(Event.kind == "node-not-ready", Event.node == name)
            ).all()
        assert said and "it receives no new work" in said[-1]

        b.kubelet(name).resume()
        await eventually(recorded(store, name, ready), f"{name} Ready again", 30.0)
    finally:
        b.remove_node(name)
    gone = (CLUSTER_B, "zone-d", "A100-80GB", NodeHealth.unknown, False, 0)
    await eventually(recorded(store, name, gone), f"{name} deleted", 10.0)


async def test_a_cluster_cut_off_makes_only_its_nodes_unknown_and_comes_back(
    inventory: KubeInventory, store: FleetStore, k8s_tier: ControlPlane, partition: Partition
) -> None:
    ok = NodeHealth.ok
    b_ready = (CLUSTER_B, "zone-c", "A100-80GB", ok, False, 4)
    await eventually(recorded(store, "b-gpu-1", b_ready), "b-gpu-1 recorded", 15.0)
    await eventually(
        recorded(store, "a-gpu-1", (CLUSTER_A, "zone-a", "A100-80GB", ok, False, 4)),
        "a-gpu-1 recorded",
        15.0,
    )
    partition.cut()
    b_unknown = (CLUSTER_B, "zone-c", "A100-80GB", NodeHealth.unknown, False, 4)
    await eventually(
        recorded(store, "b-gpu-1", b_unknown),
        "cluster-b's nodes unknown",
        UNREACHABLE_AFTER_S + 10.0,
    )
    status = {c.name: c for c in store.clusters.cluster_statuses()}
    assert not status[CLUSTER_B].reachable and status[CLUSTER_B].message
    assert status[CLUSTER_A].reachable
    try:
        # The other cluster goes on: its changes still arrive while cluster-b is cut off.
        set_unschedulable(k8s_tier, CLUSTER_A, "a-gpu-1", True)
        await eventually(
            recorded(store, "a-gpu-1", (CLUSTER_A, "zone-a", "A100-80GB", ok, True, 4)),
            "cluster-a's cordon seen while cluster-b is cut off",
            5.0,
        )
    finally:
        set_unschedulable(k8s_tier, CLUSTER_A, "a-gpu-1", False)
    partition.heal()
    await eventually(recorded(store, "b-gpu-1", b_ready), "cluster-b's nodes back", 20.0)
    assert {c.name: c for c in store.clusters.cluster_statuses()}[CLUSTER_B].reachable
