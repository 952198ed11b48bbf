"""What Kubernetes API servers say of their nodes, recorded as the fleet's inventory, on
SQLite and PostgreSQL: GPU slots a session can be admitted to, cordons and readiness as
Kubernetes reports them, deleted nodes, and a cluster whose API server stops answering."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import Engine, select

from gpufleet.state.clusters import ClusterNodeState, slot_uuid
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec
from gpufleet.state.models import Allocation, Gpu, Node, NodeHealth

from .test_store import (
    GROUPS,
    PRIORITY_CLASSES,
    PROFILES,
    PROJECTS,
    T0,
    allocations,
    ask,
    cycle,
    events,
    t,
    workload,
)


def state(name: str, zone: str = "zone-a", gpus: int = 4, **changes: object) -> ClusterNodeState:
    fields: dict[str, object] = {
        "name": name,
        "zone": zone,
        "gpu_type": "A100",
        "gpus": gpus,
        "ready": True,
        "unschedulable": False,
        "cpus": 32.0,
        "memory_bytes": 2**38,
        "labels": {"topology.kubernetes.io/zone": zone},
    }
    fields.update(changes)
    return ClusterNodeState(**fields)  # type: ignore[arg-type]


@pytest.fixture
def store(engine: Engine) -> FleetStore:
    """A controller holding the lease, with projects and no nodes yet."""
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(seconds=15))
    assert store.try_acquire_lease(T0)
    store.projects.apply_config(T0, PROJECTS, PROFILES, PRIORITY_CLASSES)
    store.projects.sync_memberships(T0, GROUPS)
    return store


def health(store: FleetStore) -> dict[str, tuple[NodeHealth, bool]]:
    with store.read() as session:
        return {
            n: (h, c) for n, h, c in session.execute(select(Node.name, Node.health, Node.cordoned))
        }


def present_gpus(store: FleetStore, node: str) -> list[str]:
    with store.read() as session:
        return list(
            session.scalars(
                select(Gpu.uuid)
                .join(Node)
                .where(Node.name == node, Gpu.present.is_(True))
                .order_by(Gpu.index)
            )
        )


def test_a_listed_node_offers_its_gpus_as_slots_a_session_is_admitted_to(
    store: FleetStore,
) -> None:
    changed = store.clusters.sync_cluster_nodes(
        t(1), "cluster-a", [state("a-gpu-1", gpus=2)], complete=True, context="a"
    )
    assert changed == ["a-gpu-1"]
    assert present_gpus(store, "a-gpu-1") == [
        slot_uuid("cluster-a", "a-gpu-1", 0),
        slot_uuid("cluster-a", "a-gpu-1", 1),
    ]
    assert events(store, "node-registered") == [
        "node a-gpu-1 found in cluster cluster-a (zone-a) with 2 × A100"
    ]
    # The same listing again changes nothing and says nothing.
    assert store.clusters.sync_cluster_nodes(t(2), "cluster-a", [state("a-gpu-1", gpus=2)]) == []
    assert len(events(store, "node-registered")) == 1

    alice = ask(store, t(3), "alice", gpus=2)
    cycle(store, t(4))
    assert workload(store, alice).state.value == "admitted"
    assert sorted(uuid for _, uuid, _ in allocations(store)) == present_gpus(store, "a-gpu-1")
    statuses = {c.name: c for c in store.clusters.cluster_statuses()}
    assert statuses["cluster-a"].backend == "kubernetes"
    assert statuses["cluster-a"].reachable


def test_a_cordon_in_kubernetes_and_a_not_ready_node_take_no_new_work(
    store: FleetStore,
) -> None:
    store.clusters.sync_cluster_nodes(
        t(1), "cluster-a", [state("a-gpu-1"), state("a-gpu-2", "zone-b")], complete=True
    )
    store.clusters.sync_cluster_nodes(
        t(2),
        "cluster-a",
        [
            state("a-gpu-1", unschedulable=True),
            state(
                "a-gpu-2",
                "zone-b",
                ready=False,
                why_not_ready="NodeStatusUnknown: Kubelet stopped posting node status.",
            ),
        ],
    )
    assert health(store) == {
        "a-gpu-1": (NodeHealth.ok, True),
        "a-gpu-2": (NodeHealth.unhealthy, False),
    }
    assert events(store, "node-cordoned") == [
        "node a-gpu-1 is cordoned in cluster cluster-a (spec.unschedulable); it receives no "
        "new work"
    ]
    assert events(store, "node-not-ready") == [
        "node a-gpu-2 of cluster cluster-a is not Ready (NodeStatusUnknown: Kubelet stopped "
        "posting node status.); it receives no new work"
    ]
    alice = ask(store, t(3), "alice")
    cycle(store, t(4))
    assert workload(store, alice).state.value == "pending"
    assert "cordoned, unhealthy or silent" in workload(store, alice).reason

    store.clusters.sync_cluster_nodes(
        t(5), "cluster-a", [state("a-gpu-1"), state("a-gpu-2", "zone-b")]
    )
    assert health(store) == {
        "a-gpu-1": (NodeHealth.ok, False),
        "a-gpu-2": (NodeHealth.ok, False),
    }
    cycle(store, t(6))
    assert workload(store, alice).state.value == "admitted"


def test_a_node_gone_from_a_complete_listing_keeps_its_row_but_offers_nothing(
    store: FleetStore,
) -> None:
    store.clusters.sync_cluster_nodes(
        t(1), "cluster-a", [state("a-gpu-1"), state("a-gpu-2")], complete=True
    )
    assert store.clusters.sync_cluster_nodes(
        t(2), "cluster-a", [state("a-gpu-1")], complete=True
    ) == ["a-gpu-2"]
    assert present_gpus(store, "a-gpu-2") == []
    assert health(store)["a-gpu-2"] == (NodeHealth.unknown, False)
    assert events(store, "node-deleted") == [
        "node a-gpu-2 was deleted from cluster cluster-a; it receives no new work"
    ]
    # Back again (a node re-registered under its name): its slots return.
    store.clusters.sync_cluster_nodes(t(3), "cluster-a", [state("a-gpu-2")])
    assert len(present_gpus(store, "a-gpu-2")) == 4
    assert health(store)["a-gpu-2"] == (NodeHealth.ok, False)


def test_a_gpu_count_drop_is_an_event_and_the_slots_beyond_it_leave(store: FleetStore) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("a-gpu-1", gpus=4)], complete=True)
    store.clusters.sync_cluster_nodes(t(2), "cluster-a", [state("a-gpu-1", gpus=3)])
    assert len(present_gpus(store, "a-gpu-1")) == 3
    assert events(store, "gpu-count-changed") == [
        "node a-gpu-1 of cluster cluster-a offers 3 GPU(s), was 4"
    ]


def test_an_unreachable_cluster_makes_only_its_own_nodes_unknown(store: FleetStore) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("a-gpu-1")], complete=True)
    store.clusters.sync_cluster_nodes(
        t(1), "cluster-b", [state("b-gpu-1", "zone-c")], complete=True
    )
    assert store.clusters.set_cluster_reachable(t(2), "cluster-b", False, "ConnectTimeout")
    assert not store.clusters.set_cluster_reachable(t(3), "cluster-b", False, "ConnectTimeout")
    assert health(store) == {
        "a-gpu-1": (NodeHealth.ok, False),
        "b-gpu-1": (NodeHealth.unknown, False),
    }
    assert events(store, "cluster-unreachable") == [
        "cluster cluster-b's API server does not answer (ConnectTimeout); its 1 node(s) "
        "receive no new work until it does"
    ]
    # What a watch still says of a node while its cluster is unreachable does not revive it.
    store.clusters.sync_cluster_nodes(t(4), "cluster-b", [state("b-gpu-1", "zone-c", cpus=16.0)])
    assert health(store)["b-gpu-1"] == (NodeHealth.unknown, False)
    status = {c.name: c for c in store.clusters.cluster_statuses()}["cluster-b"]
    assert (status.reachable, status.message, status.since) == (False, "ConnectTimeout", t(2))

    assert store.clusters.set_cluster_reachable(t(5), "cluster-b", True)
    store.clusters.sync_cluster_nodes(
        t(6), "cluster-b", [state("b-gpu-1", "zone-c")], complete=True
    )
    assert health(store)["b-gpu-1"] == (NodeHealth.ok, False)
    assert events(store, "cluster-reachable") == ["cluster cluster-b's API server answers again"]


def test_kubernetes_nodes_are_not_lost_for_want_of_an_agent_heartbeat(store: FleetStore) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("a-gpu-1")], complete=True)
    assert store.jobs.lose_silent_nodes(t(100), timedelta(seconds=30)).nodes == []
    assert health(store)["a-gpu-1"] == (NodeHealth.ok, False)


def agent_names_its_gpus(store: FleetStore) -> None:
    """The node agent of a-gpu-1 reports its two GPUs, GPU-real-0 and GPU-real-1."""
    agent_view = NodeSpec(
        name="a-gpu-1",
        cluster="cluster-a",
        zone="zone-a",
        gpu_type="A100",
        gpus=(GpuSpec("GPU-real-0", 0), GpuSpec("GPU-real-1", 1)),
    )
    store.nodes.register_nodes(t(2), "agent-a-gpu-1", [agent_view])


def test_an_agent_on_the_node_names_its_gpus_and_the_slots_step_aside(store: FleetStore) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("a-gpu-1", gpus=2)], complete=True)
    agent_names_its_gpus(store)
    assert present_gpus(store, "a-gpu-1") == ["GPU-real-0", "GPU-real-1"]
    assert events(store, "gpu-missing") == []  # slots are not GPUs that went missing
    # The cluster's next word on the node keeps the agent's GPUs and still cordons.
    store.clusters.sync_cluster_nodes(
        t(3), "cluster-a", [state("a-gpu-1", gpus=2, unschedulable=True)]
    )
    assert present_gpus(store, "a-gpu-1") == ["GPU-real-0", "GPU-real-1"]
    assert health(store)["a-gpu-1"] == (NodeHealth.ok, True)


def zones(store: FleetStore) -> dict[str, str]:
    with store.read() as session:
        return {n.name: n.zone.name for n in session.scalars(select(Node))}


def test_an_agent_that_names_no_zone_keeps_the_zone_its_cluster_gave_the_node(
    store: FleetStore,
) -> None:
    """A DaemonSet's agent cannot read its Node's zone label: what it reports without a
    zone must not move the node out of the zone the cluster's inventory placed it in."""
    store.clusters.sync_cluster_nodes(
        t(1), "cluster-a", [state("a-gpu-1", zone="zone-b", gpus=2)], complete=True
    )
    unplaced = NodeSpec(
        name="a-gpu-1", cluster="cluster-a", zone="", gpu_type="A100", gpus=(GpuSpec("G-0", 0),)
    )
    elsewhere = NodeSpec(
        name="lab-1", cluster="cluster-a", zone="", gpu_type="A100", gpus=(GpuSpec("G-1", 0),)
    )
    store.nodes.register_nodes(t(2), "agent-a-gpu-1", [unplaced, elsewhere])
    assert zones(store) == {"a-gpu-1": "zone-b", "lab-1": "default"}
    # An agent that names a zone still sets it (one machine's declared nodes).
    store.nodes.register_nodes(t(3), "agent-a-gpu-1", [replace(unplaced, zone="zone-c")])
    assert zones(store)["a-gpu-1"] == "zone-c"


def test_the_recovery_loops_cordon_holds_until_it_reaches_the_cluster(store: FleetStore) -> None:
    nodes = [state("a-gpu-1", gpus=2), state("a-gpu-2", gpus=2)]
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", nodes, complete=True)
    agent_names_its_gpus(store)
    store.jobs.act_on_xid(t(10), "GPU-real-0", 79)  # a node fault: the loop cordons it
    assert health(store)["a-gpu-1"] == (NodeHealth.ok, True)
    assert store.clusters.recovery_cordons(t(11)) == [("a-gpu-1", "cluster-a", t(10))]
    # The Node does not show it yet: its next update does not undo the loop's cordon.
    store.clusters.sync_cluster_nodes(t(12), "cluster-a", [state("a-gpu-1", gpus=2)])
    assert health(store)["a-gpu-1"] == (NodeHealth.ok, True)
    # Long after, a Node without it says someone uncordoned it in the cluster.
    assert store.clusters.recovery_cordons(t(71)) == []
    store.clusters.sync_cluster_nodes(t(71), "cluster-a", [state("a-gpu-1", gpus=2)])
    assert health(store)["a-gpu-1"] == (NodeHealth.ok, False)


def test_a_node_name_another_cluster_holds_is_left_to_its_owner(store: FleetStore) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("gpu-1")], complete=True)
    assert store.clusters.sync_cluster_nodes(t(2), "cluster-b", [state("gpu-1", "zone-c")]) == []
    assert present_gpus(store, "gpu-1") == [slot_uuid("cluster-a", "gpu-1", i) for i in range(4)]
    assert events(store, "node-name-conflict") == [
        "cluster cluster-b lists a node gpu-1, but a node of that name belongs to cluster-a; "
        "gpufleet ignores the second one (rename one of them)"
    ]


def test_the_sessions_of_a_lost_node_stop_and_keep_their_gpus_until_released(
    store: FleetStore,
) -> None:
    store.clusters.sync_cluster_nodes(t(1), "cluster-a", [state("a-gpu-1", gpus=2)], complete=True)
    alice = ask(store, t(2), "alice", gpus=2)
    cycle(store, t(3))
    assert workload(store, alice).state.value == "admitted"

    (stop,) = store.clusters.stop_sessions_on_node(
        t(4), "a-gpu-1", "of cluster cluster-a is not Ready"
    )
    assert (stop.workload_id, stop.user, stop.server_name) == (alice, "alice", "")
    stopping = workload(store, alice)
    assert stopping.state.value == "stopping"
    assert stopping.reason == "node a-gpu-1 of cluster cluster-a is not Ready"
    assert events(store, "node-lost-session") == [
        "node a-gpu-1 of cluster cluster-a is not Ready: the session ends; its GPUs are "
        "released once its pod is gone"
    ]
    # Still held: nobody else gets them while the pod may run.
    assert [closed for _, _, closed in allocations(store)] == [None, None]
    # Told once: a second call finds nothing more to stop.
    assert store.clusters.stop_sessions_on_node(t(5), "a-gpu-1", "is not Ready") == []


def test_the_controller_ends_the_sessions_of_a_node_lost_past_the_grace(store: FleetStore) -> None:
    import logging

    from gpufleet.clusters.kube_config import ClusterSettings
    from gpufleet.hub.kube_inventory import KubeInventory
    from gpufleet.state.cycle import Stop

    told: list[list[Stop]] = []
    clock = [t(0)]
    kube = KubeInventory(
        [ClusterSettings(name="cluster-a", in_cluster=True)],
        store,
        log=logging.getLogger("test"),
        now=lambda: clock[0],
        kick=lambda: None,
        node_lost_grace_seconds=30.0,
        stop_sessions=told.append,
    )
    view = kube.watches["cluster-a"].view
    view.relisted([state("a-gpu-1", gpus=2), state("a-gpu-2", gpus=2)])
    kube.flush()
    alice = ask(store, t(1), "alice", gpus=2)
    cycle(store, t(2))
    assert workload(store, alice).state.value == "admitted"
    with store.read() as session:
        (held,) = set(
            session.scalars(
                select(Node.name)
                .join(Allocation, Allocation.node_id == Node.id)
                .where(Allocation.workload_id == alice)
            )
        )

    view.seen(held, state(held, gpus=2, ready=False, why_not_ready="NodeStatusUnknown: gone"))
    kube.flush()
    kube.end_sessions_on_lost_nodes(now=kube.lost_since[held][0] + 29.0)
    assert told == []  # a kubelet that restarts comes back within the grace
    kube.end_sessions_on_lost_nodes(now=kube.lost_since[held][0] + 30.0)
    (stops,) = told
    assert [s.workload_id for s in stops] == [alice]
    assert workload(store, alice).reason == (
        f"node {held} of cluster cluster-a is not Ready (NodeStatusUnknown: gone)"
    )
    kube.end_sessions_on_lost_nodes(now=kube.lost_since[held][0] + 60.0)
    assert len(told) == 1  # once per loss


def test_a_deleted_node_ends_its_sessions_too_but_an_unreachable_cluster_does_not(
    store: FleetStore,
) -> None:
    import logging

    from gpufleet.clusters.kube_config import ClusterSettings
    from gpufleet.hub.kube_inventory import KubeInventory
    from gpufleet.state.cycle import Stop

    told: list[list[Stop]] = []
    kube = KubeInventory(
        [ClusterSettings(name="cluster-a", in_cluster=True)],
        store,
        log=logging.getLogger("test"),
        now=lambda: t(10),
        kick=lambda: None,
        node_lost_grace_seconds=30.0,
        stop_sessions=told.append,
    )
    watch = kube.watches["cluster-a"]
    watch.view.relisted([state("a-gpu-1", gpus=2)])
    kube.flush()
    alice = ask(store, t(1), "alice", gpus=2)
    cycle(store, t(2))

    # The API server stops answering: its nodes are unknown, but nobody's session ends.
    watch.reachability.reachable = False
    watch.view.reachability_changed = True
    watch.view.seen("a-gpu-1", None)
    kube.flush()
    kube.end_sessions_on_lost_nodes(now=10_000.0)
    assert told == [] and workload(store, alice).state.value == "admitted"

    watch.reachability.reachable = True
    watch.view.reachability_changed = True
    kube.flush()  # reachable again, and it lists the node as deleted
    since, why = kube.lost_since["a-gpu-1"]
    assert why == "was deleted from cluster cluster-a"
    kube.end_sessions_on_lost_nodes(now=since + 30.0)
    assert [s.workload_id for s in told[0]] == [alice]
    assert workload(store, alice).reason == "node a-gpu-1 was deleted from cluster cluster-a"
