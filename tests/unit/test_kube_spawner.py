"""What KubeGPUSpawner asks of a cluster for a placement: the pod (the scheduler's node and
cluster, the GPU count, the researcher's uid, the pod IP binding), its NetworkPolicy, and a
clear refusal for a cluster the hub does not know."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tornado import web
from traitlets.config import Config

from gpufleet.clusters.manifests import WORKLOAD_LABEL
from gpufleet.spawner.kubernetes import KubeGPUSpawner

from .netpol import Remote, policy_allows

HUB_API = "http://10.0.0.5:8081/hub/api"
CONTROLLER_API = "http://10.0.0.6:8003/services/gpufleet/api/v1"


def placed_spawner(network: dict[str, Any] | None = None, **config: Any) -> KubeGPUSpawner:
    """A spawner whose request the scheduler placed on 2 GPUs of a-gpu-1 in cluster-a
    (whose own NetworkPolicy peers are ``network``)."""
    c = Config()
    c.FleetController.clusters = [
        {"name": "cluster-a", "in_cluster": True, "namespace": "sessions"}
        | ({"network": network} if network else {}),
        {"name": "cluster-b", "in_cluster": True, "gpu_resource": "nvidia.com/mig-3g.40gb"},
    ]
    for key, value in config.items():
        setattr(c.KubeGPUSpawner, key, value)
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(api_url=HUB_API, url="/hub/", public_host="", base_url="/")
    spawner = KubeGPUSpawner(config=c, user=user, hub=hub)
    spawner.load_state(
        {
            "gpufleet_workload_id": 42,
            "gpufleet_gpu_uuids": ["k8s/cluster-a/a-gpu-1/0", "k8s/cluster-a/a-gpu-1/1"],
            "gpufleet_node": "a-gpu-1",
            "gpufleet_marker": "marker-1",
            "gpufleet_cluster": "cluster-a",
            "namespace": "sessions",
        }
    )
    spawner.controller_api_url = CONTROLLER_API
    spawner.user_options = {"project": "vision", "gpu_type": "A100-80GB", "gpus": 2}
    spawner._uid, spawner._gid = 200_001, 200_001
    return spawner


def test_the_pod_goes_where_the_scheduler_placed_it_as_the_researcher() -> None:
    pod = placed_spawner().session_pod()
    assert (pod.cluster, pod.namespace, pod.node, pod.gpus) == (
        "cluster-a",
        "sessions",
        "a-gpu-1",
        2,
    )
    assert (pod.uid, pod.gid, pod.workload_id, pod.marker, pod.project) == (
        200_001,
        200_001,
        42,
        "marker-1",
        "vision",
    )
    assert pod.command == ("jupyterhub-singleuser",)
    assert pod.args[:2] == ("--ip=$(GPUFLEET_POD_IP)", "--port=8888")
    # KubeSpawner's pod reflector finds its pods by this label.
    assert pod.extra_labels == {"component": "singleuser-server"}
    assert pod.env["GPUFLEET_CLUSTER"] == "cluster-a"
    assert pod.env["JUPYTERHUB_USER"] == "alice"


def test_the_device_plugin_not_the_spawner_names_the_gpus_in_the_pod() -> None:
    spawner = placed_spawner(environment={"NVIDIA_VISIBLE_DEVICES": "all", "TEAM": "cv"})
    env = spawner.session_pod().env
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert env["TEAM"] == "cv"


def test_volumes_are_the_servers_own() -> None:
    spawner = placed_spawner(
        session_volumes=[
            {
                "name": "home",
                "mount_path": "/home/jovyan",
                "kind": "pvc",
                "source": "home-{username}",
            }
        ]
    )
    (volume,) = spawner.session_pod().volumes
    assert (volume.kind, volume.source, volume.mount_path) == ("pvc", "home-alice", "/home/jovyan")


def test_the_policy_lets_the_session_reach_the_hub_and_the_controller_only() -> None:
    spawner = placed_spawner()
    policy = spawner.network_policy()
    labels = {WORKLOAD_LABEL: "42"}

    def egress(ip: str, port: int) -> bool:
        return policy_allows(
            [policy],
            namespace="sessions",
            pod_labels=labels,
            direction="egress",
            remote=Remote(ip=ip),
            port=port,
        )

    assert egress("10.0.0.5", 8081) and egress("10.0.0.6", 8003)
    assert not egress("10.0.0.5", 8003) and not egress("169.254.169.254", 80)
    assert policy_allows(
        [policy],
        namespace="sessions",
        pod_labels=labels,
        direction="ingress",
        remote=Remote(ip="10.0.0.5"),
        port=8888,
    )


def test_a_cluster_s_own_peers_win_over_the_options_for_its_sessions() -> None:
    """The hub runs in another cluster: this one's sessions reach it through an internal
    load balancer's address, which only this cluster's configuration knows."""
    spawner = placed_spawner(
        network={
            "hub": {"cidr": "10.20.0.10/32", "ports": [443]},
            "controller": {"cidr": "10.20.0.11/32", "ports": [443]},
            "proxy": {"cidr": "10.20.0.12/32"},
        },
        network_hub={"cidr": "10.0.0.0/8"},
    )
    policy = spawner.network_policy()

    def allows(direction: str, ip: str, port: int) -> bool:
        return policy_allows(
            [policy],
            namespace="sessions",
            pod_labels={WORKLOAD_LABEL: "42"},
            direction=direction,
            remote=Remote(ip=ip),
            port=port,
        )

    assert allows("egress", "10.20.0.10", 443) and allows("egress", "10.20.0.11", 443)
    assert not allows("egress", "10.0.0.5", 8081)  # neither the option's peer nor the URL's
    assert allows("ingress", "10.20.0.12", 8888) and not allows("ingress", "10.0.0.5", 8888)


def test_a_placement_on_a_cluster_the_hub_does_not_know_says_what_to_fix() -> None:
    spawner = placed_spawner()
    with pytest.raises(web.HTTPError) as caught:
        spawner.cluster_settings("cluster-c")
    assert "cluster 'cluster-c', which is not in c.FleetController.clusters of the hub" in str(
        caught.value.log_message
    )
