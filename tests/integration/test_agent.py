"""The node agent through the real nvidia-ml-py bindings and the fake NVML library.

The demo configuration declares two nodes of 4 × A100-80GB; on this machine (no GPU) the
agent serves them through the fake library, whose control file the tests rewrite to
change what NVML reports.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.recovery.fake_nvml import FakeGpu, write_control

from ..exposition import parse
from .harness import Hub, wait_for

pytestmark = pytest.mark.integration

DECLARED = [
    {"name": "gpu-node-a", "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4},
    {"name": "gpu-node-b", "zone": "zone-b", "gpu_type": "A100-80GB", "gpus": 4},
]


@pytest.fixture
def gpus(fleet: Hub) -> Iterator[list[FakeGpu]]:
    """The fake devices as the agent declared them; rewritten as they were afterwards."""
    devices = declared_fake_gpus(DECLARED)
    yield devices
    write_control(fleet.fake_nvml_control, devices)


def scrape(hub: Hub) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse(httpx.get(hub.metrics_url, timeout=10).text).samples


def by_uuid(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> dict[str, float]:
    return {labels["UUID"]: value for labels, value in metrics.get(name, [])}


def events(hub: Hub, kind: str) -> list[dict[str, object]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e["kind"] == kind]


def test_exporter_serves_every_gpu_with_dcgm_labels_and_live_values(
    fleet: Hub, gpus: list[FakeGpu]
) -> None:
    metrics = scrape(fleet)
    util = metrics["DCGM_FI_DEV_GPU_UTIL"]
    assert len(util) == 8
    hosts = {labels["UUID"]: labels["Hostname"] for labels, _ in util}
    assert hosts[gpus[0].uuid] == "gpu-node-a" and hosts[gpus[7].uuid] == "gpu-node-b"
    labels = dict(util[0][0])
    assert set(labels) >= {
        "gpu",
        "UUID",
        "device",
        "modelName",
        "Hostname",
        "pci_bus_id",
        "DCGM_FI_DRIVER_VERSION",
    }
    assert labels["modelName"] == "NVIDIA A100-SXM4-80GB"

    changed = [
        replace(g, utilization_gpu=87, temperature_c=71) if g.index == 2 else g for g in gpus
    ]
    write_control(fleet.fake_nvml_control, changed)
    metrics = scrape(fleet)
    assert by_uuid(metrics, "DCGM_FI_DEV_GPU_UTIL")[gpus[2].uuid] == 87
    assert by_uuid(metrics, "DCGM_FI_DEV_GPU_TEMP")[gpus[2].uuid] == 71


def test_an_unsupported_reading_is_left_out_not_zero(fleet: Hub, gpus: list[FakeGpu]) -> None:
    changed = [replace(g, unsupported={"power"}) if g.index == 1 else g for g in gpus]
    write_control(fleet.fake_nvml_control, changed)
    power = by_uuid(scrape(fleet), "DCGM_FI_DEV_POWER_USAGE")
    assert gpus[1].uuid not in power
    assert gpus[0].uuid in power and power[gpus[0].uuid] > 0


def test_an_xid_reaches_the_controller_within_a_second_or_two(
    fleet: Hub, gpus: list[FakeGpu]
) -> None:
    before = len(events(fleet, "gpu-xid"))
    changed = [replace(g, xid_events=[79]) if g.index == 5 else g for g in gpus]
    started = time.monotonic()
    write_control(fleet.fake_nvml_control, changed)
    event = wait_for(
        lambda: (e := events(fleet, "gpu-xid")) and len(e) > before and e[0],
        10,
        "the XID event at the controller",
        interval=0.02,
    )
    assert time.monotonic() - started < 2.0
    assert event["node"] == "gpu-node-b"
    assert f"XID 79 on GPU {gpus[5].uuid}" in str(event["message"])
    assert by_uuid(scrape(fleet), "DCGM_FI_DEV_XID_ERRORS")[gpus[5].uuid] == 79


def test_a_lost_gpu_becomes_an_event_and_receives_no_work(fleet: Hub, gpus: list[FakeGpu]) -> None:
    lost = [replace(g, lost=True) if g.index == 0 else g for g in gpus]
    write_control(fleet.fake_nvml_control, lost)
    event = wait_for(
        lambda: next(
            (e for e in events(fleet, "gpu-lost") if gpus[0].uuid in str(e["message"])), None
        ),
        15,
        "the gpu-lost event",
    )
    assert event["node"] == "gpu-node-a"
    assert by_uuid(scrape(fleet), "gpufleet_gpu_lost")[gpus[0].uuid] == 1
    # Node a has 3 usable GPUs left: a 4-GPU session must land on node b.
    fleet.spawn("carol", project="nlp", gpu_type="A100-80GB", gpus=4)
    fleet.wait_ready("carol")
    carol = fleet.workload_of("carol")
    assert carol is not None
    assert {a["node"] for a in carol["allocations"]} == {"gpu-node-b"}

    write_control(fleet.fake_nvml_control, gpus)
    wait_for(
        lambda: next(
            (e for e in events(fleet, "gpu-back") if gpus[0].uuid in str(e["message"])), None
        ),
        15,
        "gpu-back",
    )


def test_assigned_gpus_carry_their_session_in_the_labels(fleet: Hub) -> None:
    fleet.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=1)
    fleet.wait_ready("alice")
    alice = fleet.workload_of("alice")
    assert alice is not None
    uuid = alice["allocations"][0]["uuid"]

    def labelled() -> dict[str, str] | None:
        for labels, _ in scrape(fleet)["DCGM_FI_DEV_GPU_UTIL"]:
            if labels["UUID"] == uuid and labels.get("hpc_job"):
                return labels
        return None

    labels = wait_for(labelled, 15, "the session's labels on its GPU")
    assert labels["hpc_job"] == str(alice["id"])
    assert labels["gpufleet_user"] == "alice"
    assert labels["gpufleet_project"] == "vision"
    assert "pod" not in labels  # no pod on the local backend


def test_agent_restart_keeps_the_controllers_view(fleet: Hub) -> None:
    fleet.spawn("bob", project="vision", gpu_type="A100-80GB", gpus=2)
    fleet.wait_ready("bob")
    held = fleet.workload_of("bob")
    nodes_before = {n["name"]: n["gpus"] for n in fleet.controller("GET", "/nodes").json()["items"]}
    agent = fleet.service_pid("gpufleet-agent")
    assert agent is not None
    os.kill(agent, signal.SIGKILL)
    # The hub notices the dead service on its next poll (2 s for the agent in the test
    # hub, harness.py) and starts it again.
    wait_for(
        lambda: (pid := fleet.service_pid("gpufleet-agent")) and pid != agent,
        90,
        "the hub restarting the agent",
    )
    wait_for(
        lambda: (
            httpx.get(fleet.metrics_url, timeout=5).status_code == 200
            if _port_open(fleet)
            else None
        ),
        30,
        "the exporter back",
    )
    nodes = fleet.controller("GET", "/nodes").json()["items"]
    assert {n["name"]: n["gpus"] for n in nodes} == nodes_before
    wait_for(
        lambda: all(n["health"] == "ok" for n in fleet.controller("GET", "/nodes").json()["items"]),
        30,
        "nodes ok",
    )
    after = fleet.workload_of("bob")
    assert after is not None and held is not None
    assert after["allocations"] == held["allocations"] and after["state"] == "running"


def _port_open(hub: Hub) -> bool:
    try:
        httpx.get(hub.metrics_url, timeout=2)
    except httpx.HTTPError:
        return False
    return True


def test_an_xid_from_a_gpu_that_fell_off_the_bus_names_that_gpu(
    fleet: Hub, gpus: list[FakeGpu]
) -> None:
    before = len(events(fleet, "gpu-xid"))
    changed = [replace(g, lost=True, xid_events=[79]) if g.index == 6 else g for g in gpus]
    write_control(fleet.fake_nvml_control, changed)
    event = wait_for(
        lambda: (e := events(fleet, "gpu-xid")) and len(e) > before and e[0],
        10,
        "the XID event at the controller",
    )
    assert f"XID 79 on GPU {gpus[6].uuid}" in str(event["message"])
    wait_for(
        lambda: next(
            (e for e in events(fleet, "gpu-lost") if gpus[6].uuid in str(e["message"])), None
        ),
        15,
        "gpu-lost",
    )
    assert fleet.service_pid("gpufleet-agent") is not None


def test_nvlink_errors_are_summed_over_links(fleet: Hub, gpus: list[FakeGpu]) -> None:
    from pynvml import NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_REPLAY

    changed = [
        replace(
            g,
            nvlink_errors={
                0: {NVML_NVLINK_ERROR_DL_CRC_FLIT: 5},
                3: {NVML_NVLINK_ERROR_DL_CRC_FLIT: 2, NVML_NVLINK_ERROR_DL_REPLAY: 1},
            },
        )
        if g.index == 3
        else replace(g, nvlink_links=0)
        if g.index == 4
        else g
        for g in gpus
    ]
    write_control(fleet.fake_nvml_control, changed)
    metrics = scrape(fleet)
    flit = by_uuid(metrics, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL")
    assert flit[gpus[3].uuid] == 7 and flit[gpus[0].uuid] == 0
    assert gpus[4].uuid not in flit  # a GPU without NVLink reports nothing, not zero
    replay = by_uuid(metrics, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL")
    assert replay[gpus[3].uuid] == 1
