"""What the test kubelet's tests share: the pods they run (:func:`manifest`, created and
deleted again by :func:`pods`), polling for a phase or for output, and reading a pod's
status as a user reads it (``kubectl get``, ``kubectl logs``, ``kubectl describe``)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .containers import CannotStart
from .control_plane import NAMESPACE, Cluster, ControlPlane
from .kube import eventually
from .tier import CLUSTER_A, in_ci

NODE = "a-gpu-1"
RUN_DEADLINE_S = 30.0
GONE_DEADLINE_S = 20.0


@contextlib.contextmanager
def runnable_kubelets(plane: ControlPlane) -> Iterator[ControlPlane]:
    """The tier, where its kubelets can run containers (skipped where the sandbox cannot
    run, failed under CI); afterwards none of their threads may have died of a bug. What
    each test module's ``kubelets`` fixture holds."""
    cluster = plane[CLUSTER_A]
    try:
        cluster.kubelet(NODE).settings.sandbox().support()
    except CannotStart as e:
        if in_ci():
            pytest.fail(f"CI=true and the test kubelet's sandbox cannot run here: {e}")
        pytest.skip(f"the test kubelet's sandbox cannot run here: {e}")
    yield plane
    problems = [p for c in plane.clusters.values() for k in c.kubelets.values() for p in k.problems]
    assert not problems, "\n".join(problems)


def manifest(
    prefix: str,
    command: list[str],
    *,
    node: str | None = NODE,
    restart: str = "Never",
    container: Mapping[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod running ``command`` (bound to ``node`` directly, or placed by the scheduler
    when None), with ``container`` and ``spec`` fields added."""
    main: dict[str, Any] = {"name": "main", "image": "busybox", "command": command}
    main.update(container or {})
    body: dict[str, Any] = {
        "containers": [main],
        "restartPolicy": restart,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
        **spec,
    }
    if node is not None:
        body["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{prefix}-{uuid.uuid4().hex[:6]}"},
        "spec": body,
    }


@contextlib.asynccontextmanager
async def pods(api: client.CoreV1Api, *bodies: dict[str, Any]) -> AsyncIterator[list[str]]:
    """Creates the pods (their names are the value); afterwards deletes them at once and
    waits until they are gone, so no pod or GPU outlives its test."""
    names = []
    try:
        for body in bodies:
            created = await api.create_namespaced_pod(NAMESPACE, cast(client.V1Pod, body))
            names.append(str(created.metadata.name))
        yield names
    finally:
        for name in names:
            with contextlib.suppress(ApiException):
                await api.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)

        async def gone() -> bool:
            present = {p.metadata.name for p in (await api.list_namespaced_pod(NAMESPACE)).items}
            return not present & set(names)

        await eventually(gone, f"pods {names} deleted", GONE_DEADLINE_S)


async def phase(
    api: client.CoreV1Api, name: str, *wanted: str, deadline_s: float = RUN_DEADLINE_S
) -> client.V1Pod:
    async def reached() -> client.V1Pod | None:
        pod = await api.read_namespaced_pod(name, NAMESPACE)
        return pod if pod.status.phase in wanted else None

    return await eventually(reached, f"pod {name} {' or '.join(wanted)}", deadline_s)


async def logged(cluster: Cluster, node: str, name: str, text: str, container: str = "main") -> str:
    """The container's output, once it holds ``text``."""

    async def output() -> str | None:
        try:
            found = cluster.kubelet(node).logs(NAMESPACE, name, container)
        except FileNotFoundError:
            return None
        return found if text in found else None

    return await eventually(output, f"{text!r} in the logs of {name}", RUN_DEADLINE_S)


def status_of(pod: client.V1Pod, container: str = "main") -> client.V1ContainerStatus:
    statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
    return next(s for s in statuses if s.name == container)


def condition(pod: client.V1Pod, kind: str) -> str | None:
    return next((c.status for c in pod.status.conditions or [] if c.type == kind), None)


async def event_reasons(api: client.CoreV1Api, name: str) -> list[str]:
    events = await api.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={name}"
    )
    return [e.reason for e in events.items]


def processes_with(token: str) -> list[int]:
    """Live processes whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
