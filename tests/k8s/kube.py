"""The tier seen through ``kubernetes_asyncio``, the client gpufleet's Kubernetes backend uses:
an API client per cluster and identity, loaded from the tier's kubeconfig files as the
controller will load its own, and polling with a deadline (never a sleep as synchronisation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from kubernetes_asyncio import client, config

T = TypeVar("T")


@asynccontextmanager
async def kube_client(kubeconfig: Path, context: str) -> AsyncIterator[client.ApiClient]:
    """An API client for one context of a kubeconfig file, closed on exit."""
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kubeconfig), context=context, client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        yield api


async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    deadline_s: float,
    interval_s: float = 0.2,
) -> T:
    """Polls ``probe`` until it returns something other than None or False, and returns
    that; fails with ``what`` once ``deadline_s`` has passed."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = await probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s:.0f} s: {what}")
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def pod_in(api: client.CoreV1Api, namespace: str, pod: client.V1Pod) -> AsyncIterator[str]:
    """Creates ``pod`` (the value is its name) and afterwards deletes it and waits until it
    is gone. Grace 0 removes it at once, as no kubelet runs it: no pod, and none of the GPUs
    it asked for, outlives its test on the tier's shared nodes."""
    created = await api.create_namespaced_pod(namespace, pod)
    name = str(created.metadata.name)
    try:
        yield name
    finally:
        await api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

        async def gone() -> bool:
            pods = await api.list_namespaced_pod(namespace)
            return name not in {p.metadata.name for p in pods.items}

        await eventually(gone, f"pod {name} deleted", 30.0)
