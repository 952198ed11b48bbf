"""The tier's self-tests, access: each API server answers its own tokens only, RBAC and
NodeRestriction refuse what an identity was not granted, the combined kubeconfig reaches both
clusters, and the clusters share nothing."""

from __future__ import annotations

import uuid

import httpx
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .control_plane import NAMESPACE, Cluster, ControlPlane
from .kube import kube_client, pod_in
from .pki import trust
from .tier import CLUSTER_A, CLUSTER_B, TIER_NODES

pytestmark = pytest.mark.k8s


async def test_each_api_server_answers_its_own_tokens(k8s_tier: ControlPlane) -> None:
    for name, cluster in k8s_tier.clusters.items():
        async with kube_client(cluster.kubeconfig("admin"), name) as api:
            version = await client.VersionApi(api).get_code()
            nodes = await client.CoreV1Api(api).list_node()
        assert version.git_version == "v1.20.2"
        assert {n.metadata.name for n in nodes.items} == {s.name for s in TIER_NODES[name]}


def test_a_token_is_an_identity_in_its_own_cluster_only(k8s_tier: ControlPlane) -> None:
    a, b = k8s_tier[CLUSTER_A], k8s_tier[CLUSTER_B]
    foreign = {"Authorization": f"Bearer {a.identities['admin'].token}"}
    r = httpx.get(f"{b.server}/api/v1/nodes", headers=foreign, verify=trust(b.ca.cert_path))
    assert r.status_code == 401
    # No anonymous access, no insecure port: a request without a token is refused too.
    r = httpx.get(f"{b.server}/api/v1/nodes", verify=trust(b.ca.cert_path))
    assert r.status_code == 401


async def test_rbac_grants_each_identity_only_its_own_rights(cluster_a: Cluster) -> None:
    async with kube_client(cluster_a.kubeconfig("spawner", NAMESPACE), cluster_a.name) as api:
        spawner = client.CoreV1Api(api)
        assert (await spawner.list_namespaced_pod(NAMESPACE)).items is not None
        with pytest.raises(ApiException) as denied:
            await spawner.list_secret_for_all_namespaces()
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            await spawner.list_namespaced_pod("kube-system")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            await spawner.list_node()
        assert denied.value.status == 403

    async with kube_client(cluster_a.kubeconfig("controller"), cluster_a.name) as api:
        controller = client.CoreV1Api(api)
        assert len((await controller.list_node()).items) == len(TIER_NODES[CLUSTER_A])
        assert (await controller.list_pod_for_all_namespaces()).items is not None
        # Training jobs' pods in gpufleet's namespace, and nowhere else.
        with pytest.raises(ApiException) as denied:
            await controller.create_namespaced_pod("default", _pod("not-allowed"))
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            await controller.list_secret_for_all_namespaces()
        assert denied.value.status == 403


def test_a_kubelet_may_change_only_its_own_node(cluster_a: Cluster) -> None:
    own, other = cluster_a.nodes["a-gpu-1"], cluster_a.nodes["a-gpu-2"]
    patch = {"metadata": {"labels": {"example.com/touched": "yes"}}}
    headers = {"Content-Type": "application/merge-patch+json"}
    with own.client() as kubelet:
        assert kubelet.patch(f"/api/v1/nodes/{own.name}", json=patch, headers=headers).is_success
        r = kubelet.patch(f"/api/v1/nodes/{other.name}", json=patch, headers=headers)
        assert r.status_code == 403, r.text
        # Nor may it touch another node's lease.
        r = kubelet.patch(
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{other.name}",
            json={"spec": {"holderIdentity": own.name}},
            headers=headers,
        )
        assert r.status_code == 403, r.text
        undo = {"metadata": {"labels": {"example.com/touched": None}}}
        assert kubelet.patch(f"/api/v1/nodes/{own.name}", json=undo, headers=headers).is_success


async def test_combined_kubeconfig_reaches_both_clusters_as_the_controller(
    k8s_tier: ControlPlane,
) -> None:
    seen = {}
    for name in (CLUSTER_A, CLUSTER_B):
        async with kube_client(k8s_tier.kubeconfig, name) as api:
            nodes = await client.CoreV1Api(api).list_node()
            seen[name] = {n.metadata.name for n in nodes.items}
            with pytest.raises(ApiException) as denied:
                await client.CoreV1Api(api).list_secret_for_all_namespaces()
            assert denied.value.status == 403  # the controller's identity, not an admin
    assert seen == {name: {s.name for s in specs} for name, specs in TIER_NODES.items()}


async def test_clusters_are_independent(
    admin_a: client.CoreV1Api, admin_b: client.CoreV1Api
) -> None:
    async with pod_in(admin_a, NAMESPACE, _pod(f"only-in-a-{uuid.uuid4().hex[:8]}")) as name:
        assert (await admin_a.read_namespaced_pod(name, NAMESPACE)).metadata.name == name
        with pytest.raises(ApiException) as missing:
            await admin_b.read_namespaced_pod(name, NAMESPACE)
        assert missing.value.status == 404
        assert name not in {
            p.metadata.name for p in (await admin_b.list_pod_for_all_namespaces()).items
        }


def _pod(name: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="main", image="busybox", command=["true"])],
            automount_service_account_token=False,
        ),
    )
