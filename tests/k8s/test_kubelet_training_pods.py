"""The test kubelet gives pods what a training job's pods rely on: the kernel's verdict on
a memory limit (OOMKilled), their peers' stable names through a headless Service, and their
script from a ConfigMap volume.

As in ``test_kubelet.py``, each test talks to the cluster as gpufleet's spawner does and
checks what a user would notice: a pod's phase, exit code and reason, what its process
saw, whom it reached by name. The first tests check the pure rules without a tier.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes_asyncio import client

from . import memory
from .control_plane import NAMESPACE, ControlPlane
from .kube import eventually
from .kubelet_helpers import (
    NODE,
    logged,
    manifest,
    phase,
    pods,
    processes_with,
    runnable_kubelets,
    status_of,
)
from .names import HostsFile, fixed_lines, peer_lines, service_line
from .tier import CLUSTER_A, in_ci

pytestmark = pytest.mark.k8s

OTHER_NODE = "a-gpu-2"
OOM_DEADLINE_S = 15.0  # from creation to Failed: the allocation itself takes well under 1 s
# A Python that allocates 256 MiB and writes to every page of it, so the memory is charged.
ALLOCATE = (
    "import sys; b = bytearray(int(sys.argv[1]) << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('allocated', len(b) >> 20, 'MiB', flush=True)"
)
# What the container's own memory cgroup allows, read as the container sees it.
OWN_LIMIT = (
    'cg=$(grep -E "^[0-9]+:memory:" /proc/self/cgroup | cut -d: -f3); '
    'echo "limit=$(cat /sys/fs/cgroup/memory$cg/memory.limit_in_bytes)"; '
    'echo "memsw=$(cat /sys/fs/cgroup/memory$cg/memory.memsw.limit_in_bytes)"'
)


# ------------------------------------------------------------------ the rules, without a tier
def test_memory_quantities_are_read_as_kubernetes_reads_them() -> None:
    assert memory.quantity_bytes("512Mi") == 512 << 20
    assert memory.quantity_bytes("1Gi") == 1 << 30
    assert memory.quantity_bytes("100M") == 100_000_000
    assert memory.quantity_bytes("1048576") == 1 << 20
    assert memory.quantity_bytes(4096) == 4096
    assert memory.quantity_bytes("1.5Gi") == 3 << 29
    assert memory.quantity_bytes("1e9") == 10**9
    assert memory.quantity_bytes("1k") == 1000
    assert memory.quantity_bytes("1500m") == 2  # milli-bytes round up, as Value() does
    for wrong in ("", "Mi", "1 Gi", "1GB", "one"):
        with pytest.raises(ValueError):
            memory.quantity_bytes(wrong)
    assert memory.memory_limit({"resources": {"limits": {"memory": "64Mi"}}}) == 64 << 20
    assert memory.memory_limit({"resources": {"requests": {"memory": "64Mi"}}}) is None
    assert memory.memory_limit({}) is None


def test_a_service_with_a_cluster_ip_is_named_at_a_ready_endpoint() -> None:
    def endpoint(ip: str, ready: bool | None) -> dict[str, Any]:
        return {"addresses": [ip], "conditions": {"ready": ready}}

    starting = {"endpoints": [endpoint("127.9.0.1", False)]}
    assert service_line("ns", "hub", [starting]) is None  # no answer before one is ready
    pieces = [
        starting,
        {"endpoints": [endpoint("127.9.0.9", True), endpoint("127.9.0.3", None)]},
    ]
    assert service_line("ns", "hub", pieces) == (
        "127.9.0.3\thub.ns.svc.cluster.local hub.ns.svc hub.ns hub"
    )


def test_a_hosts_file_answers_as_the_cluster_dns_and_changes_only_safely(tmp_path: Path) -> None:
    pod = {
        "metadata": {"name": "job-pod-1", "namespace": "ns"},
        "spec": {
            "hostname": "p1",
            "subdomain": "job-x",
            "hostAliases": [{"ip": "10.1.2.3", "hostnames": ["s3.example"]}],
        },
    }
    fixed = fixed_lines(pod, "127.9.0.2", "machine")
    assert "127.0.0.1\tlocalhost" in fixed
    assert (
        "127.9.0.2\tp1.job-x.ns.svc.cluster.local p1.job-x.ns.svc p1.job-x.ns p1.job-x p1 machine"
    ) in fixed
    assert "10.1.2.3\ts3.example" in fixed

    def endpoint(host: str, ip: str, ready: bool | None = True) -> dict[str, Any]:
        return {"addresses": [ip], "hostname": host, "conditions": {"ready": ready}}

    piece = {
        "endpoints": [
            endpoint("p0", "127.9.0.1"),
            endpoint("p1", "127.9.0.2"),  # the pod itself: its own line has it
            endpoint("p2", "127.9.0.3", ready=None),  # unknown reads as ready
            endpoint("p3", "127.9.0.4", ready=False),  # not published
            {"addresses": ["127.9.0.5"], "conditions": {"ready": True}},  # no hostname
        ]
    }
    peers = peer_lines("ns", "job-x", [piece], own_ip="127.9.0.2")
    assert peers == [
        "127.9.0.1\tp0.job-x.ns.svc.cluster.local p0.job-x.ns.svc p0.job-x.ns p0.job-x",
        "127.9.0.3\tp2.job-x.ns.svc.cluster.local p2.job-x.ns.svc p2.job-x.ns p2.job-x",
    ]

    path = tmp_path / "etc-hosts"
    hosts = HostsFile(path, fixed)
    inode = path.stat().st_ino
    hosts.follow(peers[:1])
    hosts.follow(peers)
    before = path.read_text()
    moved = "127.9.0.7\tp0.job-x.ns.svc.cluster.local p0.job-x.ns.svc p0.job-x.ns p0.job-x"
    hosts.follow([moved, peers[1]])  # p0 came back at another address

    def answers(text: str) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                address, *names = line.split()
                for name in names:
                    found.setdefault(name, []).append(address)
        return found

    text = path.read_text()
    assert answers(text)["p0.job-x.ns.svc.cluster.local"] == ["127.9.0.7"]
    assert answers(text)["p2.job-x"] == ["127.9.0.3"]
    assert answers(text)["p1.job-x"] == ["127.9.0.2"]
    # Changed in place (a bind mount shows the inode it was made with), the earlier text
    # kept byte for byte but for the one '#' that put out p0's old line.
    assert path.stat().st_ino == inode
    assert text == before.replace(f"\n{peers[0]}", f"\n#{peers[0][1:]}") + f"{moved}\n"
    assert hosts.peers == [peers[1], moved]


@pytest.fixture
def cgroups_here() -> None:
    problem = memory.available()
    if problem is not None:
        if in_ci():
            pytest.fail(f"CI=true and memory limits cannot be kept here: {problem}")
        pytest.skip(f"memory limits cannot be kept here: {problem}")


def test_a_kubelet_removes_what_a_crashed_test_process_left(cgroups_here: None) -> None:
    # A parent of the test's own, so the tier's live cgroups are never in its way.
    parent = f"{memory.PARENT}-sweep-{uuid.uuid4().hex[:8]}"
    crashed = memory.CONTROLLER / parent / "0-0" / "a-pod-uid" / "main.0"  # no process is 0
    crashed.mkdir(parents=True)
    leftover = subprocess.Popen(
        ["sleep", "600"], preexec_fn=lambda: memory.place_self(crashed), start_new_session=True
    )
    try:
        live = memory.MemoryCgroups(parent=parent)
        mine = live.create("live-pod", "main", 0, 64 << 20)
        assert live.sweep() == []
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert not (memory.CONTROLLER / parent / "0-0").exists()
        assert mine.path.is_dir()  # this process's own are not a crashed run's
        assert live.release(mine) and not mine.path.parent.exists()
        assert live.close() == [] and not live.root.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            leftover.kill()
        leftover.wait()
        for directory, _, _ in os.walk(memory.CONTROLLER / parent, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


# ------------------------------------------------------------------ memory limits
@pytest.fixture
def kubelets(k8s_tier: ControlPlane) -> Iterator[ControlPlane]:
    with runnable_kubelets(k8s_tier) as plane:
        yield plane


def limited(limit: str) -> dict[str, Any]:
    return {"resources": {"limits": {"memory": limit}, "requests": {"memory": limit}}}


async def test_a_container_over_its_memory_limit_is_oom_killed_and_one_within_it_completes(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api, cgroups_here: None
) -> None:
    cluster = kubelets[CLUSTER_A]
    kubelet = cluster.kubelet(NODE)
    token = f"killed-{uuid.uuid4().hex}"
    greedy = manifest("greedy", ["python3", "-c", ALLOCATE, "256"], container=limited("64Mi"))
    modest = manifest(
        "modest",
        ["sh", "-c", f'{OWN_LIMIT}; python3 -c "$0" 32', ALLOCATE],
        container=limited("256Mi"),
    )
    # Killed from outside with SIGKILL, as by a user's kill -9: the same exit code as an OOM
    # kill, but not the kernel's verdict.
    killed = manifest(
        "killed",
        ["python3", "-c", "import time; print('started', flush=True); time.sleep(600)", token],
        container=limited("64Mi"),
    )
    async with pods(spawner_a, greedy, modest, killed) as (greedy_name, modest_name, killed_name):
        uids = [
            (await spawner_a.read_namespaced_pod(n, NAMESPACE)).metadata.uid
            for n in (greedy_name, modest_name, killed_name)
        ]
        failed = await phase(spawner_a, greedy_name, "Failed", deadline_s=OOM_DEADLINE_S)
        state = status_of(failed).state.terminated
        assert (state.reason, state.exit_code) == ("OOMKilled", 137)
        assert "allocated" not in kubelet.logs(NAMESPACE, greedy_name, "main")

        done = await phase(spawner_a, modest_name, "Succeeded")
        state = status_of(done).state.terminated
        assert (state.reason, state.exit_code) == ("Completed", 0)
        output = await logged(cluster, NODE, modest_name, "allocated")
        # Every process of the container is in its cgroup, limited to its limit, swap too.
        assert output == f"limit={256 << 20}\nmemsw={256 << 20}\nallocated 32 MiB\n"

        await logged(cluster, NODE, killed_name, "started")
        command = [p for p in processes_with(token) if _argv0(p) == "python3"]
        assert len(command) == 1
        os.kill(command[0], signal.SIGKILL)
        failed = await phase(spawner_a, killed_name, "Failed")
        state = status_of(failed).state.terminated
        assert (state.reason, state.exit_code) == ("Error", 137)
    assert kubelet.memory_cgroups is not None
    root = kubelet.memory_cgroups.root

    async def removed() -> bool:
        return not any((root / uid).exists() for uid in uids)

    await eventually(removed, "the pods' memory cgroups removed", 5.0)


def _argv0(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return ""


# ------------------------------------------------------------------ peers by name
@contextlib.asynccontextmanager
async def headless_service(api: client.CoreV1Api, name: str, port: int) -> AsyncIterator[str]:
    """A headless Service ``name`` that selects the pods labelled ``job: <name>`` and
    publishes them before they are Ready, as a training job's; deleted afterwards."""
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "clusterIP": "None",
            "selector": {"job": name},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": port}],
        },
    }
    await api.create_namespaced_service(NAMESPACE, cast(client.V1Service, body))
    try:
        yield name
    finally:
        await api.delete_namespaced_service(name, NAMESPACE)


POD_IP_ENV = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
LISTEN = textwrap.dedent(
    """
    import os, socket, sys
    own = sys.argv[1]
    print("own name", socket.gethostbyname(own) == os.environ["POD_IP"], flush=True)
    server = socket.create_server((os.environ["POD_IP"], int(sys.argv[2])))
    print("listening", flush=True)
    peer, _ = server.accept()
    peer.sendall(b"hello from p0")
    peer.close()
    """
)
CONNECT = textwrap.dedent(
    """
    import socket, sys, time
    name, port = sys.argv[1], int(sys.argv[2])
    deadline, misses = time.monotonic() + 60, 0
    while True:
        try:
            with socket.create_connection((name, port), timeout=2) as peer:
                print("reached", socket.gethostbyname(name), peer.recv(64).decode(), flush=True)
                break
        except OSError as e:
            misses += 1
            if misses == 1:
                print("not yet:", type(e).__name__, flush=True)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    for short in sys.argv[3:]:
        print(short, socket.gethostbyname(short), flush=True)
    """
)


async def test_pods_reach_their_peers_by_name_through_a_headless_service(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    port = 29500  # torchrun's: every pod has an address of its own
    job = f"job-{uuid.uuid4().hex[:6]}"

    def member(index: int, node: str, command: list[str]) -> dict[str, Any]:
        body = manifest(
            f"{job}-p{index}",
            command,
            node=node,
            container={"env": POD_IP_ENV},
            hostname=f"p{index}",
            subdomain=job,
            securityContext={"runAsUser": 1000 + index},
        )
        body["metadata"]["labels"] = {"job": job}
        return body

    fqdn = f"p0.{job}.{NAMESPACE}.svc.cluster.local"
    short = [f"p0.{job}.{NAMESPACE}.svc", f"p0.{job}.{NAMESPACE}", f"p0.{job}"]
    p0 = member(0, NODE, ["python3", "-c", LISTEN, fqdn, str(port)])
    # On the other node: each kubelet answers its own pods' names.
    p1 = member(1, OTHER_NODE, ["python3", "-c", CONNECT, fqdn, str(port), *short])
    async with (
        headless_service(spawner_a, job, port),
        pods(spawner_a, p1) as (p1_name,),
    ):
        # p1 first: p0's name is unknown to it until p0 is admitted.
        await logged(cluster, OTHER_NODE, p1_name, "not yet")
        async with pods(spawner_a, p0) as (p0_name,):
            done = await phase(spawner_a, p0_name, "Succeeded")
            p0_ip = done.status.pod_ip
            own = await logged(cluster, NODE, p0_name, "listening")
            assert own == "own name True\nlistening\n"
            await phase(spawner_a, p1_name, "Succeeded")
            output = cluster.kubelet(OTHER_NODE).logs(NAMESPACE, p1_name, "main")
            assert f"reached {p0_ip} hello from p0\n" in output
            assert output.endswith("".join(f"{name} {p0_ip}\n" for name in short))


# ------------------------------------------------------------------ a script from a ConfigMap
async def test_a_config_map_volume_brings_the_chosen_keys_with_their_mode(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    name = f"script-{uuid.uuid4().hex[:6]}"
    script = "#!/usr/bin/env python3\nimport os\nprint('training as', os.getuid())\n"
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"train.py": script, "notes.txt": "not chosen"},
    }
    await spawner_a.create_namespaced_config_map(NAMESPACE, cast(client.V1ConfigMap, body))
    pod = manifest(
        "configmap",
        ["sh", "-c", "ls -R /job; stat -L -c %a /job/bin/train.py; /job/bin/train.py"],
        container={"volumeMounts": [{"name": "job", "mountPath": "/job", "readOnly": True}]},
        securityContext={"runAsUser": 1234, "runAsNonRoot": True},
        volumes=[
            {
                "name": "job",
                "configMap": {
                    "name": name,
                    "items": [{"key": "train.py", "path": "bin/train.py"}],
                    "defaultMode": 0o555,
                },
            }
        ],
    )
    try:
        async with pods(spawner_a, pod) as (pod_name,):
            await phase(spawner_a, pod_name, "Succeeded")
            # Only the chosen key, at its path, executable by the pod's user as defaultMode says.
            assert await logged(cluster, NODE, pod_name, "training") == (
                "/job:\nbin\n\n/job/bin:\ntrain.py\n555\ntraining as 1234\n"
            )
    finally:
        await spawner_a.delete_namespaced_config_map(name, NAMESPACE)


async def test_a_projected_volume_joins_a_config_map_and_the_pods_own_annotation(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    name = f"launcher-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"launch.sh": "echo launching\n"},
    }
    await spawner_a.create_namespaced_config_map(NAMESPACE, cast(client.V1ConfigMap, body))
    script = "print('from the annotation')\n"
    annotation = "metadata.annotations['example.org/script']"
    pod = manifest(
        "projected",
        ["sh", "-c", "ls /job; stat -L -c %a /job/train.py; sh /job/launch.sh; cat /job/train.py"],
        container={"volumeMounts": [{"name": "job", "mountPath": "/job", "readOnly": True}]},
        volumes=[
            {
                "name": "job",
                "projected": {
                    "defaultMode": 0o444,
                    "sources": [
                        {"configMap": {"name": name}},
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "train.py",
                                        "fieldRef": {"fieldPath": annotation},
                                    }
                                ]
                            }
                        },
                    ],
                },
            }
        ],
    )
    pod["metadata"]["annotations"] = {"example.org/script": script}
    try:
        async with pods(spawner_a, pod) as (pod_name,):
            await phase(spawner_a, pod_name, "Succeeded")
            assert await logged(cluster, NODE, pod_name, "from the annotation") == (
                f"launch.sh\ntrain.py\n444\nlaunching\n{script}"
            )
    finally:
        await spawner_a.delete_namespaced_config_map(name, NAMESPACE)


async def test_a_downward_api_file_follows_the_pods_annotation_while_it_runs(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    """As the kubelet does (how a kept job pod learns of its next attempt): the file is
    rewritten whole when the annotation changes."""
    cluster = kubelets[CLUSTER_A]
    annotation = "metadata.annotations['example.org/note']"
    waits = "until grep -q second /job/note; do sleep 0.1; done; echo saw; cat /job/note"
    pod = manifest(
        "follows",
        ["sh", "-c", f"cat /job/note; echo; {waits}"],
        container={"volumeMounts": [{"name": "job", "mountPath": "/job", "readOnly": True}]},
        volumes=[
            {
                "name": "job",
                "projected": {
                    "sources": [
                        {
                            "downwardAPI": {
                                "items": [{"path": "note", "fieldRef": {"fieldPath": annotation}}]
                            }
                        }
                    ]
                },
            }
        ],
    )
    pod["metadata"]["annotations"] = {"example.org/note": "first"}
    async with pods(spawner_a, pod) as (pod_name,):
        await logged(cluster, NODE, pod_name, "first")
        patch = {"metadata": {"annotations": {"example.org/note": "second"}}}
        await cast(Any, spawner_a).patch_namespaced_pod(
            pod_name, NAMESPACE, patch, _content_type="application/merge-patch+json"
        )
        await phase(spawner_a, pod_name, "Succeeded")
        assert await logged(cluster, NODE, pod_name, "saw") == "first\nsaw\nsecond"


async def test_a_failed_container_says_why_in_its_termination_message_when_asked(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    said = ["sh", "-c", "echo starting; echo 'rendezvous: the master never answered' >&2; exit 3"]
    asked = manifest(
        "fallback", said, container={"terminationMessagePolicy": "FallbackToLogsOnError"}
    )
    silent = manifest("silent", said)
    async with pods(spawner_a, asked, silent) as (asked_name, silent_name):
        ended = status_of(await phase(spawner_a, asked_name, "Failed")).state.terminated
        assert ended.exit_code == 3
        # Both streams' last lines; which pipe's line came last is the pumps' race.
        assert "rendezvous: the master never answered" in ended.message.splitlines()
        plain = status_of(await phase(spawner_a, silent_name, "Failed")).state.terminated
        assert not plain.message  # only a container that asks gets its output as the message
