"""Training jobs on the tier's two clusters, end to end: the SDK submits to the real
controller, the scheduler places the gang in one cluster and zone, the cluster manager
creates its pods (and, for a gang of several, its Service and NetworkPolicy), and the test
kubelets run each pod's launcher and torchrun (CPU PyTorch, gloo) in the session
sandbox."""

from __future__ import annotations

import contextlib
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
from ..integration.test_checkpoint_s3 import PROBES
from ..ports import free_port, free_port_block
from ..s3server import CHECKPOINT_BUCKET, CHECKPOINT_USERS, S3Server, checkpoint_credentials
from .control_plane import NAMESPACE, ControlPlane
from .hubs import make_kube_hub
from .nodes import NodeSpec
from .tier import CLUSTER_A, CLUSTER_B

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

RENDEZVOUS_PORTS = 20

JOBS_CONFIG = """
c.KubeJobs.image = "gpufleet/session:test"  # the test kubelets run the base env
c.KubeJobs.interval = 0.5
c.KubeJobs.rendezvous_ports = ({first}, {last})
c.KubeJobs.rendezvous_timeout_seconds = 120
c.KubeJobs.memory_limit = "3Gi"
c.KubeJobs.start_deadline_seconds = 60
c.KubeJobs.progress_url = "http://$(GPUFLEET_HOST_IP):{progress_port}/progress"
c.FleetController.job_hang_floor_seconds = 8  # a stepping job of these tests steps at 5 Hz
# One node agent plays the DaemonSet: it relays the output and progress of every tier
# node's job pods (the tier's pods share this machine's network, as a hostNetwork agent's).
c.NodeAgent.declared_nodes = []
c.NodeAgent.nvml = "off"
c.NodeAgent.placement_interval = 0
c.NodeAgent.operation_nodes = {nodes!r}
c.NodeAgent.pod_log_dirs = {log_dirs!r}
c.NodeAgent.progress_port = {progress_port}
# vision may use the whole tier (three nodes of 4 GPUs), so placement, not quota, decides.
for project in c.FleetController.projects:
    if project["name"] == "vision":
        project["quotas"] = {{"A100-80GB": {{"guaranteed": 12, "borrow_limit": 0}}}}
        project["per_user_gpu_cap"] = 12
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
    print(f"rank {rank} done", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    """
)


def jobs_config(plane: ControlPlane) -> str:
    """JOBS_CONFIG for the tier, whose clusters now have the jobs' priority class."""
    for cluster in plane.clusters.values():
        with cluster.rest() as api:
            made = api.post(
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                json=priority_class("gpufleet-job", 500, "gpufleet training jobs"),
            )
            assert made.status_code in (201, 409), made.text
    first = free_port_block(RENDEZVOUS_PORTS)
    kubelets = [k for c in plane.clusters.values() for k in c.kubelets.values()]
    return JOBS_CONFIG.format(
        first=first,
        last=first + RENDEZVOUS_PORTS - 1,
        nodes=sorted(k.name for k in kubelets),
        # The tier's kubelets keep their containers' output each in a directory of its own.
        log_dirs=sorted(str(k.directory / "logs") for k in kubelets),
        progress_port=free_port(),
    )


@contextlib.contextmanager
def running_jobs_hub(plane: ControlPlane, root: Path, extra_config: str = "") -> Iterator[Hub]:
    """A started hub whose training jobs run as pods on the tier's clusters."""
    hub = make_kube_hub(plane, root, jobs_config(plane) + extra_config)
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()


# Jobs whose checkpoints are in S3 (the real SeaweedFS) read their user's own keys from
# this Secret of the jobs' namespace (test_a_pod_reaches_its_user_s_checkpoints_in_s3...).
CHECKPOINT_SECRET = "gpufleet-checkpoint-keys"


@pytest.fixture(scope="module")
def jobs_hub(
    k8s_tier: ControlPlane, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
) -> Iterator[Hub]:
    s3 = f"""
c.KubeJobs.checkpoint_credentials_secret = {CHECKPOINT_SECRET!r}
c.KubeJobs.checkpoint_s3_endpoint = {s3_server.endpoint_url!r}
"""
    with running_jobs_hub(k8s_tier, Path(tmp_path_factory.mktemp("kube-jobs")), s3) as hub:
        yield hub


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


def shared_objects(plane: ControlPlane, cluster: str, job_id: int) -> list[str]:
    """The job's Services, ConfigMaps and NetworkPolicies in the cluster, as kind/name."""
    found = []
    with plane[cluster].rest() as api:
        for collection in (
            f"/api/v1/namespaces/{NAMESPACE}/services",
            f"/api/v1/namespaces/{NAMESPACE}/configmaps",
            f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies",
        ):
            listed = api.get(collection, params={"labelSelector": f"gpufleet.io/workload={job_id}"})
            listed.raise_for_status()
            found += [
                f"{collection.rsplit('/', 1)[1]}/{o['metadata']['name']}"
                for o in listed.json()["items"]
            ]
    return sorted(found)


def pod_output(plane: ControlPlane, pod: str) -> str:
    """What the pod's container wrote, from whichever test kubelet ran it ("" while none
    has)."""
    for cluster in plane.clusters.values():
        for kubelet in cluster.kubelets.values():
            try:
                return kubelet.logs(NAMESPACE, pod, "torchrun")
            except FileNotFoundError:
                continue
    return ""


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
    # Both pods in one cluster and one zone.
    where = {
        n["name"]: (n["cluster"], n["zone"])
        for n in jobs_hub.controller("GET", "/nodes").json()["items"]
    }
    assert len({where[p.node] for p in job.pod_states}) == 1, job.pod_states
    assert [p.cluster for p in job.pod_states] == [where[job.pod_states[0].node][0]] * 2
    # Each rank's output, through the controller, as the node agent relayed it.
    for rank in range(4):
        output = "".join(alice.logs(job_id, rank=rank))
        assert output.startswith(f"rank {rank}/4 pod {rank // 2} sum 10 "), output
        assert "".join(alice.logs(job_id, rank=rank, stream="stderr")) == f"rank {rank} done\n"
    # Each pod's ranks see exactly their pod's two GPUs, as its device plugin gave them.
    seen = [
        "".join(alice.logs(job_id, rank=rank)).split("gpus ")[1].split()[0] for rank in range(4)
    ]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2], seen
    assert all(len(value.split(",")) == 2 for value in seen), seen
    assert not set(seen[0].split(",")) & set(seen[2].split(","))
    # torchrun's own output: pod 1's launcher waited for the master's port.
    assert "the master pod p0.gf-job-" in "".join(alice.logs(job_id, rank=-2))
    # Every object of the gang goes once the job has ended.
    wait_for(
        lambda: (
            not any(
                job_pods(k8s_tier, c, job_id) or shared_objects(k8s_tier, c, job_id)
                for c in (CLUSTER_A, CLUSTER_B)
            )
        ),
        timeout=30,
        what="the job's pods, Service and NetworkPolicy deleted after it ended",
    )
    assert not job.allocations


ALL_REDUCE_THEN_WAIT = ALL_REDUCE.replace(
    "dist.destroy_process_group()", "import time; time.sleep(3600)"
)


def test_a_job_of_one_pod_is_that_pod_alone_and_its_ranks_rendezvous_by_themselves(
    k8s_tier: ControlPlane, alice: Client
) -> None:
    job_id = submit(alice, ALL_REDUCE_THEN_WAIT, name="alone", gpus=2, gpus_per_pod=2)
    for rank in range(2):
        wait_for(
            lambda rank=rank: "".join(alice.logs(job_id, rank=rank)).startswith(
                f"rank {rank}/2 pod 0 sum 3 "
            ),
            timeout=120,
            what=f"rank {rank} past its all-reduce",
        )
    [cluster] = [c for c in (CLUSTER_A, CLUSTER_B) if job_pods(k8s_tier, c, job_id)]
    assert [p["metadata"]["name"] for p in job_pods(k8s_tier, cluster, job_id)] == [
        f"gf-job-{job_id}-a1-0"
    ]
    assert shared_objects(k8s_tier, cluster, job_id) == []  # no Service, policy or ConfigMap
    # What every job pod of the namespace shares: the launcher, and the jobs' policy.
    shared = {"labelSelector": "app.kubernetes.io/component=job-shared"}
    with k8s_tier[cluster].rest() as api:
        launchers = api.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps", params=shared)
        assert [c["metadata"]["name"][:16] for c in launchers.json()["items"]] == [
            "gf-job-launcher-"
        ]
        policies = api.get(
            f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies", params=shared
        )
        assert [p["metadata"]["name"][:8] for p in policies.json()["items"]] == ["gf-jobs-"]
    alice.cancel(job_id)
    assert alice.wait(job_id, timeout=90).outcome == "cancelled"


OUT_OF_MEMORY = textwrap.dedent(
    """
    import os
    if os.environ["RANK"] == "1":
        hog = bytearray(6 << 30)  # past the pod's 3Gi: the kernel kills the rank
        for i in range(0, len(hog), 4096):
            hog[i] = 1
    import time
    time.sleep(60)
    """
)


def test_a_pod_reaches_its_user_s_checkpoints_in_s3_with_the_user_s_own_keys_alone(
    k8s_tier: ControlPlane, alice: Client, s3_server: S3Server
) -> None:
    keys = {
        f"{user}.{part}": value
        for user in CHECKPOINT_USERS
        for part, value in checkpoint_credentials(user).items()
    }
    for cluster in k8s_tier.clusters.values():
        with cluster.rest() as api:
            made = api.post(
                f"/api/v1/namespaces/{NAMESPACE}/secrets",
                json={"metadata": {"name": CHECKPOINT_SECRET}, "stringData": keys},
            )
            assert made.status_code in (201, 409), made.text
    admin = s3_server.client()
    s3_server.checkpoint_bucket()
    admin.put_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/bob/train/step-9", Body=b"bob's")
    uri = f"s3://{CHECKPOINT_BUCKET}/jobs/alice/probe"
    job_id = submit(alice, PROBES, gpus=1, gpus_per_pod=1, name="probe", checkpoint_uri=uri)
    job = alice.wait(job_id, timeout=180)
    output = "".join(alice.logs(job_id, rank=0))
    assert job.outcome == "succeeded", (job.reason, output[-2000:])
    assert "own checkpoint written: b'my weights'" in output
    for probe in ("read bob's", "list bob's", "list the bucket", "overwrite bob's"):
        assert f"{probe} denied: AccessDenied" in output, output
    written = admin.get_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/alice/probe/step-1")
    assert written["Body"].read() == b"my weights"
    assert admin.get_object(Bucket=CHECKPOINT_BUCKET, Key="jobs/bob/train/step-9")[
        "Body"
    ].read() == (b"bob's")
    # Alice's own keys reached the pod (from the Secret: test_job_manifests.py shows the
    # manifest names only the Secret's keys), and nothing of bob's.
    assert checkpoint_credentials("bob")["access_key"] not in output


def test_a_pod_out_of_memory_is_the_users_error_and_not_retried(alice: Client) -> None:
    job_id = submit(alice, OUT_OF_MEMORY, name="hog", gpus=2, gpus_per_pod=2)
    job = alice.wait(job_id, timeout=120)
    assert (job.outcome, job.attempt) == ("failed", 1), job.reason
    assert "OOMKilled" in job.reason and "not retried" in job.reason, job.reason
    assert not job.allocations


SIGTERM_CHECKPOINT = textwrap.dedent(
    """
    import os, signal, sys, time

    def checkpoint(signum, frame):
        print(f"rank {os.environ['RANK']} got SIGTERM: checkpoint written", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, checkpoint)
    print(f"rank {os.environ['RANK']} training", flush=True)
    while True:
        time.sleep(0.1)
    """
)


def test_cancel_signals_every_rank_and_gives_the_gpus_back_only_once_the_pods_are_gone(
    k8s_tier: ControlPlane, alice: Client
) -> None:
    job_id = submit(alice, SIGTERM_CHECKPOINT, name="cancelled")
    pods = [f"gf-job-{job_id}-a1-{i}" for i in range(2)]
    wait_for(
        lambda: all(f"rank {r} training" in pod_output(k8s_tier, pods[r // 2]) for r in range(4)),
        timeout=120,
        what="every rank training",
    )
    alice.cancel(job_id)
    job = alice.wait(job_id, timeout=90)
    assert job.outcome == "cancelled", job.reason
    assert not job.allocations
    # The GPUs came back only once the API server had no pod of the job any more.
    assert not any(job_pods(k8s_tier, c, job_id) for c in (CLUSTER_A, CLUSTER_B))
    for rank in range(4):
        assert f"rank {rank} got SIGTERM: checkpoint written" in pod_output(
            k8s_tier, pods[rank // 2]
        )


SLEEPER = "import time\ntime.sleep(600)\n"


def test_a_gang_that_fits_nowhere_waits_with_a_reason_and_one_cluster_full_sends_it_to_the_other(
    k8s_tier: ControlPlane, alice: Client
) -> None:
    # Each zone holds one node of 4 GPUs: three 4-GPU jobs fill the fleet, the fourth waits.
    running = [submit(alice, SLEEPER, name=f"filler-{i}") for i in range(3)]
    for job_id in running:
        wait_for(
            lambda job_id=job_id: alice.job(job_id).state == "running",
            timeout=120,
            what=f"job {job_id} running",
        )
    clusters = {
        c for job_id in running for c in (CLUSTER_A, CLUSTER_B) if job_pods(k8s_tier, c, job_id)
    }
    assert clusters == {CLUSTER_A, CLUSTER_B}  # cluster A holds two, B the third
    waiting = submit(alice, SLEEPER, name="waiting")
    pending = wait_for(
        lambda: (
            (job := alice.job(waiting)).state == "pending" and "cycle" not in job.reason and job
        ),
        timeout=30,
        what="the fourth job pending with the scheduler's reason",
    )
    assert "free" in pending.reason and "quota" not in pending.reason, pending.reason
    assert not any(job_pods(k8s_tier, c, waiting) for c in (CLUSTER_A, CLUSTER_B))
    alice.cancel(running[0])
    wait_for(
        lambda: alice.job(waiting).state == "running", timeout=120, what="the waiting job running"
    )
    for job_id in [*running[1:], waiting]:
        alice.cancel(job_id)
    for job_id in [*running, waiting]:
        assert alice.wait(job_id, timeout=90).outcome == "cancelled"


def test_a_pod_the_api_server_refuses_leaves_nothing_and_the_job_queued_with_the_reason(
    k8s_tier: ControlPlane, alice: Client
) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "one-pod", "namespace": NAMESPACE},
        "spec": {"hard": {"pods": "1"}},
    }
    with k8s_tier[CLUSTER_A].rest() as api_a, k8s_tier[CLUSTER_B].rest() as api_b:
        for api in (api_a, api_b):
            made = api.post(f"/api/v1/namespaces/{NAMESPACE}/resourcequotas", json=quota)
            assert made.status_code == 201, made.text
        try:
            job_id = submit(alice, SLEEPER, name="refused")
            refused = wait_for(
                lambda: next(
                    (
                        e
                        for e in alice.events(workload_id=job_id)
                        if e.kind == "job-failed" and "exceeded quota" in e.message
                    ),
                    None,
                ),
                timeout=60,
                what="the refusal as the job's failure",
            )
            assert "nothing of them was left" in refused.message
            job = wait_for(
                lambda: (j := alice.job(job_id)).state == "pending" and j,
                timeout=30,
                what="the job back in the queue",
            )
            assert job.attempt == 2 and not job.allocations
            assert not any(job_pods(k8s_tier, c, job_id) for c in (CLUSTER_A, CLUSTER_B))
            alice.cancel(job_id)
            assert alice.wait(job_id, timeout=60).outcome == "cancelled"
        finally:
            for api in (api_a, api_b):
                api.delete(f"/api/v1/namespaces/{NAMESPACE}/resourcequotas/one-pod")


def wait_node_in_inventory(hub: Hub, name: str) -> None:
    wait_for(
        lambda: any(
            n["name"] == name and n["health"] == "ok"
            for n in hub.controller("GET", "/nodes").json()["items"]
        ),
        timeout=30,
        what=f"node {name} in gpufleet's inventory",
    )


def node_row(hub: Hub, name: str) -> dict[str, Any]:
    nodes = hub.controller("GET", "/nodes").json()["items"]
    return next(n for n in nodes if n["name"] == name)


def running_attempt(client: Client, job_id: int, attempt: int) -> Any:
    return wait_for(
        lambda: (j := client.job(job_id)).attempt == attempt and j.state == "running" and j,
        timeout=120,
        what=f"job {job_id}'s attempt {attempt} running",
    )


RESUMING = textwrap.dedent(
    """
    import os, time
    import gpufleet

    resumed = gpufleet.resume_from()
    start = int(resumed.rsplit("-", 1)[1]) + 1 if resumed else 0
    rank = int(os.environ["RANK"])
    print(f"rank {rank} attempt {os.environ['GPUFLEET_ATTEMPT']} starts at step {start}",
          flush=True)
    location = os.environ["GPUFLEET_CHECKPOINT_URI"]
    for step in range(start, 100_000):
        time.sleep(0.2)
        gpufleet.progress(step)
        if step % 5 == 4:
            gpufleet.checkpoint_started(step)
            gpufleet.checkpoint_saved(f"{location}/step-{step}", step)
    """
)


def test_a_node_deleted_under_a_job_restarts_it_elsewhere(
    k8s_tier: ControlPlane, jobs_hub: Hub, alice: Client
) -> None:
    b = k8s_tier[CLUSTER_B]
    name = b.spare_node_name()
    a_nodes = sorted(k8s_tier[CLUSTER_A].nodes)
    for node in a_nodes:  # the job lands on the new node, then moves to b-gpu-1
        jobs_hub.controller("POST", f"/nodes/{node}/cordon").raise_for_status()
    b.add_node(NodeSpec(name, "zone-c", gpus=4))
    try:
        wait_node_in_inventory(jobs_hub, name)
        jobs_hub.controller("POST", "/nodes/b-gpu-1/cordon").raise_for_status()
        job_id = submit(alice, SLEEPER, name="moved")
        first = running_attempt(alice, job_id, 1)
        assert {a.node for a in first.allocations} == {name}
        jobs_hub.controller("POST", "/nodes/b-gpu-1/uncordon").raise_for_status()
        with b.rest() as api:
            api.delete(f"/api/v1/nodes/{name}").raise_for_status()
        second = running_attempt(alice, job_id, 2)
        assert {a.node for a in second.allocations} == {"b-gpu-1"}
        faults = [e for e in alice.events(workload_id=job_id) if e.kind == "job-fault"]
        assert faults and "deleted" in faults[0].message, faults
        alice.cancel(job_id)
        assert alice.wait(job_id, timeout=90).outcome == "cancelled"
    finally:
        for node in [*a_nodes, "b-gpu-1"]:
            jobs_hub.controller("POST", f"/nodes/{node}/uncordon").raise_for_status()
        b.remove_node(name)


ALL_REDUCING = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    import gpufleet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    resumed = gpufleet.resume_from()
    start = int(resumed.rsplit("-", 1)[1]) + 1 if resumed else 0
    attempt = os.environ["GPUFLEET_ATTEMPT"]
    print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)
    location = os.environ["GPUFLEET_CHECKPOINT_URI"]
    steps = int(os.environ["STEPS"])
    for step in range(start, steps):
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        assert total.item() == world, total
        gpufleet.progress(step)
        if step % 5 == 4:
            gpufleet.checkpoint_started(step)
            gpufleet.checkpoint_saved(f"{location}/step-{step}", step)
        time.sleep(0.2)
    print(f"rank {rank} attempt {attempt} summed {world} ranks to step {steps - 1}", flush=True)
    dist.destroy_process_group()
    """
)


def test_a_deleted_pod_is_made_again_alone_and_the_other_keeps_running_into_the_next_attempt(
    k8s_tier: ControlPlane, jobs_hub: Hub, alice: Client
) -> None:
    """A pod of a running gang deleted by someone else: only it is made again; the other
    pod stays (the same pod, its launcher running the next attempt's torchrun), and the
    ranks all-reduce again from the last checkpoint to the job's end. A disruption: no
    retry budget is spent."""
    env = {"GPUFLEET_PROGRESS_INTERVAL": "0.5", "STEPS": "40"}
    job_id = submit(alice, ALL_REDUCING, name="kept", env=env)
    first = running_attempt(alice, job_id, 1)
    saved = wait_for(
        lambda: (p := alice.job(job_id).progress) and (p.last_step or 0) >= 12 and p,
        timeout=90,
        what="attempt 1 past step 12",
    )
    cluster = next(c for c in (CLUSTER_A, CLUSTER_B) if job_pods(k8s_tier, c, job_id))
    uids = {
        p["metadata"]["name"]: p["metadata"]["uid"] for p in job_pods(k8s_tier, cluster, job_id)
    }
    assert sorted(uids) == [f"gf-job-{job_id}-a1-0", f"gf-job-{job_id}-a1-1"]
    with k8s_tier[cluster].rest() as api:
        api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/gf-job-{job_id}-a1-1").raise_for_status()
    second = running_attempt(alice, job_id, 2)
    assert second.faults == first.faults == 0  # a disruption spends no retry budget

    def attempt_2_pods() -> dict[str, Any] | None:
        pods = {p["metadata"]["name"]: p for p in job_pods(k8s_tier, cluster, job_id)}
        labels = {n: p["metadata"]["labels"]["gpufleet.io/attempt"] for n, p in pods.items()}
        wanted = {f"gf-job-{job_id}-a1-0": "2", f"gf-job-{job_id}-a2-1": "2"}
        return pods if labels == wanted else None

    pods = wait_for(attempt_2_pods, timeout=60, what="pod 0 kept into attempt 2 beside a new pod 1")
    kept = pods[f"gf-job-{job_id}-a1-0"]
    assert kept["metadata"]["uid"] == uids[f"gf-job-{job_id}-a1-0"]  # the very same pod
    done = alice.wait(job_id, timeout=120)
    assert done.outcome == "succeeded", done.reason
    out = "".join(alice.logs(job_id))
    resumed = int(out.split("rank 0 attempt 2 starts at step ")[1].split()[0])
    assert resumed >= saved.last_checkpoint.step + 1, (resumed, saved)  # from its checkpoint
    assert "attempt 2 summed 4 ranks to step 39" in out
    events = [(e.kind, e.message) for e in alice.events(workload_id=job_id)]
    failed = [m for k, m in events if k == "job-failed"]
    assert failed and "deleted by someone other than gpufleet" in failed[0], events
    assert "the other pods are kept for the next attempt" in failed[0]
    restarting = [m for k, m in events if k == "job-restarting"]
    assert restarting and "pods 0 keep their nodes and run it in place" in restarting[0]


def test_a_node_that_stops_answering_under_one_pod_of_a_gang_costs_only_that_pod(
    k8s_tier: ControlPlane, jobs_hub: Hub, alice: Client
) -> None:
    """A gang across a-gpu-1 and a node added to its zone (a filler job holds the rest of
    a-gpu-1 meanwhile); the added node stops answering (its kubelet paused: the pod there
    still runs). That pod is placed anew on a-gpu-1, the other is kept, the ranks go on
    from the checkpoint, and the lost pod's GPUs go to nobody until its node is back and
    the pod gone. (The tier's node agent watches the tier's own nodes: the steps and
    checkpoints are those of the ranks on a-gpu-1.)"""
    a = k8s_tier[CLUSTER_A]
    added = a.spare_node_name()
    a.add_node(NodeSpec(added, "zone-a", gpus=2))
    others = ["a-gpu-2", "b-gpu-1"]
    for node in others:  # zone-a only
        jobs_hub.controller("POST", f"/nodes/{node}/cordon").raise_for_status()
    lost = ""
    try:
        wait_node_in_inventory(jobs_hub, added)
        jobs_hub.controller("POST", f"/nodes/{added}/cordon").raise_for_status()
        filler = submit(alice, SLEEPER, name="filler", gpus=2, gpus_per_pod=2)
        assert {p.node for p in running_attempt(alice, filler, 1).pod_states} == {"a-gpu-1"}
        jobs_hub.controller("POST", f"/nodes/{added}/uncordon").raise_for_status()
        job_id = submit(
            alice,
            ALL_REDUCING,
            name="half-lost",
            env={"GPUFLEET_PROGRESS_INTERVAL": "0.5", "STEPS": "100000"},
        )
        first = running_attempt(alice, job_id, 1)
        where = {p.pod: p.node for p in first.pod_states}
        assert sorted(where.values()) == sorted(["a-gpu-1", added])
        alice.cancel(filler)  # room on a-gpu-1 for the pod that will be lost
        assert alice.wait(filler, timeout=90).outcome == "cancelled"
        saved = wait_for(
            lambda: (p := alice.job(job_id).progress) and p.last_checkpoint,
            timeout=60,
            what="a checkpoint saved",
        )
        lost = added
        [moved] = [i for i, node in where.items() if node == lost]
        stays = 1 - moved
        uid = {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in job_pods(k8s_tier, CLUSTER_A, job_id)
        }
        a.kubelet(lost).pause()
        second = running_attempt(alice, job_id, 2)
        assert {p.pod: p.node for p in second.pod_states} == {0: "a-gpu-1", 1: "a-gpu-1"}
        resumed = wait_for(
            lambda: (
                "rank 0 attempt 2 starts at step" in (out := "".join(alice.logs(job_id))) and out
            ),
            timeout=60,
            what="attempt 2's first words",
        )
        start = int(resumed.split("rank 0 attempt 2 starts at step ")[1].split()[0])
        assert start >= saved.step + 1, (start, saved)
        wait_for(
            lambda: (p := alice.job(job_id).progress) and (p.last_step or 0) > start + 5,
            timeout=60,
            what="attempt 2's steps going on across both pods",
        )
        pods = {p["metadata"]["name"]: p for p in job_pods(k8s_tier, CLUSTER_A, job_id)}
        kept = pods[f"gf-job-{job_id}-a1-{stays}"]
        assert kept["metadata"]["uid"] == uid[f"gf-job-{job_id}-a1-{stays}"]  # the same pod
        assert kept["metadata"]["labels"]["gpufleet.io/attempt"] == "2"
        assert pods[f"gf-job-{job_id}-a2-{moved}"]["spec"]["nodeName"] == "a-gpu-1"
        # What may still run on the silent node keeps its GPUs from anyone else.
        held = node_row(jobs_hub, lost)
        assert len(held["leftover_gpus"]) == 2 and held["free_gpus"] == 0
        a.kubelet(lost).resume()
        wait_for(
            lambda: not node_row(jobs_hub, lost)["leftover_gpus"],
            timeout=90,
            what=f"{lost}'s GPUs released once the old pod is gone",
        )
        assert f"gf-job-{job_id}-a1-{moved}" not in {
            p["metadata"]["name"] for p in job_pods(k8s_tier, CLUSTER_A, job_id)
        }
        kinds = [(e.kind, e.node) for e in alice.events(workload_id=job_id)]
        assert ("job-fault", lost) in kinds, kinds
        alice.cancel(job_id)
        assert alice.wait(job_id, timeout=90).outcome == "cancelled"
    finally:
        if lost and a.kubelet(lost).paused:
            a.kubelet(lost).resume()
        for node in others:
            jobs_hub.controller("POST", f"/nodes/{node}/uncordon").raise_for_status()
        jobs_hub.stop_all_servers()  # what a failure left running ends before the node goes
        a.remove_node(added)


HANGS_IN_ONE_RANK = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    import gpufleet

    def wait_for_nothing():
        time.sleep(3600)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["GPUFLEET_ATTEMPT"])
    print(f"rank {rank} attempt {attempt} starts", flush=True)
    for step in range(100_000):
        if attempt == 1 and rank == 3 and step == 10:
            wait_for_nothing()
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        gpufleet.progress(step)
        time.sleep(0.1)
    """
)


def test_a_hang_on_kubernetes_is_traced_before_the_gang_is_deleted_and_the_job_restarts(
    alice: Client,
) -> None:
    job_id = submit(
        alice, HANGS_IN_ONE_RANK, name="hangs", env={"GPUFLEET_PROGRESS_INTERVAL": "0.5"}
    )
    running_attempt(alice, job_id, 1)
    traced = wait_for(
        lambda: next((e for e in alice.events(workload_id=job_id) if e.kind == "job-traced"), None),
        timeout=120,
        what="the hang's stacks",
    )
    # Every rank of both pods was read before its pod was deleted: the hung rank inside
    # the function it hangs in, the others in the all-reduce that waits for it.
    assert traced.reason == "hang" and traced.data["missing_pods"] == [], traced
    where = traced.data["where"]
    assert str(where["3"]).startswith("wait_for_nothing (train.py:"), where
    assert sorted(where) == ["0", "1", "2", "3"], where
    faults = [e for e in alice.events(workload_id=job_id) if e.kind == "job-fault"]
    assert faults and faults[0].reason == "hang", faults
    second = running_attempt(alice, job_id, 2)
    assert second.faults == 1
    [trace] = alice.traces(job_id)
    assert [p.pod for p in trace.pods] == [0, 1] and all(
        "Thread " in r.text for p in trace.pods for r in p.ranks
    ), trace
    alice.cancel(job_id)
    assert alice.wait(job_id, timeout=90).outcome == "cancelled"
