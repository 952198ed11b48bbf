"""GPU metrics keep dcgm-exporter's names and labels and leave out what is not supported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.metrics import Assignment, GpuCollector, families
from gpufleet.recovery.nvml import GpuInfo, GpuSample

INVENTORY = {
    "GPU-a": GpuInfo("GPU-a", 0, "NVIDIA A100-SXM4-80GB", "00000000:10:00.0", 80 * 2**30),
    "GPU-b": GpuInfo("GPU-b", 1, "NVIDIA A100-SXM4-80GB", "00000000:11:00.0", 80 * 2**30),
    "GPU-c": GpuInfo("GPU-c", 2, "NVIDIA A100-SXM4-80GB", "00000000:12:00.0", 80 * 2**30),
}


def scrape(samples: list[GpuSample], **context: object) -> dict[str, list[tuple[dict, float]]]:
    registry = CollectorRegistry()
    registry.register(
        GpuCollector(
            lambda: families(
                samples,
                INVENTORY,
                dict.fromkeys(INVENTORY, "node-a"),
                "550.54.15",
                context.get("assignments", {}),
                context.get("last_xid", {}),  # type: ignore[arg-type]
            )
        )
    )
    text = generate_latest(registry).decode()
    parsed: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            parsed.setdefault(sample.name, []).append((sample.labels, sample.value))
    return parsed


def test_values_and_dcgm_labels() -> None:
    metrics = scrape(
        [
            GpuSample(
                "GPU-a",
                0,
                0.0,
                utilization_gpu_pct=37,
                memory_used_bytes=3 * 2**20,
                memory_total_bytes=80 * 2**30,
                power_watts=212.5,
                temperature_c=61,
                pcie_replays=4,
            )
        ],
        assignments={"GPU-a": Assignment(7, "alice", "")},
        last_xid={"GPU-a": 79},
    )
    ((labels, value),) = metrics["DCGM_FI_DEV_GPU_UTIL"]
    assert value == 37
    assert labels == {
        "gpu": "0",
        "UUID": "GPU-a",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "Hostname": "node-a",
        "pci_bus_id": "00000000:10:00.0",
        "DCGM_FI_DRIVER_VERSION": "550.54.15",
        "container": "notebook",
        "namespace": "gpufleet",
        "pod": "alice-default",
        "gpufleet_workload": "7",
        "gpufleet_user": "alice",
    }
    assert metrics["DCGM_FI_DEV_FB_USED"][0][1] == 3
    assert metrics["DCGM_FI_DEV_FB_FREE"][0][1] == 80 * 1024 - 3
    assert metrics["DCGM_FI_DEV_POWER_USAGE"][0][1] == 212.5
    assert metrics["DCGM_FI_DEV_GPU_TEMP"][0][1] == 61
    assert metrics["DCGM_FI_DEV_PCIE_REPLAY_COUNTER_total"][0][1] == 4
    assert metrics["DCGM_FI_DEV_XID_ERRORS"][0][1] == 79


def test_unsupported_readings_are_left_out_not_zero() -> None:
    metrics = scrape(
        [
            GpuSample("GPU-a", 0, 0.0, utilization_gpu_pct=5, temperature_c=None),
            GpuSample("GPU-b", 1, 0.0, utilization_gpu_pct=0, temperature_c=40),
        ]
    )
    assert [labels["UUID"] for labels, _ in metrics["DCGM_FI_DEV_GPU_TEMP"]] == ["GPU-b"]
    assert {labels["UUID"]: v for labels, v in metrics["DCGM_FI_DEV_GPU_UTIL"]} == {
        "GPU-a": 5,
        "GPU-b": 0,
    }
    assert "DCGM_FI_DEV_POWER_USAGE" not in metrics
    assert all(labels["pod"] == "" for labels, _ in metrics["DCGM_FI_DEV_GPU_UTIL"])


def test_a_lost_gpu_is_flagged_and_reports_no_readings() -> None:
    metrics = scrape(
        [
            GpuSample("GPU-a", 0, 0.0, utilization_gpu_pct=50),
            GpuSample("GPU-c", 2, 0.0, lost=True),
        ]
    )
    assert {labels["UUID"]: v for labels, v in metrics["gpufleet_gpu_lost"]} == {
        "GPU-a": 0,
        "GPU-c": 1,
    }
    assert [labels["UUID"] for labels, _ in metrics["DCGM_FI_DEV_GPU_UTIL"]] == ["GPU-a"]
