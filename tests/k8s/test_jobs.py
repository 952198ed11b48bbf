"""Training jobs on the tier's two clusters, end to end: the SDK submits to the real
controller, the scheduler places the gang in one cluster and zone, the cluster manager
creates its pods, Service, ConfigMap and NetworkPolicy, and the test kubelets run each pod's
launcher and torchrun (CPU PyTorch, gloo) in the session sandbox."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.client import Client
from gpufleet.clusters.manifests import priority_class
from gpufleet.snapshotter.sandbox import default_session_env

from ..integration.harness import Hub, wait_for
from ..ports import free_port_block
from .control_plane import NAMESPACE, ControlPlane
from .hubs import WITHOUT_AGENT, make_kube_hub
from .tier import CLUSTER_A, CLUSTER_B

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

RENDEZVOUS_PORTS = 20

JOBS_CONFIG = """
c.KubeJobs.image = "gpufleet/session:test"  # the test kubelets run the base env
c.KubeJobs.interval = 0.5
c.KubeJobs.rendezvous_ports = ({first}, {last})
c.KubeJobs.rendezvous_timeout_seconds = 120
"""

ALL_REDUCE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank}/{world} pod {os.environ['GPUFLEET_POD_INDEX']} sum {total.item():.0f} "
          f"gpus {os.environ.get('NVIDIA_VISIBLE_DEVICES')}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def jobs_hub(k8s_tier: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """A hub whose training jobs run as pods on the tier's clusters."""
    for cluster in k8s_tier.clusters.values():
        with cluster.rest() as api:
            made = api.post(
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                json=priority_class("gpufleet-job", 500, "gpufleet training jobs"),
            )
            assert made.status_code in (201, 409), made.text
    first = free_port_block(RENDEZVOUS_PORTS)
    config = WITHOUT_AGENT + JOBS_CONFIG.format(first=first, last=first + RENDEZVOUS_PORTS - 1)
    hub = make_kube_hub(k8s_tier, Path(tmp_path_factory.mktemp("kube-jobs")), config)
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()


@pytest.fixture
def alice(jobs_hub: Hub) -> Iterator[Client]:
    with Client(jobs_hub.controller_api, jobs_hub.user_token("alice")) as client:
        yield client


def job_pods(plane: ControlPlane, cluster: str, job_id: int) -> list[dict[str, Any]]:
    with plane[cluster].rest() as api:
        listed: httpx.Response = api.get(
            f"/api/v1/namespaces/{NAMESPACE}/pods",
            params={"labelSelector": f"gpufleet.io/workload={job_id}"},
        )
        listed.raise_for_status()
        return list(listed.json()["items"])


def pod_output(plane: ControlPlane, pod: str) -> str:
    """What the pod's container wrote, from whichever test kubelet ran it."""
    for cluster in plane.clusters.values():
        for kubelet in cluster.kubelets.values():
            try:
                return kubelet.logs(NAMESPACE, pod, "torchrun")
            except FileNotFoundError:
                continue
    raise AssertionError(f"no kubelet ran pod {pod}")


def submit(client: Client, script: str, **options: object) -> int:
    python = str(Path(default_session_env()) / "bin" / "python")
    defaults: dict[str, object] = {
        "gpus": 4,
        "gpus_per_pod": 2,
        "gpu_type": "A100-80GB",
        "project": "vision",
        "python": python,
    }
    return client.submit(script, **{**defaults, **options}).id


def test_a_two_pod_job_all_reduces_across_its_pods_in_one_cluster_and_zone(
    k8s_tier: ControlPlane, jobs_hub: Hub, alice: Client
) -> None:
    job_id = submit(alice, ALL_REDUCE, name="allreduce")
    job = alice.wait(job_id, timeout=180)
    assert (job.state, job.outcome) == ("ended", "succeeded"), job.reason
    assert job.reason == "all 4 rank(s) exited with code 0"
    kinds = [e.kind for e in alice.events(workload_id=job_id)]
    assert {"admitted", "started", "job-pod-ended", "ended"} <= set(kinds)
    # Both pods ran in one cluster; the kubelets kept what each rank printed.
    clusters = {c for c in (CLUSTER_A, CLUSTER_B) if job_pods(k8s_tier, c, job_id)}
    assert len(clusters) <= 1  # the manager may have cleaned them up already
    outputs = "".join(pod_output(k8s_tier, f"gf-job-{job_id}-a1-{i}") for i in range(2))
    for rank in range(4):
        assert f"rank {rank}/4 pod {rank // 2} sum 10 " in outputs
    # Every object of the gang goes once the job has ended.
    wait_for(
        lambda: not any(job_pods(k8s_tier, c, job_id) for c in (CLUSTER_A, CLUSTER_B)),
        timeout=30,
        what="the job's pods deleted after it ended",
    )
    assert not job.allocations
