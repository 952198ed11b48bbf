"""A real hub whose sessions are pods on the tier's two clusters (KubeGPUSpawner)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from gpufleet.clusters.manifests import priority_class

from ..integration.harness import Hub
from .control_plane import NAMESPACE, ControlPlane
from .tier import CLUSTER_A, CLUSTER_B

KUBE_CONFIG = """
c.JupyterHub.spawner_class = "gpufleet.spawner.kubernetes.KubeGPUSpawner"
c.FleetController.clusters = {controller!r}
c.KubeGPUSpawner.clusters = {spawner!r}
c.KubeGPUSpawner.image = "gpufleet/session:test"  # the test kubelets run the base env
c.KubeGPUSpawner.termination_grace_seconds = 5
c.KubeGPUSpawner.lease_renew_interval = 1
c.KubeInventory.probe_interval = 1
c.KubeInventory.node_lost_grace_seconds = 2
c.KubeInventory.unreachable_after = 3
"""

# The GPUs are the clusters' own: no node agent declares GPUs of this machine.
WITHOUT_AGENT = """
c.JupyterHub.services = [s for s in c.JupyterHub.services if s["name"] != "gpufleet-agent"]
c.JupyterHub.load_roles = [r for r in c.JupyterHub.load_roles if r["name"] != "gpufleet-agent"]
"""


def make_kube_hub(
    plane: ControlPlane,
    root: Path,
    extra_config: str = "",
    controller_clusters: list[dict[str, Any]] | None = None,
) -> Hub:
    """A hub (not started) under ``root``: the controller watches both clusters (through
    ``controller_clusters`` if given), the spawner creates pods as its own identity."""
    for cluster in plane.clusters.values():
        with cluster.rest() as api:
            made = api.post(
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                json=priority_class("gpufleet-session", 1000, "gpufleet sessions"),
            )
            assert made.status_code in (201, 409), made.text
    controller = controller_clusters or [
        {"name": name, "kubeconfig": str(plane.kubeconfig), "context": name}
        for name in (CLUSTER_A, CLUSTER_B)
    ]
    spawner = [
        {
            "name": name,
            "kubeconfig": str(plane[name].kubeconfig("spawner", NAMESPACE)),
            "namespace": NAMESPACE,
        }
        for name in (CLUSTER_A, CLUSTER_B)
    ]
    config = textwrap.dedent(KUBE_CONFIG).format(controller=controller, spawner=spawner)
    return Hub.create(root, config + textwrap.dedent(extra_config))


def node_homes_config(homes: Path) -> str:
    """Config for sessions whose homes stay on their node (a hostPath under ``homes``,
    one directory per user), which the node agent snapshots."""
    volume = {
        "name": "home",
        "kind": "hostPath",
        "source": f"{homes}/{{username}}",
        "mount_path": "/home/jovyan",
    }
    return f"""
c.KubeGPUSpawner.session_volumes = [{volume!r}]
c.KubeGPUSpawner.snapshot_volumes = ["home"]
c.KubeGPUSpawner.environment = {{"HOME": "/home/jovyan"}}
"""
