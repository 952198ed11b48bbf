"""The NVML adapter and exporter on a real NVIDIA GPU (skipped where there is none).

Run on a machine with a GPU: `pytest -m gpu tests/gpu`. These run in a subprocess-free
way on purpose: the process must not have loaded the fake library (the unit and
integration tests load it only in child processes).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gpufleet.agent.metrics import families
from gpufleet.recovery.nvml import Nvml, NvmlUnavailable

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml() -> Iterator[Nvml]:
    try:
        session = Nvml()
    except NvmlUnavailable as e:
        pytest.skip(f"no NVIDIA GPU here: {e}")
    if not session.inventory():
        session.close()
        pytest.skip("NVML found no GPU")
    yield session
    session.close()


def test_inventory_describes_every_gpu(nvml: Nvml) -> None:
    gpus = nvml.inventory()
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for gpu in gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.name and gpu.memory_total_bytes > 2**30
        assert gpu.pci_bus_id.count(":") == 2


def test_samples_have_the_readings_every_datacenter_gpu_supports(nvml: Nvml) -> None:
    samples = nvml.sample()
    assert samples and not any(s.lost for s in samples)
    for s in samples:
        assert s.utilization_gpu_pct is not None and 0 <= s.utilization_gpu_pct <= 100
        assert s.memory_total_bytes and s.memory_used_bytes is not None
        assert s.memory_used_bytes <= s.memory_total_bytes
        assert s.temperature_c is not None and 0 < s.temperature_c < 120
        assert s.power_watts is None or s.power_watts > 0


def test_exporter_families_from_a_real_gpu(nvml: Nvml) -> None:
    inventory = {g.uuid: g for g in nvml.inventory()}
    metrics = families(
        nvml.sample(),
        inventory,
        dict.fromkeys(inventory, socket.gethostname()),
        nvml.driver_version(),
        {},
        {},
    )
    util = next(m for m in metrics if m.name == "DCGM_FI_DEV_GPU_UTIL")
    assert {s.labels["UUID"] for s in util.samples} == set(inventory)


def test_xid_wait_times_out_quietly_on_a_healthy_gpu(nvml: Nvml) -> None:
    assert nvml.wait_xid(200) is None
