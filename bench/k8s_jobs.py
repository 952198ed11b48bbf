"""Training jobs on Kubernetes: job start against ``kubectl apply`` of the same gang, a
restart after one pod's loss against deleting and recreating the whole gang, and pod
creation throughput against a plain create loop.

Measured: from the submission to every rank running, for a job of 4 pods × 2 GPUs, median
of 5, gpufleet against a shell script that applies the very same objects with
``kubectl apply`` on the same cluster (target: ratio <= 1.2). Both sides run the same pods:
the baseline's Service, NetworkPolicy and pods are built by gpufleet's own builders
(``clusters/job_manifests.py``) for the nodes gpufleet chose in the run before, so
the two differ only in what gpufleet adds: the queue, the admission, the cluster manager's
pass. "Every rank running" is the same moment on both sides: each rank prints a line as its
first act, and the run ends once the test kubelets hold every rank's line.

The tier is the tests' (``tests/k8s``): two real clusters, whose cluster-a has two fake
nodes of 8 GPUs in one zone here, so a 4 × 2 gang fits in one zone; test kubelets run the
pods on this machine. The runs alternate (gpufleet, kubectl, ...) so a slow moment of the
machine hits both; one untimed run of each comes first (the first gang of a hub starts its
clients, the first pods warm the page cache with torch).

Restart: a 4 × 2 gang, one pod per node of 2 GPUs (and a spare node), loses pod 1 (deleted
with no grace, as a lost node's pods go); measured from that moment to every rank of the
next attempt running (each rank's first line names its attempt, since a pod the restart
keeps holds the lines of both), median of 5, gpufleet against what JobSet does by default after a
failure: delete the whole gang (``kubectl delete --wait``) and create it again (``kubectl
apply``, under new names), on the same nodes (target: ratio <= 0.7).

Creation throughput: 200 queued 1-pod jobs released at once (vision's quota goes from 0 to
256 GPUs), pods created per second, from the release to the moment the API server holds
all 200 (its watch, opened before the release, announces the 200th), against a loop
creating the same 200 pods one after the other on the same API server (target: >= 0.8 of
its rate). Its tier has no kubelets (the pods stay Pending: what is measured is their
creation), and nodes of 64 GPUs. gpufleet makes one object per job of one pod (the pod:
its script in its annotation), as the loop does, and, once, the namespace's launcher
ConfigMap and jobs' NetworkPolicy.

    .venv/bin/python bench/k8s_jobs.py              # --runs 5 --warmup 1 --jobs 200
    .venv/bin/python bench/k8s_jobs.py --only start   # or --only restart, --only throughput

Needs the tier's binaries (``scripts/install --k8s``) and root (the test kubelets run
containers as their pods' users). Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' tier and hub harness

import httpx

from gpufleet.client import Client
from gpufleet.clusters.job_manifests import JobGang, gang_objects, gang_pod
from gpufleet.clusters.manifests import priority_class
from gpufleet.snapshotter.sandbox import default_session_env
from tests.integration.harness import Hub
from tests.k8s.control_plane import NAMESPACE, ControlPlane, find_binaries
from tests.k8s.hubs import WITHOUT_AGENT, make_kube_hub
from tests.k8s.nodes import NodeSpec
from tests.k8s.tier import CLUSTER_A, CLUSTER_B
from tests.ports import free_port_block

PODS, GPUS_PER_POD = 4, 2
NODES = {
    CLUSTER_A: (NodeSpec("a-gpu-1", "zone-a", gpus=8), NodeSpec("a-gpu-2", "zone-a", gpus=8)),
    CLUSTER_B: (NodeSpec("b-gpu-1", "zone-c", gpus=4),),
}
SCRIPT = textwrap.dedent(
    """
    import os, time
    print(f"rank {os.environ['RANK']} attempt {os.environ['GPUFLEET_ATTEMPT']} running",
          flush=True)
    time.sleep(3600)
    """
)
CONFIG = """
c.KubeJobs.image = "gpufleet/session:test"
c.KubeJobs.interval = 0.5
c.KubeJobs.rendezvous_ports = ({first}, {last})
for project in c.FleetController.projects:
    if project["name"] == "vision":
        project["quotas"] = {{"A100-80GB": {{"guaranteed": 16, "borrow_limit": 0}}}}
        project["per_user_gpu_cap"] = 16
"""


def wait(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def ranks_running(plane: ControlPlane, pods: list[str], attempt: int = 1) -> bool:
    """Whether the kubelets hold every rank's first line of ``attempt``, for the pods
    named (a pod a restart keeps has its attempts' lines one after the other)."""
    seen = ""
    for cluster in plane.clusters.values():
        for kubelet in cluster.kubelets.values():
            for pod in pods:
                try:
                    seen += kubelet.logs(NAMESPACE, pod, "torchrun")
                except FileNotFoundError:
                    continue
    return all(f"rank {r} attempt {attempt} running" in seen for r in range(PODS * GPUS_PER_POD))


# ------------------------------------------------------------------ gpufleet
def submit_gang(client: Client, python: str, name: str) -> tuple[Any, list[str]]:
    """The benchmark's job, and the names of its first attempt's pods."""
    job = client.submit(
        SCRIPT,
        gpus=PODS * GPUS_PER_POD,
        gpus_per_pod=GPUS_PER_POD,
        gpu_type="A100-80GB",
        project="vision",
        python=python,
        name=name,
    )
    return job, [f"gf-job-{job.id}-a1-{i}" for i in range(PODS)]


def gpufleet_run(client: Client, plane: ControlPlane, python: str) -> tuple[float, Any]:
    began = time.monotonic()
    job, pods = submit_gang(client, python, "bench")
    wait(lambda: ranks_running(plane, pods), 180, "every rank of gpufleet's job running")
    took = time.monotonic() - began
    placed = client.job(job.id)
    client.cancel(job.id)
    client.wait(job.id, timeout=120)
    return took, placed


# ------------------------------------------------------------------ kubectl apply
def baseline_gang(
    run: int, nodes: tuple[str, ...], python: str, port: int, attempt: int = 1
) -> JobGang:
    return JobGang(
        workload_id=900_000 + run,
        attempt=attempt,
        job_name="bench",
        user="alice",
        project="vision",
        marker=f"bench{run:04d}",
        cluster=CLUSTER_A,
        namespace=NAMESPACE,
        nodes=nodes,
        image="gpufleet/session:test",
        python=python,
        script_name="train.py",
        script=SCRIPT,
        rendezvous_port=port,
        uid=20_000,
        gid=20_000,
        gpus_per_pod=GPUS_PER_POD,
    )


def baseline_manifest(gang: JobGang, directory: Path) -> Path:
    """The gang's objects as one List for kubectl, labelled as not gpufleet's. (Its pods
    mount the launcher's ConfigMap that gpufleet's run before made in the namespace.)"""
    objects = [*gang_objects(gang), *(gang_pod(gang, i) for i in range(gang.pods))]
    for body in objects:  # not gpufleet's: its cluster manager deletes pods it did not ask for
        body["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "kubectl"
    manifest = directory / f"{gang.name}.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    return manifest


def kubectl(plane: ControlPlane, *args: str) -> list[str]:
    """A kubectl command line on cluster-a as its admin."""
    binary = plane.binaries.kubectl
    assert binary is not None, "the tier's kubectl is missing: scripts/install --k8s"
    return [str(binary), "--kubeconfig", str(plane.admin_kubeconfig), "--context", CLUSTER_A, *args]


def wait_ranks(plane: ControlPlane, gang: JobGang) -> None:
    pods = [gang.pod_name(i) for i in range(gang.pods)]
    try:
        wait(
            lambda: ranks_running(plane, pods, gang.attempt),
            180,
            "every rank of the applied gang running",
        )
    except TimeoutError:
        with plane[CLUSTER_A].rest() as api:
            for pod in pods:
                status = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}").json()
                print(pod, json.dumps(status)[:300], file=sys.stderr)
        raise


def baseline_run(plane: ControlPlane, gang: JobGang, directory: Path) -> float:
    manifest = baseline_manifest(gang, directory)
    script = " ".join(kubectl(plane, "apply", "-f", str(manifest))) + " >/dev/null"
    began = time.monotonic()
    subprocess.run(["sh", "-c", script], check=True)
    wait_ranks(plane, gang)
    took = time.monotonic() - began
    delete = kubectl(plane, "delete", "--wait=true", "-f", str(manifest))
    subprocess.run(delete, check=True, stdout=subprocess.DEVNULL)
    return took


# ------------------------------------------------------------------ restart
# One pod per node, and a spare node: a fault takes one pod's node.
NARROW = {
    CLUSTER_A: tuple(
        NodeSpec(f"a-gpu-{i}", "zone-a", gpus=GPUS_PER_POD) for i in range(1, PODS + 2)
    ),
    CLUSTER_B: (NodeSpec("b-gpu-1", "zone-c", gpus=4),),
}


def delete_pod(plane: ControlPlane, pod: str) -> None:
    """The fault: the pod is gone at once (its node's loss, as the API server sees it)."""
    with plane[CLUSTER_A].rest() as api:
        api.delete(
            f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", params={"gracePeriodSeconds": 0}
        ).raise_for_status()


def gpufleet_restart(client: Client, plane: ControlPlane, python: str) -> tuple[float, Any]:
    job, first = submit_gang(client, python, "restart")
    wait(lambda: ranks_running(plane, first), 180, "every rank of attempt 1 running")
    began = time.monotonic()
    delete_pod(plane, first[1])
    # Kept pods keep attempt 1's names; a pod made anew has attempt 2's.
    second = [f"gf-job-{job.id}-a{a}-{i}" for a in (1, 2) for i in range(PODS)]
    wait(lambda: ranks_running(plane, second, 2), 180, "every rank of attempt 2 running")
    took = time.monotonic() - began
    placed = client.job(job.id)
    client.cancel(job.id)
    client.wait(job.id, timeout=120)
    return took, placed


def baseline_restart(plane: ControlPlane, before: JobGang, after: JobGang, tmp: Path) -> float:
    """JobSet's default after a failure: delete the whole gang, then create it again."""
    old, new = baseline_manifest(before, tmp), baseline_manifest(after, tmp)
    subprocess.run(kubectl(plane, "apply", "-f", str(old)), check=True, stdout=subprocess.DEVNULL)
    wait_ranks(plane, before)
    began = time.monotonic()
    delete_pod(plane, before.pod_name(1))
    delete = kubectl(plane, "delete", "--wait=true", "--ignore-not-found", "-f", str(old))
    subprocess.run(delete, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(kubectl(plane, "apply", "-f", str(new)), check=True, stdout=subprocess.DEVNULL)
    wait_ranks(plane, after)
    took = time.monotonic() - began
    delete = kubectl(plane, "delete", "--wait=true", "-f", str(new))
    subprocess.run(delete, check=True, stdout=subprocess.DEVNULL)
    return took


def restart(args: argparse.Namespace, python: str) -> None:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        plane = stack.enter_context(tier(NARROW))
        first = free_port_block(40)
        config = WITHOUT_AGENT + CONFIG.format(first=first, last=first + 19)
        hub: Hub = make_kube_hub(plane, Path(tmp) / "hub", config)
        stack.callback(hub.kill_everything)
        hub.start()
        client = stack.enter_context(Client(hub.controller_api, hub.user_token("alice")))
        gpufleet: list[float] = []
        recreate: list[float] = []
        for i in range(args.warmup + args.runs):
            took, placed = gpufleet_restart(client, plane, python)
            nodes = tuple(p.node for p in placed.pod_states)
            port = first + 20 + (2 * i) % 20
            before = baseline_gang(i, nodes, python, port)
            after = baseline_gang(i, nodes, python, port + 1, attempt=2)
            again = baseline_restart(plane, before, after, Path(tmp))
            label = "warm-up" if i < args.warmup else f"run {i - args.warmup + 1}"
            print(f"{label}: gpufleet {took:6.2f} s  recreate {again:6.2f} s", flush=True)
            if i >= args.warmup:
                gpufleet.append(took)
                recreate.append(again)
        ours, theirs = statistics.median(gpufleet), statistics.median(recreate)
        print(
            f"\nrestart after one pod's loss, {PODS} pods × {GPUS_PER_POD} GPUs, fault to "
            f"every rank running again, median of {args.runs}:\n"
            f"  gpufleet           {ours:6.2f} s\n"
            f"  delete + recreate  {theirs:6.2f} s\n"
            f"  ratio              {ours / theirs:6.2f}  (target <= 0.7)"
        )


# ------------------------------------------------------------------ throughput
WIDE = {
    CLUSTER_A: tuple(NodeSpec(f"a-gpu-{i}", "zone-a", gpus=64) for i in range(1, 5)),
    CLUSTER_B: (NodeSpec("b-gpu-1", "zone-c", gpus=4),),
}
WIDE_CONFIG = """
c.KubeJobs.image = "gpufleet/session:test"
c.KubeJobs.interval = 0.5
c.KubeJobs.start_deadline_seconds = 3600  # no kubelet runs them: they stay Pending
for project in c.FleetController.projects:
    if project["name"] == "vision":
        project["quotas"] = {"A100-80GB": {"guaranteed": 0, "borrow_limit": 0}}
        project["per_user_gpu_cap"] = 256
"""


class PodWatch:
    """The moments the API servers of both clusters announce new pods matching
    ``selector`` (the scheduler may put a few jobs on cluster-b's node), from a watch each
    opened now: what the pods' creation is timed by, without the load of listing them again
    and again while they are made."""

    def __init__(self, plane: ControlPlane, selector: str) -> None:
        self.added: list[float] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        for cluster in plane.clusters.values():
            api = cluster.rest()
            path = f"/api/v1/namespaces/{NAMESPACE}/pods"
            listed = api.get(path, params={"labelSelector": selector})
            listed.raise_for_status()
            self.added += [0.0] * len(listed.json()["items"])
            version = listed.json()["metadata"]["resourceVersion"]
            thread = threading.Thread(
                target=self._follow, args=(api, path, selector, version), daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _follow(self, api: httpx.Client, path: str, selector: str, version: str) -> None:
        params = {"watch": "true", "labelSelector": selector, "resourceVersion": version}
        try:
            with api.stream("GET", path, params=params, timeout=httpx.Timeout(5, read=None)) as r:
                for line in r.iter_lines():
                    if line.strip() and json.loads(line).get("type") == "ADDED":
                        with self._lock:
                            self.added.append(time.monotonic())
        finally:
            api.close()

    def when(self, count: int, timeout: float) -> float:
        """The moment the ``count``-th pod was announced."""
        wait(lambda: len(self.added) >= count, timeout, f"{count} pods created", every=0.05)
        with self._lock:
            return sorted(self.added)[count - 1]


def throughput(args: argparse.Namespace, python: str) -> tuple[float, float]:
    """(gpufleet's pods per second, the loop's)."""
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        plane = stack.enter_context(tier(WIDE, kubelets=False))
        hub: Hub = make_kube_hub(plane, Path(tmp) / "hub", WITHOUT_AGENT + WIDE_CONFIG)
        stack.callback(hub.kill_everything)
        hub.start()
        client = stack.enter_context(Client(hub.controller_api, hub.user_token("alice")))
        for i in range(args.jobs):
            client.submit(
                SCRIPT, gpus=1, gpu_type="A100-80GB", project="vision", python=python, name=f"t{i}"
            )
        watch = PodWatch(plane, "app.kubernetes.io/component=job")
        began = time.monotonic()
        hub.controller(
            "PATCH", "/projects/vision", json={"quotas": {"A100-80GB": {"guaranteed": 256}}}
        ).raise_for_status()
        ours = args.jobs / (watch.when(args.jobs, 600) - began)
        gang = baseline_gang(0, ("a-gpu-1",), python, 29500)
        bodies = []
        for i in range(args.jobs):
            body = gang_pod(gang, 0)
            body["metadata"]["name"] = f"loop-{i}"
            body["metadata"]["labels"]["app.kubernetes.io/component"] = "loop"
            bodies.append(body)
        with plane[CLUSTER_A].rest() as api:
            began = time.monotonic()
            for body in bodies:
                api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=body).raise_for_status()
            theirs = args.jobs / (time.monotonic() - began)
        return ours, theirs


# ------------------------------------------------------------------ main
@contextmanager
def tier(
    nodes: dict[str, tuple[NodeSpec, ...]] = NODES, kubelets: bool = True
) -> Iterator[ControlPlane]:
    plane = ControlPlane.start(find_binaries(), dict(nodes), kubelets=kubelets)
    try:
        for cluster in plane.clusters.values():
            with cluster.rest() as api:
                made = api.post(
                    "/apis/scheduling.k8s.io/v1/priorityclasses",
                    json=priority_class("gpufleet-job", 500, "gpufleet training jobs"),
                )
                if made.status_code not in (201, 409):
                    raise RuntimeError(f"PriorityClass in {cluster.name}: {made.text}")
        yield plane
    finally:
        plane.stop()


def job_start(args: argparse.Namespace, python: str) -> None:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        plane = stack.enter_context(tier())
        first = free_port_block(40)
        config = WITHOUT_AGENT + CONFIG.format(first=first, last=first + 19)
        hub: Hub = make_kube_hub(plane, Path(tmp) / "hub", config)
        stack.callback(hub.kill_everything)
        hub.start()
        client = stack.enter_context(Client(hub.controller_api, hub.user_token("alice")))
        gpufleet: list[float] = []
        kubectl: list[float] = []
        nodes: tuple[str, ...] = ()
        for i in range(args.warmup + args.runs):
            took, placed = gpufleet_run(client, plane, python)
            nodes = tuple(p.node for p in placed.pod_states)
            gang = baseline_gang(i, nodes, python, first + 20 + i % 20)
            applied = baseline_run(plane, gang, Path(tmp))
            label = "warm-up" if i < args.warmup else f"run {i - args.warmup + 1}"
            print(f"{label}: gpufleet {took:6.2f} s  kubectl apply {applied:6.2f} s", flush=True)
            if i >= args.warmup:
                gpufleet.append(took)
                kubectl.append(applied)
        ours, theirs = statistics.median(gpufleet), statistics.median(kubectl)
        print(
            f"\njob start, {PODS} pods × {GPUS_PER_POD} GPUs, submit to every rank running, "
            f"median of {args.runs}:\n"
            f"  gpufleet       {ours:6.2f} s\n"
            f"  kubectl apply  {theirs:6.2f} s\n"
            f"  ratio          {ours / theirs:6.2f}  (target <= 1.2)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--only", choices=("start", "restart", "throughput"))
    args = parser.parse_args(argv)
    # A stopped benchmark stops what it started: its tier, and its hub, which would
    # otherwise start its controller again and again (JupyterHub restarts its services).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        sys.exit("the test kubelets run containers as their pods' users: run as root")
    python = str(Path(default_session_env()) / "bin" / "python")
    if args.only in (None, "start"):
        job_start(args, python)
    if args.only in (None, "restart"):
        restart(args, python)
    if args.only in (None, "throughput"):
        ours, theirs = throughput(args, python)
        print(
            f"\npod creation, {args.jobs} queued 1-pod jobs released at once:\n"
            f"  gpufleet       {ours:6.1f} pods/s (1 object each: the pod)\n"
            f"  create loop    {theirs:6.1f} pods/s\n"
            f"  ratio          {ours / theirs:6.2f}  (target >= 0.8)"
        )


if __name__ == "__main__":
    main()
