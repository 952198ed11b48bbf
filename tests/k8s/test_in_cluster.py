"""A controller that runs in a pod of its cluster (``in_cluster: True``): its credentials
are the pod's service account files and the API server's address is in its environment.

The process runs in a mount namespace of its own whose /run holds the service account's
token and CA where Kubernetes mounts them (/var/run/secrets/kubernetes.io/serviceaccount),
with the controller identity's token; it lists the cluster's nodes through gpufleet's own
client loading. Needs root (mount namespaces), as the tier's kubelets do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .control_plane import Cluster
from .tier import CLUSTER_A, TIER_NODES

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root"),
]

LIST_NODES = textwrap.dedent(
    """
    import asyncio, sys
    from kubernetes_asyncio import client
    from gpufleet.clusters.kube_config import ClusterConfigError, api_client, parse_clusters

    async def main() -> None:
        (settings,) = parse_clusters([{"name": "here", "in_cluster": True}])
        try:
            api = await api_client(settings)
        except ClusterConfigError as e:
            print("error:", e)
            return
        async with api:
            nodes = await client.CoreV1Api(api).list_node()
        print("nodes:", len(nodes.items))

    asyncio.run(main())
    """
)


def run_in_pod(account: Path | None, env: dict[str, str]) -> str:
    """LIST_NODES in a mount namespace whose /run has ``account`` as the pod's service
    account directory (none if None)."""
    mount = "mount -t tmpfs tmpfs /run"
    if account is not None:
        target = "/run/secrets/kubernetes.io/serviceaccount"
        mount += f" && mkdir -p {target} && cp {account}/token {account}/ca.crt {target}/"
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mount} && exec "$0" -c "$1"',
            sys.executable,
            LIST_NODES,
        ],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_in_cluster_credentials_reach_the_api_server(cluster_a: Cluster, tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(cluster_a.identities["controller"].token)
    (account / "ca.crt").write_bytes(cluster_a.ca.cert_path.read_bytes())
    address = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(cluster_a.ports["apiserver"]),
    }
    assert run_in_pod(account, address) == f"nodes: {len(TIER_NODES[CLUSTER_A])}"

    # Not in a pod: no service account, or no address. The message names the cluster.
    missing = run_in_pod(None, address)
    assert missing.startswith("error: cluster 'here': cannot load the in-cluster service account")
    assert "here" in run_in_pod(account, {}) and run_in_pod(account, {}).startswith("error:")
