"""The NVML adapter through the real nvidia-ml-py bindings and the fake library.

Each check runs in a child process (pynvml keeps the first library it loads), outside the
checkout (the working directory must not hide the installed gpufleet subpackages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.gpus import NodePlace, nodes_body, whole_gpus
from gpufleet.recovery import fake_nvml
from gpufleet.recovery.fake_nvml import FakeGpu, write_control
from gpufleet.recovery.nvml import GpuInfo

INVENTORY = """
import dataclasses, json
from gpufleet.recovery.nvml import Nvml
with Nvml() as nvml:
    print(json.dumps({"inventory": [dataclasses.asdict(g) for g in nvml.inventory()],
                      "samples": [dataclasses.asdict(s) for s in nvml.sample()]}))
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_nvml.build(tmp_path_factory.mktemp("fake-nvml"))


def run_adapter(library: Path, control: Path) -> dict[str, Any]:
    env = {**os.environ, **fake_nvml.environment(library.parent, control)}
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    result = subprocess.run(
        [sys.executable, "-c", INVENTORY],
        env=env,
        cwd=control.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def test_inventory_and_samples_of_whole_gpus(library: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    write_control(
        control,
        [
            FakeGpu(
                "GPU-0000", index=0, utilization_gpu=55, temperature_c=60, unsupported={"power"}
            ),
            FakeGpu("GPU-1111", index=1, lost=True),
        ],
    )
    answer = run_adapter(library, control)
    assert [g["uuid"] for g in answer["inventory"]] == ["GPU-0000"]  # a lost GPU is not offered
    first, lost = answer["samples"]
    assert (first["uuid"], first["utilization_gpu_pct"], first["temperature_c"]) == (
        "GPU-0000",
        55,
        60,
    )
    assert first["power_watts"] is None  # not supported: left out, not zero
    assert lost == {**lost, "index": 1, "lost": True, "utilization_gpu_pct": None}


def test_the_exporter_s_telemetry_reads_clocks_energy_video_pcie_and_nvlink(
    library: Path, tmp_path: Path
) -> None:
    control = tmp_path / "control"
    busy = FakeGpu(
        "GPU-0000",
        index=0,
        memory_used_bytes=10 * 2**30,
        memory_reserved_bytes=2**29,
        sm_clock_mhz=1980,
        mem_clock_mhz=2619,
        memory_temperature_c=71,
        energy_mj=123_456_789,
        encoder_utilization=12,
        decoder_utilization=34,
        pcie_tx_kbps=2_000,
        pcie_rx_kbps=3_000,
        nvlink_tx_kib=1200,  # over its 12 links: 100 KiB sent on each
        nvlink_rx_kib=600,
    )
    bare = FakeGpu(
        "GPU-1111",
        index=1,
        nvlink_links=0,
        unsupported={"clocks", "memory_temperature", "energy", "encoder", "decoder"}
        | {"pcie_throughput"},
    )
    write_control(control, [busy, bare])
    first, second = run_adapter(library, control)["samples"]
    assert first == {
        **first,
        "memory_used_bytes": 10 * 2**30 + 2**29,  # NVML's v1 counts the reserve as used
        "memory_reserved_bytes": 2**29,
        "sm_clock_mhz": 1980,
        "memory_clock_mhz": 2619,
        "memory_temperature_c": 71,
        "energy_mj": 123_456_789,
        "encoder_utilization_pct": 12,
        "decoder_utilization_pct": 34,
        "pcie_tx_bytes_per_s": 2_000 * 1024,
        "pcie_rx_bytes_per_s": 3_000 * 1024,
        "nvlink_data_bytes": 1800 * 1024,  # every link's, not link 0's
    }
    unread = {
        key: second[key]
        for key in (
            "sm_clock_mhz",
            "memory_clock_mhz",
            "memory_temperature_c",
            "energy_mj",
            "encoder_utilization_pct",
            "decoder_utilization_pct",
            "pcie_tx_bytes_per_s",
            "pcie_rx_bytes_per_s",
            "nvlink_data_bytes",
        )
    }
    assert unread == dict.fromkeys(unread)  # not supported: left out, not zero
    assert second["memory_reserved_bytes"] == 0


def test_a_gpu_in_mig_mode_offers_its_slices_as_gpu_types_of_their_own(
    library: Path, tmp_path: Path
) -> None:
    mig = getattr(fake_nvml, "FakeMig", None)
    if mig is None:
        pytest.fail("the fake NVML library has no MIG support (FakeMig)")
    control = tmp_path / "control"
    write_control(
        control,
        [
            FakeGpu("GPU-0000", index=0),
            FakeGpu(
                "GPU-1111",
                index=1,
                mig_devices=[
                    mig("MIG-aaaa", "3g.40gb", 40 * 2**30),
                    mig("MIG-bbbb", "3g.40gb", 40 * 2**30),
                ],
            ),
        ],
    )
    inventory = [GpuInfo(**g) for g in run_adapter(library, control)["inventory"]]
    assert [(g.uuid, g.parent_uuid, g.mig_profile) for g in inventory] == [
        ("GPU-0000", None, None),
        ("MIG-aaaa", "GPU-1111", "3g.40gb"),
        ("MIG-bbbb", "GPU-1111", "3g.40gb"),
    ]
    place = NodePlace("node-a", "local", "zone-a", "A100-80GB", {})
    (node,) = nodes_body(inventory, {"GPU-0000": place, "GPU-1111": place}, 8.0, 0)
    assert [(g["uuid"], g.get("gpu_type")) for g in node["gpus"]] == [
        ("GPU-0000", None),
        ("MIG-aaaa", "A100-80GB:3g.40gb"),
        ("MIG-bbbb", "A100-80GB:3g.40gb"),
    ]
    assert sorted(whole_gpus(inventory)) == ["GPU-0000", "GPU-1111"]


def test_declared_mig_nodes_offer_their_slices_with_or_without_nvml(
    library: Path, tmp_path: Path
) -> None:
    from gpufleet.agent.gpus import declared_fake_gpus, declared_inventory

    declared = [
        {
            "name": "mig-node",
            "zone": "zone-c",
            "gpu_type": "A100-80GB",
            "gpus": 2,
            "mig": ["3g.40gb", "2g.20gb"],
        }
    ]
    (plain,) = declared_inventory(declared)
    types = [g["gpu_type"] for g in plain["gpus"]]
    assert types == ["A100-80GB:3g.40gb", "A100-80GB:2g.20gb"] * 2
    assert plain["gpus"][1]["memory_bytes"] == 20 * 10**9

    control = tmp_path / "control"
    write_control(control, declared_fake_gpus(declared))
    inventory = [GpuInfo(**g) for g in run_adapter(library, control)["inventory"]]
    place = NodePlace("mig-node", "local", "zone-c", "A100-80GB", {})
    (node,) = nodes_body(inventory, dict.fromkeys(whole_gpus(inventory), place), 8.0, 0)
    assert [(g["uuid"], g["gpu_type"]) for g in node["gpus"]] == [
        (g["uuid"], g["gpu_type"]) for g in plain["gpus"]
    ]
