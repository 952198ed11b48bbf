"""Fixtures of the Kubernetes tier: two real clusters on loopback while ``tests/k8s`` runs.

``k8s_tier`` starts them on first use (15-20 s on this two-core machine once built, most of
it the two API servers building their OpenAPI documents) and, being package-scoped, stops
every process and removes every file once the last test of this package has run: the rest
of the session does not share two cores with an idle control plane.

Without the binaries (``scripts/install --k8s`` not run) the tier's tests are skipped with a
message that says so, except under ``CI=true``, where they fail: CI must never pass without
having run them. A tier that is built but does not start fails everywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from kubernetes_asyncio import client

from .control_plane import (
    NAMESPACE,
    Cluster,
    ControlPlane,
    K8sUnavailable,
    find_binaries,
)
from .kube import kube_client
from .processes import TierStartError
from .tier import CLUSTER_A, CLUSTER_B, TIER_NODES, in_ci


@pytest.fixture(scope="package")
def k8s_tier() -> Iterator[ControlPlane]:
    """Both clusters, their fake GPU nodes Ready, each with its test kubelet
    (``cluster.kubelet(node)``), for the tests of this package."""
    try:
        binaries = find_binaries()
    except K8sUnavailable as e:
        if in_ci():
            pytest.fail(f"CI=true and {e}", pytrace=False)
        pytest.skip(str(e))
    try:
        plane = ControlPlane.start(binaries, dict(TIER_NODES))
    except TierStartError as e:
        pytest.fail(f"the Kubernetes tier did not start: {e}", pytrace=False)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def cluster_a(k8s_tier: ControlPlane) -> Cluster:
    return k8s_tier[CLUSTER_A]


@pytest.fixture
def cluster_b(k8s_tier: ControlPlane) -> Cluster:
    return k8s_tier[CLUSTER_B]


@pytest.fixture
async def admin_a(cluster_a: Cluster) -> AsyncIterator[client.CoreV1Api]:
    async with kube_client(cluster_a.kubeconfig("admin"), cluster_a.name) as api:
        yield client.CoreV1Api(api)


@pytest.fixture
async def admin_b(cluster_b: Cluster) -> AsyncIterator[client.CoreV1Api]:
    async with kube_client(cluster_b.kubeconfig("admin"), cluster_b.name) as api:
        yield client.CoreV1Api(api)


@pytest.fixture
async def spawner_a(cluster_a: Cluster) -> AsyncIterator[client.CoreV1Api]:
    """cluster-a as gpufleet's spawner, in its namespace."""
    async with kube_client(cluster_a.kubeconfig("spawner", NAMESPACE), cluster_a.name) as api:
        yield client.CoreV1Api(api)
