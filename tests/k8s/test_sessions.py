"""Sessions on the two clusters, end to end: a real hub, proxy and controller with the
KubeGPUSpawner, the tier's API servers and kube-schedulers, and test kubelets that run
``jupyterhub-singleuser`` in the session sandbox. JupyterLab opens in Chromium through the
proxy; NVML in the kernel shows the GPUs the device plugin gave the pod; a full cluster
sends the next session to the other one; with both full, sessions queue and start by
themselves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, expect

from gpufleet.clusters.manifests import WORKLOAD_LABEL

from ..integration import browser as ui
from ..integration.harness import Hub, run_in_kernel, wait_for
from .control_plane import NAMESPACE, SPAWNER_RULES, ControlPlane
from .hubs import WITHOUT_AGENT, make_kube_hub
from .nodes import NodeSpec
from .partition import Partition
from .pki import KubeContext, write_kubeconfig
from .tier import CLUSTER_A, CLUSTER_B

pytestmark = [pytest.mark.k8s, pytest.mark.integration]


@pytest.fixture(scope="module")
def partition_b(k8s_tier: ControlPlane) -> Iterator[Partition]:
    """The controller's way to cluster-b's API server (the spawner's is direct)."""
    cut = Partition(k8s_tier[CLUSTER_B].ports["apiserver"])
    try:
        yield cut
    finally:
        cut.close()


@pytest.fixture(scope="module")
def kube_hub(
    k8s_tier: ControlPlane, partition_b: Partition, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hub]:
    """A hub whose sessions are pods on the tier's two clusters."""
    root = Path(tmp_path_factory.mktemp("kube-hub"))
    b = k8s_tier[CLUSTER_B]
    through = write_kubeconfig(
        root / "controller-b.kubeconfig",
        b.ca.cert_path,
        [KubeContext(CLUSTER_B, partition_b.address, b.identities["controller"])],
        current=CLUSTER_B,
    )
    controller = [
        {"name": CLUSTER_A, "kubeconfig": str(k8s_tier.kubeconfig), "context": CLUSTER_A},
        {"name": CLUSTER_B, "kubeconfig": str(through)},
    ]
    hub = make_kube_hub(k8s_tier, root, WITHOUT_AGENT, controller)
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()


@pytest.fixture
def kube_fleet(kube_hub: Hub) -> Iterator[Hub]:
    yield kube_hub
    kube_hub.stop_all_servers()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


def cluster_of(workload: dict[str, Any]) -> str:
    (cluster,) = {a["cluster"] for a in workload["allocations"]}
    return str(cluster)


def objects_of(plane: ControlPlane, cluster: str, workload_id: int, kind: str) -> list[Any]:
    """The session's pods (``kind`` "pods") or NetworkPolicies ("networkpolicies") as the
    cluster's API server has them."""
    group = "/api/v1" if kind == "pods" else "/apis/networking.k8s.io/v1"
    with plane[cluster].rest() as api:
        listed = api.get(
            f"{group}/namespaces/{NAMESPACE}/{kind}",
            params={"labelSelector": f"{WORKLOAD_LABEL}={workload_id}"},
        )
        listed.raise_for_status()
    return list(listed.json()["items"])


def left_behind(plane: ControlPlane, cluster: str, workload_id: int) -> list[Any]:
    return [
        *objects_of(plane, cluster, workload_id, "pods"),
        *objects_of(plane, cluster, workload_id, "networkpolicies"),
    ]


def pod_of(plane: ControlPlane, workload: dict[str, Any]) -> dict[str, Any]:
    """The session's pod as its cluster's API server has it."""
    pods = objects_of(plane, cluster_of(workload), workload["id"], "pods")
    assert len(pods) == 1, pods
    return dict(pods[0])


@pytest.mark.browser
@pytest.mark.smoke
def test_alice_opens_jupyterlab_in_a_pod_with_exactly_its_gpus(
    kube_fleet: Hub, k8s_tier: ControlPlane, chromium: Browser
) -> None:
    context: BrowserContext = ui.new_context(chromium, kube_fleet.url)
    try:
        page = ui.login(context, "alice")
        ui.open_spawn_form(page)
        ui.fill_spawn_form(page, project="vision", gpu_type="A100-80GB", gpus="2")
        ui.submit_spawn_form(page)
        ui.expect_jupyterlab(page, "alice")
    finally:
        context.close()

    workload = kube_fleet.workload_of("alice")
    assert workload is not None and workload["state"] == "running"
    pod = pod_of(k8s_tier, workload)
    node = workload["allocations"][0]["node"]
    assert pod["spec"]["nodeName"] == node  # kube-scheduler bound it where gpufleet chose
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"

    given = k8s_tier[cluster_of(workload)].kubelet(node).held_devices()[pod["metadata"]["uid"]]
    code = (
        "import json, pynvml\n"
        "pynvml.nvmlInit()\n"
        "n = pynvml.nvmlDeviceGetCount()\n"
        "print(json.dumps(sorted(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))"
        " for i in range(n))))\n"
    )
    seen = run_in_kernel(kube_fleet, "alice", "", code, kube_fleet.user_token("alice"))
    assert json.loads(seen) == sorted(given)
    assert len(given) == 2


def spawn_api(hub: Hub, user: str, server: str, project: str, gpus: int) -> None:
    response = hub.spawn(user, server, project=project, gpu_type="A100-80GB", gpus=gpus)
    assert response.status_code in (201, 202), response.text


def test_a_full_cluster_sends_sessions_to_the_other_then_they_queue_and_start_by_themselves(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    # 12 GPUs: cluster-a's two nodes and cluster-b's one, 4 each. Three 4-GPU sessions
    # take a node each, so both clusters are used whatever order the scheduler picks.
    for user, server, project in (
        ("alice", "", "vision"),
        ("carol", "", "nlp"),
        ("carol", "second", "nlp"),
    ):
        spawn_api(kube_fleet, user, server, project, 4)
    for user, server in (("alice", ""), ("carol", ""), ("carol", "second")):
        kube_fleet.wait_ready(user, server, timeout=180)
    running = [w for w in kube_fleet.workloads() if w["state"] == "running"]
    assert sorted(cluster_of(w) for w in running) == [CLUSTER_A, CLUSTER_A, CLUSTER_B]
    assert len({w["allocations"][0]["node"] for w in running}) == 3

    spawn_api(kube_fleet, "carol", "third", "nlp", 1)
    waiting = wait_for(
        lambda: (
            (w := kube_fleet.workload_of("carol", "third"))
            and w["state"] == "pending"
            and w["queue_position"] == 1
            and w
        ),
        30,
        "carol's third session queued",
    )
    assert "GPU" in waiting["reason"], waiting["reason"]
    assert kube_fleet.stop_server("carol", "second").status_code in (202, 204)
    kube_fleet.wait_ready("carol", "third", timeout=180)
    third = kube_fleet.workload_of("carol", "third")
    assert third is not None and third["state"] == "running"
    assert pod_of(k8s_tier, third)["status"]["phase"] == "Running"


def test_a_session_that_stops_leaves_no_pod_and_frees_its_gpus(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    spawn_api(kube_fleet, "bob", "", "vision", 1)
    kube_fleet.wait_ready("bob", "", timeout=180)
    workload = kube_fleet.workload_of("bob")
    assert workload is not None
    cluster = cluster_of(workload)
    assert kube_fleet.stop_server("bob").status_code in (202, 204)
    ended = kube_fleet.wait_ended(workload)
    assert ended["allocations"] == []
    # The GPUs were released only once the pod was gone: nothing of it remains.
    assert left_behind(k8s_tier, cluster, workload["id"]) == []


def test_a_pod_left_behind_by_an_ended_session_is_deleted_by_the_reconciler(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    spawn_api(kube_fleet, "bob", "", "vision", 1)
    kube_fleet.wait_ready("bob", "", timeout=180)
    workload = kube_fleet.workload_of("bob")
    assert workload is not None
    cluster = cluster_of(workload)
    pod = pod_of(k8s_tier, workload)
    assert kube_fleet.stop_server("bob").status_code in (202, 204)
    kube_fleet.wait_ended(workload)
    # The same pod again, as a hub restored from an old state (or a stale controller of
    # another deployment) would make it: it carries the ended session's marker.
    kept = {k: pod["metadata"][k] for k in ("name", "labels", "annotations")}
    again = {"apiVersion": "v1", "kind": "Pod", "metadata": kept, "spec": pod["spec"]}
    with k8s_tier[cluster].rest() as api:
        made = api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=again)
        assert made.status_code == 201, made.text
    wait_for(
        lambda: objects_of(k8s_tier, cluster, workload["id"], "pods") == [],
        60,
        "the left-behind pod deleted",
    )
    # The reconciler records the repair once its delete call has returned, which may be
    # after the pod is gone; once: a pod already being deleted is not deleted again.
    repairs = wait_for(
        lambda: [
            e
            for e in kube_fleet.controller(
                "GET", "/events", params={"workload_id": workload["id"]}
            ).json()["items"]
            if e["reason"] == "orphan-pods"
        ],
        30,
        "the reconciler's orphan-pods event",
    )
    (repair,) = repairs
    assert "still exists; deleting it" in repair["message"]
    # Its session stays ended, and nothing holds its GPUs.
    ended = kube_fleet.workload_of("bob")
    assert ended is None or ended["state"] == "ended"


def test_a_gpu_type_no_cluster_has_is_refused_with_what_to_fix(kube_fleet: Hub) -> None:
    response = kube_fleet.spawn("alice", "", project="vision", gpu_type="H100-80GB", gpus=1)
    assert response.status_code == 400
    assert "H100-80GB" in response.json()["message"]
    assert kube_fleet.workload_of("alice") is None
    with httpx.Client() as client:
        assert client.get(kube_fleet.url + "/hub/health").status_code == 200


def test_a_node_that_stops_answering_ends_its_session_but_keeps_its_gpus_until_the_pod_is_gone(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    spawn_api(kube_fleet, "bob", "", "vision", 1)
    kube_fleet.wait_ready("bob", "", timeout=180)
    workload = kube_fleet.workload_of("bob")
    assert workload is not None
    node, cluster = workload["allocations"][0]["node"], cluster_of(workload)
    kubelet = k8s_tier[cluster].kubelet(node)
    kubelet.pause()  # the node's kubelet hangs; its containers keep running
    try:
        stopping = wait_for(
            lambda: (w := kube_fleet.workload_of("bob")) and w["state"] == "stopping" and w,
            60,
            "bob's session stopping",
        )
        assert stopping["reason"].startswith(f"node {node} of cluster {cluster} is not Ready")
        events = kube_fleet.controller(
            "GET", "/events", params={"workload_id": workload["id"]}
        ).json()["items"]
        assert any(e["kind"] == "node-lost-session" and e["node"] == node for e in events), events
        # The hub deletes the pod after the session became stopping; it may still run on the
        # node: it is there, and its GPUs are still held.
        wait_for(
            lambda: pod_of(k8s_tier, workload)["metadata"].get("deletionTimestamp"),
            60,
            "bob's pod marked for deletion",
        )
        held = kube_fleet.workload_of("bob")
        assert held is not None and held["state"] == "stopping"
        assert [a["uuid"] for a in held["allocations"]] == [
            a["uuid"] for a in workload["allocations"]
        ]
    finally:
        kubelet.resume()
    ended = kube_fleet.wait_ended(workload, timeout=120)
    assert ended["allocations"] == []
    kube_fleet.wait_gone("bob", timeout=60)


def set_spawner_rules(plane: ControlPlane, cluster: str, rules: list[dict[str, Any]]) -> None:
    path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/gpufleet-spawner"
    with plane[cluster].rest() as api:
        role = api.get(path).json()
        role["rules"] = rules
        api.put(path, json=role).raise_for_status()


def test_rbac_that_forbids_creating_pods_fails_the_spawn_naming_the_cluster(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    # cluster-b's Role lets gpufleet's spawner read, not create; cluster-a is cordoned
    # (through gpufleet, so in Kubernetes too), so the scheduler places on cluster-b.
    read_only = [
        {**rule, "verbs": [v for v in rule["verbs"] if v != "create"]} for rule in SPAWNER_RULES
    ]
    set_spawner_rules(k8s_tier, CLUSTER_B, read_only)
    a_nodes = sorted(k8s_tier[CLUSTER_A].nodes)
    try:
        for node in a_nodes:
            kube_fleet.controller("POST", f"/nodes/{node}/cordon").raise_for_status()
            with k8s_tier[CLUSTER_A].rest() as api:  # one truth: cordoned in Kubernetes too
                assert api.get(f"/api/v1/nodes/{node}").json()["spec"]["unschedulable"]
        response = kube_fleet.spawn("alice", "", project="vision", gpu_type="A100-80GB", gpus=1)
        # A start that fails within the hub's slow-spawn timeout answers at once; a slower
        # one answers 202 and fails afterwards: the message is the workload's either way.
        if response.status_code != 202:
            assert response.status_code == 503, response.text
            assert "cluster cluster-b does not let gpufleet's spawner" in response.text
        workload = wait_for(
            lambda: next(
                (w for w in kube_fleet.workloads(username="alice") if w["state"] == "ended"),
                None,
            ),
            120,
            "alice's spawn failed and her request ended",
        )
        assert workload["outcome"] == "failed"
        assert "cluster cluster-b does not let gpufleet's spawner create" in workload["reason"]
        assert "403 Forbidden" in workload["reason"]
        assert workload["allocations"] == []
        assert left_behind(k8s_tier, CLUSTER_B, workload["id"]) == []
    finally:
        set_spawner_rules(k8s_tier, CLUSTER_B, SPAWNER_RULES)
        for node in a_nodes:
            kube_fleet.controller("POST", f"/nodes/{node}/uncordon").raise_for_status()


@pytest.mark.browser
def test_a_cluster_cut_off_from_the_controller_is_on_the_admin_panel_and_takes_no_work(
    kube_fleet: Hub, partition_b: Partition, chromium: Browser
) -> None:
    def health_of(node: str) -> str:
        nodes = kube_fleet.controller("GET", "/nodes").json()["items"]
        return str(next(n["health"] for n in nodes if n["name"] == node))

    partition_b.cut()
    try:
        wait_for(lambda: health_of("b-gpu-1") == "unknown", 30, "cluster-b's node unknown")
        # (an earlier test may have paused a-gpu-1's kubelet: it answers again by now)
        wait_for(lambda: health_of("a-gpu-1") == "ok", 30, "cluster-a's node healthy")
        context = ui.new_context(chromium, kube_fleet.url)
        try:
            page = ui.login(context, "admin")
            page.goto("/services/gpufleet/admin")
            warning = page.locator("div[data-cluster='cluster-b']")
            expect(warning).to_contain_text("Cluster cluster-b's API server does not answer")
            expect(warning).to_contain_text("Its nodes receive no new work until it does")
        finally:
            context.close()
    finally:
        partition_b.heal()
    wait_for(lambda: health_of("b-gpu-1") == "ok", 60, "cluster-b's node back")


def test_a_node_deleted_while_its_session_runs_ends_the_session_naming_the_node(
    kube_fleet: Hub, k8s_tier: ControlPlane
) -> None:
    # A node of its own for the session: cluster-a's nodes are cordoned (through gpufleet)
    # and cluster-b gets a new one beside b-gpu-1, which carol fills.
    b = k8s_tier[CLUSTER_B]
    name = b.spare_node_name()
    a_nodes = sorted(k8s_tier[CLUSTER_A].nodes)
    for node in a_nodes:
        kube_fleet.controller("POST", f"/nodes/{node}/cordon").raise_for_status()
    try:
        spawn_api(kube_fleet, "carol", "", "nlp", 4)
        kube_fleet.wait_ready("carol", "", timeout=180)
        b.add_node(NodeSpec(name, "zone-c", gpus=4))
        wait_for(
            lambda: any(
                n["name"] == name for n in kube_fleet.controller("GET", "/nodes").json()["items"]
            ),
            30,
            "the new node in gpufleet's inventory",
        )
        spawn_api(kube_fleet, "bob", "", "vision", 2)
        kube_fleet.wait_ready("bob", "", timeout=180)
        workload = kube_fleet.workload_of("bob")
        assert workload is not None and workload["allocations"][0]["node"] == name
        with b.rest() as api:
            api.delete(f"/api/v1/nodes/{name}").raise_for_status()
        ended = kube_fleet.wait_ended(workload, timeout=120)
        assert ended["allocations"] == []
        events = kube_fleet.controller(
            "GET", "/events", params={"workload_id": workload["id"]}
        ).json()["items"]
        lost = [e for e in events if e["kind"] == "node-lost-session"]
        assert lost and lost[0]["node"] == name, events
        assert f"node {name}" in lost[0]["message"] and "deleted" in lost[0]["message"]
        # Released only once the pod was gone (pod garbage collection deletes it).
        assert left_behind(k8s_tier, CLUSTER_B, workload["id"]) == []
        kube_fleet.wait_gone("bob", timeout=60)
    finally:
        for node in a_nodes:
            kube_fleet.controller("POST", f"/nodes/{node}/uncordon").raise_for_status()
        b.remove_node(name)
