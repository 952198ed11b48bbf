"""The test kubelet: pods bound to a fake node really run, in gpufleet's sandbox, and their
status, GPUs, addresses, volumes and ends are what a real kubelet would report.

Each test talks to the cluster as gpufleet's spawner does (kubernetes_asyncio, the spawner
identity in its namespace) and checks what a user would notice: phases, exit codes, Ready,
events, the pod's output, its GPUs, the address it answers on, the uid it runs as, files it
wrote, how quickly it goes. The first tests check the pure rules the kubelet follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .control_plane import NAMESPACE, NODE_MONITOR_GRACE_S, ControlPlane
from .kube import eventually
from .kubelet_helpers import (
    GONE_DEADLINE_S,
    NODE,
    RUN_DEADLINE_S,
    condition,
    event_reasons,
    logged,
    manifest,
    phase,
    pods,
    processes_with,
    runnable_kubelets,
    status_of,
)
from .nodes import GPU_RESOURCE, NOT_READY_TAINTS, NodeSpec
from .podspec import AdmissionError, allocate_devices, expand, pod_phase
from .tier import CLUSTER_A

pytestmark = pytest.mark.k8s

NOT_READY_DEADLINE_S = NODE_MONITOR_GRACE_S + 20.0
MIG_RESOURCE = "nvidia.com/mig-1g.10gb"
NOT_READY_TOLERATIONS = [
    {"key": key, "operator": "Exists", "effect": "NoExecute"}
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
]


# ------------------------------------------------------------------ the rules, without a tier
def test_expansion_is_kubernetes() -> None:
    env = {"VAR_A": "A", "VAR_B": "B", "EMPTY": ""}
    assert expand("$(VAR_A)-$(VAR_B)", env) == "A-B"
    assert expand("$$(VAR_A)", env) == "$(VAR_A)"  # escaped
    assert expand("$$$(VAR_A)", env) == "$A"
    assert expand("$(UNKNOWN) $(VAR_A", env) == "$(UNKNOWN) $(VAR_A"  # left as written
    assert expand("$VAR_A $ $(EMPTY)x $()", env) == "$VAR_A $ x $()"
    assert expand("--ip=$(GPUFLEET_POD_IP)", {"GPUFLEET_POD_IP": "127.9.0.1"}) == "--ip=127.9.0.1"


def test_devices_are_handed_out_as_the_device_manager_does() -> None:
    def pod(*wanted: int, init: int = 0, resource: str = GPU_RESOURCE) -> dict[str, Any]:
        def container(name: str, n: int) -> dict[str, Any]:
            return {"name": name, "resources": {"limits": {resource: str(n)}} if n else {}}

        return {
            "spec": {
                "initContainers": [container("init", init)] if init else [],
                "containers": [container(f"c{i}", n) for i, n in enumerate(wanted)],
            }
        }

    served = {GPU_RESOURCE: ("g0", "g1", "g2", "g3"), "nvidia.com/mig-1g.10gb": ("MIG-a", "MIG-b")}
    # App containers get distinct GPUs; an init container reuses the pod's first ones.
    got = allocate_devices(pod(1, 2, init=2), served, held={"g0"})
    assert got == {"init": ("g1", "g2"), "c0": ("g1",), "c1": ("g2", "g3")}
    assert allocate_devices(pod(0), served, held=set()) == {"c0": ()}
    mig = allocate_devices(pod(2, resource="nvidia.com/mig-1g.10gb"), served, held=set())
    assert mig == {"c0": ("MIG-a", "MIG-b")}
    with pytest.raises(AdmissionError) as refused:
        allocate_devices(pod(3), served, held={"g1", "g2"})
    assert str(refused.value) == (
        "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. "
        "Requested: 3, Available: 2, which is unexpected"
    )


def test_phase_follows_the_kubelets_rules() -> None:
    def terminated(code: int) -> dict[str, Any]:
        return {"state": {"terminated": {"exitCode": code}}}

    running: dict[str, Any] = {"state": {"running": {}}}
    waiting: dict[str, Any] = {"state": {"waiting": {"reason": "ContainerCreating"}}}
    crashed: dict[str, Any] = {
        "state": {"waiting": {}},
        "lastState": {"terminated": {"exitCode": 1}},
    }
    assert pod_phase("Never", [], ["a"], {"a": waiting}) == "Pending"
    assert pod_phase("Never", [], ["a"], {"a": running}) == "Running"
    assert pod_phase("Never", [], ["a", "b"], {"a": terminated(0), "b": terminated(0)}) == (
        "Succeeded"
    )
    assert pod_phase("Never", [], ["a", "b"], {"a": terminated(0), "b": terminated(2)}) == "Failed"
    assert pod_phase("OnFailure", [], ["a"], {"a": crashed}) == "Running"
    assert pod_phase("Always", [], ["a"], {"a": terminated(0)}) == "Running"
    assert pod_phase("Never", ["i"], ["a"], {"i": terminated(1), "a": waiting}) == "Failed"
    assert pod_phase("OnFailure", ["i"], ["a"], {"i": terminated(1), "a": waiting}) == "Pending"


# ------------------------------------------------------------------ fixtures
@pytest.fixture
def kubelets(k8s_tier: ControlPlane) -> Iterator[ControlPlane]:
    with runnable_kubelets(k8s_tier) as plane:
        yield plane


# ------------------------------------------------------------------ running pods
async def test_a_pod_runs_and_reports_its_exit_code_and_phase(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    # With the default service account's token, as most pods have it: a secret volume.
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    ok = manifest(
        "ok",
        ["sh", "-c", f"echo hello from $HOSTNAME in $(cat {token_dir}/namespace)"],
        node=None,
        automountServiceAccountToken=True,
    )
    failing = manifest("fails", ["sh", "-c", "echo about to fail >&2; exit 3"])
    async with pods(spawner_a, ok, failing) as (ok_name, failing_name):
        done = await phase(spawner_a, ok_name, "Succeeded")
        state = status_of(done).state.terminated
        assert (state.exit_code, state.reason) == (0, "Completed")
        assert condition(done, "Ready") == "False"
        assert condition(done, "Initialized") == "True"
        node = done.spec.node_name  # placed by the real scheduler
        output = await logged(cluster, node, ok_name, "hello")
        assert output == f"hello from {ok_name} in {NAMESPACE}\n"

        # The scheduler's event, then the kubelet's, as `kubectl describe` shows them (the
        # scheduler's event recorder posts on its own time, maybe after the pod ran).
        async def all_reported() -> bool:
            reasons = await event_reasons(spawner_a, ok_name)
            return {"Scheduled", "Pulled", "Created", "Started"} <= set(reasons)

        await eventually(all_reported, f"the events of {ok_name}", 30)

        failed = await phase(spawner_a, failing_name, "Failed")
        state = status_of(failed).state.terminated
        assert (state.exit_code, state.reason) == (3, "Error")
        assert "about to fail" in await logged(cluster, NODE, failing_name, "fail")


async def test_init_containers_run_first_and_a_failed_one_fails_the_pod(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    shared = {"volumeMounts": [{"name": "work", "mountPath": "/work"}]}

    def init(name: str, script: str) -> dict[str, Any]:
        return {"name": name, "image": "busybox", "command": ["sh", "-c", script], **shared}

    ordered = manifest(
        "inits",
        ["cat", "/work/order"],
        container=shared,
        initContainers=[
            init("first", "echo one > /work/order"),
            init("second", "echo two >> /work/order"),
        ],
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    broken = manifest(
        "broken-init",
        ["echo", "never"],
        initContainers=[init("setup", "exit 7")],
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    # OnFailure: a container that fails is run again, and its restarts are counted.
    retried = manifest(
        "retried",
        ["sh", "-c", "test -e /work/tried && echo second try || { touch /work/tried; exit 1; }"],
        restart="OnFailure",
        container=shared,
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    async with pods(spawner_a, ordered, broken, retried) as (name, broken_name, retried_name):
        done = await phase(spawner_a, name, "Succeeded")
        assert await logged(cluster, NODE, name, "two") == "one\ntwo\n"
        for init_name in ("first", "second"):
            assert status_of(done, init_name).state.terminated.exit_code == 0

        failed = await phase(spawner_a, broken_name, "Failed")
        assert status_of(failed, "setup").state.terminated.exit_code == 7
        assert status_of(failed).state.waiting.reason == "PodInitializing"
        assert cluster.kubelet(NODE).logs(NAMESPACE, broken_name, "main") == ""

        again = await phase(spawner_a, retried_name, "Succeeded")
        assert status_of(again).restart_count == 1
        assert status_of(again).last_state.terminated.exit_code == 1
        assert "second try" in cluster.kubelet(NODE).logs(NAMESPACE, retried_name, "main")


async def test_gpu_pods_get_distinct_gpus_of_their_node_and_too_many_fail_admission(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    node_gpus = set(cluster.nodes[NODE].gpu_uuids)
    script = (
        'echo "visible=$NVIDIA_VISIBLE_DEVICES"; '
        'python -c "import pynvml as n; n.nvmlInit(); '
        "print('nvml=' + ','.join(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i)) "
        'for i in range(n.nvmlDeviceGetCount())))"; exec sleep 600'
    )
    one_gpu = {"resources": {"limits": {GPU_RESOURCE: "1"}}}
    first = manifest("gpu", ["sh", "-c", script], container=one_gpu)
    second = manifest("gpu", ["sh", "-c", script], container=one_gpu)
    too_many = manifest(
        "greedy", ["true"], container={"resources": {"limits": {GPU_RESOURCE: "3"}}}
    )
    async with pods(spawner_a, first, second) as names:
        seen = {}
        for name in names:
            await phase(spawner_a, name, "Running")
            output = await logged(cluster, NODE, name, "nvml=")
            lines = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
            seen[name] = lines["visible"]
            assert lines["nvml"] == lines["visible"]  # NVML in the pod shows exactly its GPU
        assert len(set(seen.values())) == 2
        assert set(seen.values()) <= node_gpus

        async with pods(spawner_a, too_many) as (greedy,):
            refused = await phase(spawner_a, greedy, "Failed")
            assert refused.status.reason == "UnexpectedAdmissionError"
            assert refused.status.message == (
                "Pod Allocate failed due to requested number of devices unavailable for "
                "nvidia.com/gpu. Requested: 3, Available: 2, which is unexpected"
            )
            assert "UnexpectedAdmissionError" in await event_reasons(spawner_a, greedy)


async def test_a_pod_serves_on_its_own_ip_and_its_readiness_probe_makes_it_ready(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    port = 8000 + uuid.uuid4().int % 1000
    server = manifest(
        "web",
        ["python3", "-m", "http.server", "--bind", "$(GPUFLEET_POD_IP)", str(port)],
        container={
            "env": [
                {
                    "name": "GPUFLEET_POD_IP",
                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                }
            ],
            "ports": [{"name": "http", "containerPort": port}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        },
    )
    async with pods(spawner_a, server) as (name,):

        async def ready() -> client.V1Pod | None:
            pod = await spawner_a.read_namespaced_pod(name, NAMESPACE)
            return pod if condition(pod, "Ready") == "True" else None

        pod = await eventually(ready, f"pod {name} Ready", RUN_DEADLINE_S)
        ip = pod.status.pod_ip
        assert ip.startswith("127.") and ip != "127.0.0.1"
        assert [a.ip for a in pod.status.pod_ips] == [ip]
        assert status_of(pod).ready and status_of(pod).state.running is not None
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://{ip}:{port}/")).status_code == 200
            with pytest.raises(httpx.ConnectError):  # it bound its own address only
                await http.get(f"http://127.0.0.1:{port}/")


async def test_a_pod_runs_as_its_run_as_user_with_its_environment(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    env = {
        "securityContext": {"runAsGroup": 4321},  # the container's over the pod's
        "env": [
            {"name": "WHO", "value": "world"},
            {"name": "GREETING", "value": "hello-$(WHO)"},
            *(
                {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                for name, path in (
                    ("POD_NAME", "metadata.name"),
                    ("POD_NAMESPACE", "metadata.namespace"),
                    ("POD_UID", "metadata.uid"),
                    ("NODE_NAME", "spec.nodeName"),
                )
            ),
        ],
    }
    user = {"runAsUser": 1234, "runAsGroup": 1, "runAsNonRoot": True}
    # $(id -u) is no variable of the container: Kubernetes leaves it to the shell.
    script = 'echo "uid=$(id -u) gid=$(id -g) $0"'
    probe = manifest(
        "who",
        ["sh", "-c", script, "$(GREETING) $$(GREETING)"],
        container=env,
        securityContext=user,
    )
    env_dump = manifest("env", ["sh", "-c", "env | sort"], container=env, securityContext=user)
    root = manifest("root", ["true"], securityContext={"runAsUser": 0, "runAsNonRoot": True})
    unknown = manifest("unknown-user", ["true"], securityContext={"runAsNonRoot": True})
    async with pods(spawner_a, probe, env_dump, root, unknown) as (
        name,
        env_name,
        root_name,
        unknown_name,
    ):
        done = await phase(spawner_a, name, "Succeeded")
        output = await logged(cluster, NODE, name, "uid=")
        assert output == "uid=1234 gid=4321 hello-world $(GREETING)\n"
        seen = dict(
            line.split("=", 1)
            for line in (await logged(cluster, NODE, env_name, "POD_UID=")).splitlines()
        )
        created = await spawner_a.read_namespaced_pod(env_name, NAMESPACE)
        assert seen["POD_NAME"] == env_name
        assert seen["POD_NAMESPACE"] == NAMESPACE
        assert seen["POD_UID"] == created.metadata.uid
        assert seen["NODE_NAME"] == NODE
        assert seen["NVIDIA_VISIBLE_DEVICES"] == "void"  # asked for no GPU, sees none
        assert done.status.phase == "Succeeded"

        for refused, message in (
            (root_name, "container's runAsUser breaks non-root policy"),
            (unknown_name, "container has runAsNonRoot and image will run as root"),
        ):

            async def config_error(
                pod_name: str = refused,
            ) -> client.V1ContainerStateWaiting | None:
                pod = await spawner_a.read_namespaced_pod(pod_name, NAMESPACE)
                statuses = pod.status.container_statuses or []
                waiting = statuses[0].state.waiting if statuses else None
                ok = waiting is not None and waiting.reason == "CreateContainerConfigError"
                return waiting if ok else None

            waiting = await eventually(config_error, f"{refused} refused", RUN_DEADLINE_S)
            assert waiting.message.startswith(message)
            assert (
                await spawner_a.read_namespaced_pod(refused, NAMESPACE)
            ).status.phase == "Pending"
            assert "Failed" in await event_reasons(spawner_a, refused)


@contextlib.asynccontextmanager
async def static_claim(
    admin: client.CoreV1Api, spawner: client.CoreV1Api, path: Path
) -> AsyncIterator[str]:
    """A static hostPath PersistentVolume of ``path`` and a claim bound to it (its name is
    the value), as an admin provides storage where there is no provisioner; both are
    deleted afterwards."""
    suffix = uuid.uuid4().hex[:6]
    volume, claim = f"static-{suffix}", f"claim-{suffix}"
    await admin.create_persistent_volume(
        cast(
            client.V1PersistentVolume,
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": str(path)},
                },
            },
        ),
    )
    try:
        await spawner.create_namespaced_persistent_volume_claim(
            NAMESPACE,
            cast(
                client.V1PersistentVolumeClaim,
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": claim},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": "",
                        "volumeName": volume,
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                },
            ),
        )
        try:

            async def bound() -> bool:
                found = await spawner.read_namespaced_persistent_volume_claim(claim, NAMESPACE)
                return bool(found.status.phase == "Bound")

            await eventually(bound, f"claim {claim} bound", RUN_DEADLINE_S)
            yield claim
        finally:
            await spawner.delete_namespaced_persistent_volume_claim(claim, NAMESPACE)
    finally:
        await admin.delete_persistent_volume(volume)


async def test_host_path_and_static_persistent_volumes_are_mounted_where_asked(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api, admin_a: client.CoreV1Api, tmp_path: Path
) -> None:
    cluster = kubelets[CLUSTER_A]
    shared, claimed, fixed = tmp_path / "shared", tmp_path / "claimed", tmp_path / "fixed"
    for directory in (shared, claimed, fixed):
        directory.mkdir()
        os.chmod(directory, 0o777)
    (claimed / "in").write_text("from the claim\n")
    os.chmod(claimed / "in", 0o666)
    (fixed / "in").write_text("read-only\n")
    script = (
        "echo written > /data/out && cat /claimed/in && echo more >> /claimed/in && "
        "cat /fixed/in && { touch /fixed/x 2>/dev/null && echo writable || echo refused; }"
    )
    unsupported = manifest(
        "nfs",
        ["true"],
        volumes=[{"name": "remote", "nfs": {"server": "nfs.example", "path": "/export"}}],
    )
    async with static_claim(admin_a, spawner_a, claimed) as claim:
        pod = manifest(
            "volumes",
            ["sh", "-c", script],
            node=None,  # placed by the scheduler, which checks the claim
            container={
                "securityContext": {"runAsUser": 1500},
                "volumeMounts": [
                    {"name": "data", "mountPath": "/data"},
                    {"name": "claim", "mountPath": "/claimed"},
                    {"name": "fixed", "mountPath": "/fixed", "readOnly": True},
                ],
            },
            volumes=[
                {"name": "data", "hostPath": {"path": str(shared), "type": "Directory"}},
                {"name": "claim", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "fixed", "hostPath": {"path": str(fixed)}},
            ],
        )
        async with pods(spawner_a, pod, unsupported) as (name, nfs_name):
            done = await phase(spawner_a, name, "Succeeded")
            output = await logged(cluster, done.spec.node_name, name, "refused")
            assert output == "from the claim\nread-only\nrefused\n"
            assert (shared / "out").read_text() == "written\n"
            assert (shared / "out").stat().st_uid == 1500  # written as the pod's user
            assert (claimed / "in").read_text() == "from the claim\nmore\n"
            assert not (fixed / "x").exists()

            failed = await phase(spawner_a, nfs_name, "Failed")
            assert 'volume "remote" is of kind nfs' in failed.status.message
            assert "FailedMount" in await event_reasons(spawner_a, nfs_name)


# ------------------------------------------------------------------ ends
async def test_deletion_sends_sigterm_and_the_pod_is_gone_within_its_grace(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api, tmp_path: Path
) -> None:
    os.chmod(tmp_path, 0o777)
    token = f"graceful-{uuid.uuid4().hex}"
    script = (
        "trap 'echo got SIGTERM > /out/term; exit 0' TERM; echo started; "
        "while true; do sleep 0.1; done"
    )
    pod = manifest(
        "graceful",
        ["sh", "-c", script, token],
        container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
        volumes=[{"name": "out", "hostPath": {"path": str(tmp_path)}}],
    )
    async with pods(spawner_a, pod) as (name,):
        await phase(spawner_a, name, "Running")
        await logged(kubelets[CLUSTER_A], NODE, name, "started")
        assert processes_with(token)
        began = time.monotonic()
        await spawner_a.delete_namespaced_pod(name, NAMESPACE)  # its grace: 30 s

        async def gone() -> bool:
            try:
                await spawner_a.read_namespaced_pod(name, NAMESPACE)
            except ApiException as e:
                return e.status == 404
            return False

        await eventually(gone, f"pod {name} deleted by its kubelet", GONE_DEADLINE_S)
        assert time.monotonic() - began < 10  # it ended on SIGTERM, long before its grace
        assert (tmp_path / "term").read_text() == "got SIGTERM\n"
        assert not processes_with(token)
        reasons = await event_reasons(spawner_a, name)
        assert "Killing" in reasons


async def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(
    kubelets: ControlPlane, spawner_a: client.CoreV1Api
) -> None:
    token = f"stubborn-{uuid.uuid4().hex}"
    grace = 2
    pod = manifest(
        "stubborn",
        ["sh", "-c", "trap '' TERM; echo started; while true; do sleep 0.1; done", token],
    )
    async with pods(spawner_a, pod) as (name,):
        await phase(spawner_a, name, "Running")
        await logged(kubelets[CLUSTER_A], NODE, name, "started")
        began = time.monotonic()
        await spawner_a.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=grace)

        async def gone() -> bool:
            try:
                await spawner_a.read_namespaced_pod(name, NAMESPACE)
            except ApiException as e:
                return e.status == 404
            return False

        await eventually(gone, f"pod {name} deleted by its kubelet", GONE_DEADLINE_S)
        assert time.monotonic() - began >= grace
        assert not processes_with(token)


async def test_a_paused_kubelet_makes_its_node_not_ready_and_resuming_makes_it_ready(
    kubelets: ControlPlane, admin_a: client.CoreV1Api, spawner_a: client.CoreV1Api
) -> None:
    cluster = kubelets[CLUSTER_A]
    # A node of its own, so the shared nodes stay Ready; it serves a MIG-style resource too.
    spec = NodeSpec(cluster.spare_node_name(), "zone-a", gpus=1)
    slices = {GPU_RESOURCE: spec.gpu_uuids, MIG_RESOURCE: ("MIG-0b7e1c2a-test",)}
    node = await asyncio.to_thread(cluster.add_node, spec, True, slices)
    kubelet = cluster.kubelet(node.name)

    async def node_ready() -> str:
        n = await admin_a.read_node(node.name)
        ready = next(c.status for c in n.status.conditions if c.type == "Ready")
        return f"{ready} {sorted(_taints(n) & NOT_READY_TAINTS)}"

    async def pod_ready(name: str) -> str | None:
        return condition(await spawner_a.read_namespaced_pod(name, NAMESPACE), "Ready")

    try:
        assert (await admin_a.read_node(node.name)).status.allocatable[MIG_RESOURCE] == "1"
        # Both tolerate the node's taints, so the taint manager does not evict them.
        steady = manifest(
            "steady", ["sleep", "600"], node=node.name, tolerations=NOT_READY_TOLERATIONS
        )
        later = manifest(
            "later",
            ["sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES"],
            node=node.name,
            tolerations=NOT_READY_TOLERATIONS,
            container={"resources": {"limits": {MIG_RESOURCE: "1"}}},
        )
        async with pods(spawner_a, steady) as (steady_name,):
            await eventually(lambda: _is(pod_ready(steady_name), "True"), "steady Ready", 30.0)
            await asyncio.to_thread(kubelet.pause)
            async with pods(spawner_a, later) as (later_name,):
                unreachable = "Unknown ['node.kubernetes.io/unreachable']"
                await eventually(
                    lambda: _is(node_ready(), unreachable), "NotReady", NOT_READY_DEADLINE_S
                )
                # The node-lifecycle controller marks its pods not Ready; a paused kubelet
                # has started nothing of the pod that came meanwhile.
                await eventually(lambda: _is(pod_ready(steady_name), "False"), "not Ready", 10.0)
                pending = await spawner_a.read_namespaced_pod(later_name, NAMESPACE)
                assert pending.status.phase == "Pending" and not pending.status.container_statuses

                await asyncio.to_thread(kubelet.resume)
                await eventually(
                    lambda: _is(node_ready(), "True []"), "Ready", NOT_READY_DEADLINE_S
                )
                await eventually(lambda: _is(pod_ready(steady_name), "True"), "Ready again", 30.0)
                await phase(spawner_a, later_name, "Succeeded")
                assert kubelet.logs(NAMESPACE, later_name, "main") == "MIG-0b7e1c2a-test\n"
    finally:
        await asyncio.to_thread(cluster.remove_node, node.name)


async def _is(value: Awaitable[object], wanted: object) -> bool:
    return await value == wanted


def _taints(node: client.V1Node) -> set[str]:
    return {t.key for t in node.spec.taints or []}
