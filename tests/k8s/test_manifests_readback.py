"""What the API server keeps of gpufleet's manifests: the 1.20 test server silently drops
fields it does not know, so every object the KubeGPUSpawner builds is created as the
spawner's identity, and every object of a job's gang as the controller's, read back and
compared with what was sent."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config

from gpufleet.clusters.job_manifests import (
    JobGang,
    gang_config_map,
    gang_network_policy,
    gang_pod,
    gang_service,
    jobs_network_policy,
    launcher_config_map,
)
from gpufleet.clusters.manifest_readback import dropped_fields
from gpufleet.clusters.manifests import (
    Endpoint,
    Peer,
    Volume,
    priority_class,
    session_pod,
)
from gpufleet.spawner.kubernetes import KubeGPUSpawner

from .control_plane import NAMESPACE, Cluster
from .kube import eventually

pytestmark = pytest.mark.k8s


@pytest.fixture
def spawner(cluster_a: Cluster) -> KubeGPUSpawner:
    """A spawner placed on two GPUs of a-gpu-1, as a real start would be."""
    c = Config()
    c.FleetController.clusters = [
        {"name": cluster_a.name, "kubeconfig": str(cluster_a.kubeconfig("spawner", NAMESPACE))}
    ]
    user = SimpleNamespace(name="readback", id=11, url="/user/readback/")
    hub = SimpleNamespace(
        api_url="http://127.0.0.1:8081/hub/api", url="/hub/", public_host="", base_url="/"
    )
    made = KubeGPUSpawner(config=c, user=user, hub=hub)
    made.load_state(
        {
            "gpufleet_workload_id": 9001,
            "gpufleet_gpu_uuids": ["slot-0", "slot-1"],
            "gpufleet_node": "a-gpu-1",
            "gpufleet_marker": "readback-marker",
            "gpufleet_cluster": cluster_a.name,
            "namespace": NAMESPACE,
        }
    )
    made.controller_api_url = "http://127.0.0.1:8003/services/gpufleet/api/v1"
    made.user_options = {"project": "vision", "gpu_type": "A100-80GB", "gpus": 2}
    made._uid, made._gid = 200_011, 200_011
    return made


@pytest.fixture
def created(cluster_a: Cluster) -> Iterator[list[tuple[str, str]]]:
    """What a test created (collection path, name), deleted afterwards as the admin."""
    made: list[tuple[str, str]] = []
    yield made
    with cluster_a.rest() as api:
        for collection, name in made:
            api.delete(f"{collection}/{name}", params={"gracePeriodSeconds": 0})


def create_and_read_back(
    cluster: Cluster, identity: str, collection: str, body: dict[str, Any]
) -> dict[str, Any]:
    with cluster.rest(identity) as api:
        answer = api.post(collection, json=body)
        assert answer.status_code == 201, answer.text
        name = body["metadata"]["name"]
        stored = api.get(f"{collection}/{name}")
        stored.raise_for_status()
        return dict(stored.json())


async def test_every_field_of_the_session_pod_and_its_policy_is_kept(
    cluster_a: Cluster, spawner: KubeGPUSpawner, created: list[tuple[str, str]]
) -> None:
    classes = "/apis/scheduling.k8s.io/v1/priorityclasses"
    checked = priority_class("gpufleet-readback", 1000, "read back by the tests")
    created.append((classes, "gpufleet-readback"))
    assert dropped_fields(checked, create_and_read_back(cluster_a, "admin", classes, checked)) == []
    with cluster_a.rest() as api:  # the session's own, which the pod names (kept: shared)
        made = api.post(classes, json=priority_class("gpufleet-session", 1000, "sessions"))
        assert made.status_code in (201, 409), made.text

    policies = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"
    policy = spawner.network_policy()
    created.append((policies, policy["metadata"]["name"]))
    assert (
        dropped_fields(policy, create_and_read_back(cluster_a, "spawner", policies, policy)) == []
    )

    pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
    pod = session_pod(spawner.session_pod())
    created.append((pods, pod["metadata"]["name"]))
    assert dropped_fields(pod, create_and_read_back(cluster_a, "spawner", pods, pod)) == []

    # And kube-scheduler honours the required node affinity: the pod lands on a-gpu-1.
    async def bound() -> str | None:
        with cluster_a.rest() as api:
            got = api.get(f"{pods}/{pod['metadata']['name']}").json()
        return got["spec"].get("nodeName")

    assert await eventually(bound, "the session pod bound", 30.0) == "a-gpu-1"


def test_every_field_of_a_job_gangs_objects_is_kept(
    cluster_a: Cluster, created: list[tuple[str, str]]
) -> None:
    """As the controller's identity, which makes them (its namespaced grants)."""
    gang = JobGang(
        workload_id=9002,
        attempt=1,
        job_name="readback",
        user="readback@example.org",
        project="vision",
        marker="readback-job",
        cluster=cluster_a.name,
        namespace=NAMESPACE,
        nodes=("a-gpu-1", "a-gpu-1"),
        image="gpufleet/session:test",
        python="/usr/bin/python3",
        script_name="train.py",
        script="print('read back')\n",
        env={"A": "$literal"},
        uid=200_012,
        gid=200_012,
        gpus_per_pod=1,
        memory_limit="1Gi",
        progress_url="http://$(GPUFLEET_HOST_IP):9207/progress",
        volumes=(Volume("shm", "/dev/shm", "emptyDir", medium="Memory"),),
    )
    with cluster_a.rest() as api:  # the class job pods name (kept: shared)
        made = api.post(
            "/apis/scheduling.k8s.io/v1/priorityclasses",
            json=priority_class("gpufleet-job", 500, "training jobs"),
        )
        assert made.status_code in (201, 409), made.text
    core = f"/api/v1/namespaces/{NAMESPACE}"
    policies = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"
    alone = replace(gang, workload_id=9003, nodes=("a-gpu-1",))  # one pod: its script inline
    # The namespace's own two under other names: the tier's hubs use theirs.
    launcher = launcher_config_map(NAMESPACE)
    jobs_policy = jobs_network_policy(
        NAMESPACE,
        hub=Endpoint(Peer(cidr="127.0.0.1/32"), (8081,)),
        controller=Endpoint(Peer(cidr="127.0.0.1/32"), (8003,)),
    )
    for shared in (launcher, jobs_policy):
        shared["metadata"]["name"] += "-readback"
    objects = [
        (f"{core}/configmaps", launcher),
        (policies, jobs_policy),
        (f"{core}/configmaps", gang_config_map(gang)),
        (f"{core}/services", gang_service(gang)),
        (policies, gang_network_policy(gang)),
        (f"{core}/pods", gang_pod(gang, 0)),
        (f"{core}/pods", gang_pod(gang, 1)),
        (f"{core}/pods", gang_pod(alone, 0)),
    ]
    for collection, body in objects:
        created.append((collection, body["metadata"]["name"]))
        stored = create_and_read_back(cluster_a, "controller", collection, body)
        assert dropped_fields(body, stored) == [], body["kind"]
