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


def test_a_busy_gpu_shows_utilisation_memory_and_its_process(nvml: Nvml) -> None:
    """What the culler relies on: work on the GPU is visible in NVML's readings."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import os
    import threading
    import time

    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda")
        while not stop.is_set():
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        busy = None
        while time.monotonic() < deadline:
            samples = nvml.sample()
            busy = next((s for s in samples if (s.utilization_gpu_pct or 0) > 0), None)
            if busy is not None and busy.memory_used_bytes and busy.memory_used_bytes > 2**28:
                break
            time.sleep(0.2)
        assert busy is not None, "no GPU reported utilisation above 0 while under load"
        assert busy.memory_used_bytes is not None and busy.memory_used_bytes > 2**28
        if not busy.processes:
            pytest.xfail("this driver or sandbox lists no compute processes")
        assert os.getpid() in {pid for pid, _ in busy.processes}
    finally:
        stop.set()
        worker.join(timeout=30)
