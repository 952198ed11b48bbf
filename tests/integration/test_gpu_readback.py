"""The GPU read-back end to end: a real hub, controller and node agent (fake NVML).

On Kubernetes a pod's GPUs are chosen by the device plugin, which the local spawner cannot
imitate: its sessions get exactly the GPUs admitted. So the test plays the container by
hand: it asks the controller for a session as the spawner does (with a process marker),
then starts a process carrying that marker whose ``NVIDIA_VISIBLE_DEVICES`` names another
GPU of the node, as a container runtime would have set it. The agent reads it back and
the controller records the session on that GPU; the agent's metrics follow.

A hub of its own: the agent reads back every ``placement_interval`` (0.5 s here), and the
reconciler must leave the hand-made session alone while the test runs (the shared hub's
3-second grace would end its process as a stray one).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.agent.gpus import declared_gpu_uuid
from gpufleet.recovery.processes import MARKER_VARIABLE

from ..exposition import parse
from .harness import Hub, wait_for

pytestmark = pytest.mark.integration

CONFIG = """
c.NodeAgent.placement_interval = 0.5
c.Reconciling.grace = 300
"""


@pytest.fixture(scope="module")
def readback_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    instance = Hub.create(Path(tmp_path_factory.mktemp("readback")), CONFIG)
    instance.start()
    try:
        yield instance
    finally:
        instance.kill_everything()


def workload(hub: Hub, workload_id: int) -> dict[str, Any]:
    response = hub.controller("GET", f"/workloads/{workload_id}")
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def labelled_gpu(hub: Hub, workload_id: int) -> str | None:
    """The GPU the agent's metrics label with the workload, if any."""
    samples = parse(httpx.get(hub.metrics_url, timeout=10).text).samples
    for labels, _ in samples.get("DCGM_FI_DEV_GPU_UTIL", []):
        if labels.get("hpc_job") == str(workload_id):
            return labels["UUID"]
    return None


def test_a_process_given_another_gpu_moves_its_session_there(readback_hub: Hub) -> None:
    hub = readback_hub
    marker = uuid.uuid4().hex
    asked = hub.controller(
        "POST",
        "/sessions",
        json={
            "username": "alice",
            "server_name": "readback",
            "project": "vision",
            "gpu_type": "A100-80GB",
            "gpus": 1,
            "process_marker": marker,
        },
    )
    assert asked.status_code == 201, asked.text
    wid = asked.json()["id"]
    admitted = wait_for(
        lambda: (w := workload(hub, wid))["state"] == "admitted" and w, 30, "the admission"
    )
    (allocation,) = admitted["allocations"]
    node_gpus = [declared_gpu_uuid(allocation["node"], i) for i in range(4)]
    other = next(g for g in node_gpus if g != allocation["uuid"])

    env = {**os.environ, MARKER_VARIABLE: marker, "NVIDIA_VISIBLE_DEVICES": other}
    container = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        moved = wait_for(
            lambda: [a["uuid"] for a in workload(hub, wid)["allocations"]] == [other],
            30,
            f"workload {wid} recorded on {other}",
        )
        assert moved
        events = hub.controller("GET", "/events", params={"workload_id": wid}).json()["items"]
        read_back = [e for e in events if e["kind"] == "gpus-read-back"]
        assert [(e["reason"], e["data"]["gpus"], e["data"]["was"]) for e in read_back] == [
            ("read-back", [other], [allocation["uuid"]])
        ]
        # The agent's metrics name the GPU the session's processes have.
        # (The agent's next sample after the read-back names it; one before may still name
        # the GPU the controller first gave.)
        wait_for(lambda: labelled_gpu(hub, wid) == other, 15, f"the metric labels on {other}")
    finally:
        container.kill()
        container.wait()
        hub.controller("POST", f"/workloads/{wid}/release", json={"outcome": "stopped"})
    assert workload(hub, wid)["state"] == "ended"
