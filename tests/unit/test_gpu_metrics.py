"""GPU metrics keep dcgm-exporter's names, types and labels and leave out what is not
supported."""

from __future__ import annotations

from gpufleet.agent.metrics import (
    LABELS,
    Assignment,
    Family,
    exposition,
    families,
    network_families,
)
from gpufleet.agent.network_usage import Traffic
from gpufleet.agent.placements import PodIdentity
from gpufleet.recovery.nvml import GpuInfo, GpuSample

from ..exposition import Scrape, parse

INVENTORY = {
    "GPU-a": GpuInfo("GPU-a", 0, "NVIDIA A100-SXM4-80GB", "00000000:10:00.0", 80 * 2**30),
    "GPU-b": GpuInfo("GPU-b", 1, "NVIDIA A100-SXM4-80GB", "00000000:11:00.0", 80 * 2**30),
    "GPU-c": GpuInfo("GPU-c", 2, "NVIDIA A100-SXM4-80GB", "00000000:12:00.0", 80 * 2**30),
}

# dcgm-exporter's default set (etc/default-counters.csv) as it declares each field, less
# the four NVML cannot read (the vGPU licence and three profiling fields, docs/monitoring.md)
# and DCGM_FI_DRIVER_VERSION, which is a label.
DCGM_DEFAULT = {
    "DCGM_FI_DEV_SM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEMORY_TEMP": "gauge",
    "DCGM_FI_DEV_GPU_TEMP": "gauge",
    "DCGM_FI_DEV_POWER_USAGE": "gauge",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge",
    "DCGM_FI_DEV_ENC_UTIL": "gauge",
    "DCGM_FI_DEV_DEC_UTIL": "gauge",
    "DCGM_FI_DEV_XID_ERRORS": "gauge",
    "DCGM_FI_DEV_FB_FREE": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge",
    "DCGM_FI_DEV_FB_RESERVED": "gauge",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "counter",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "gauge",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "gauge",
}

EVERYTHING = GpuSample(
    "GPU-a",
    0,
    0.0,
    utilization_gpu_pct=37,
    utilization_memory_pct=12,
    memory_used_bytes=3 * 2**20 + 2**29,
    memory_total_bytes=80 * 2**30,
    memory_reserved_bytes=2**29,
    power_watts=212.5,
    temperature_c=61,
    memory_temperature_c=70,
    sm_clock_mhz=1410,
    memory_clock_mhz=1593,
    energy_mj=9_000_000_000,
    encoder_utilization_pct=3,
    decoder_utilization_pct=4,
    pcie_tx_bytes_per_s=5 * 2**20,
    pcie_rx_bytes_per_s=6 * 2**20,
    nvlink_data_bytes=2**40,
    remapped_rows_correctable=1,
    remapped_rows_uncorrectable=0,
    remapped_rows_failure=False,
    pcie_replays=4,
    ecc_corrected_volatile=2,
    nvlink_replay_errors=5,
)


def scrape(samples: list[GpuSample], **context: object) -> Scrape:
    found: list[Family] = families(
        samples,
        INVENTORY,
        dict.fromkeys(INVENTORY, "node-a"),
        "550.54.15",
        context.get("assignments", {}),  # type: ignore[arg-type]
        context.get("last_xid", {}),  # type: ignore[arg-type]
        context.get("pods", {}),  # type: ignore[arg-type]
    )
    return parse(exposition(found))


def test_every_default_field_nvml_reads_is_exported_under_dcgm_s_name_and_type() -> None:
    metrics = scrape([EVERYTHING], last_xid={"GPU-a": 79})
    assert {name: metrics.types.get(name) for name in DCGM_DEFAULT} == DCGM_DEFAULT
    # Counters included: each sample under the family's own name, none with "_total" added.
    assert not [name for name in metrics.samples if name.endswith("_total")]
    assert set(metrics.samples) <= set(metrics.types)
    assert metrics.values("DCGM_FI_DEV_PCIE_REPLAY_COUNTER") == [4]
    assert metrics.values("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL") == [5]
    assert metrics.types["DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"] == "counter"
    assert metrics.values("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == [9_000_000_000]
    # Framebuffer as DCGM counts it: used + free + reserved = total.
    used, free, reserved = (
        metrics.values(f"DCGM_FI_DEV_FB_{what}")[0] for what in ("USED", "FREE", "RESERVED")
    )
    assert (used, reserved) == (3, 512)
    assert used + free + reserved == 80 * 1024
    assert metrics.values("DCGM_FI_PROF_PCIE_TX_BYTES") == [5 * 2**20]
    assert metrics.values("DCGM_FI_DEV_XID_ERRORS") == [79]
    assert metrics.values("DCGM_FI_DEV_ROW_REMAP_FAILURE") == [0]


def test_a_held_gpu_names_its_workload_as_hpc_job_on_the_local_backend() -> None:
    metrics = scrape(
        [EVERYTHING, GpuSample("GPU-b", 1, 0.0, utilization_gpu_pct=0)],
        assignments={"GPU-a": Assignment(7, "alice", "", project="vision")},
    )
    held, free = metrics.samples["DCGM_FI_DEV_GPU_UTIL"]
    assert held == (
        {
            "gpu": "0",
            "UUID": "GPU-a",
            "device": "nvidia0",
            "modelName": "NVIDIA A100-SXM4-80GB",
            "Hostname": "node-a",
            "pci_bus_id": "00000000:10:00.0",
            "DCGM_FI_DRIVER_VERSION": "550.54.15",
            "hpc_job": "7",
            "gpufleet_user": "alice",
            "gpufleet_project": "vision",
        },
        37,
    )
    # A free GPU has no holder's labels (empty values are absent to Prometheus).
    assert not {"hpc_job", "gpufleet_user", "pod"} & set(free[0])


def test_a_gpu_held_by_a_pod_carries_its_pod_namespace_and_container() -> None:
    pod = PodIdentity("gf-job-9-a1-0", "gpufleet", "torchrun")
    metrics = scrape(
        [EVERYTHING, GpuSample("GPU-b", 1, 0.0, utilization_gpu_pct=0)],
        assignments={"GPU-a": Assignment(9, "bob", "resnet", project="vision")},
        # A pod's GPU the controller no longer gives anyone (its release under way) is free.
        pods={"GPU-a": pod, "GPU-b": pod},
    )
    held, free = metrics.samples["DCGM_FI_DEV_GPU_UTIL"]
    assert {k: held[0][k] for k in ("pod", "namespace", "container", "hpc_job")} == {
        "pod": "gf-job-9-a1-0",
        "namespace": "gpufleet",
        "container": "torchrun",
        "hpc_job": "9",
    }
    assert set(held[0]) <= set(LABELS)
    assert "pod" not in free[0]


def test_unsupported_readings_are_left_out_not_zero() -> None:
    metrics = scrape(
        [
            GpuSample("GPU-a", 0, 0.0, utilization_gpu_pct=5, temperature_c=None),
            GpuSample("GPU-b", 1, 0.0, utilization_gpu_pct=0, temperature_c=40),
        ]
    )
    assert [labels["UUID"] for labels, _ in metrics.samples["DCGM_FI_DEV_GPU_TEMP"]] == ["GPU-b"]
    assert {labels["UUID"]: v for labels, v in metrics.samples["DCGM_FI_DEV_GPU_UTIL"]} == {
        "GPU-a": 5,
        "GPU-b": 0,
    }
    assert "DCGM_FI_DEV_POWER_USAGE" not in metrics.samples
    assert "DCGM_FI_DEV_SM_CLOCK" not in metrics.samples
    # The family is still declared: a dashboard sees the name, with no sample to show.
    assert metrics.types["DCGM_FI_DEV_POWER_USAGE"] == "gauge"


def test_a_lost_gpu_is_flagged_and_reports_no_readings() -> None:
    metrics = scrape(
        [
            GpuSample("GPU-a", 0, 0.0, utilization_gpu_pct=50),
            GpuSample("GPU-c", 2, 0.0, lost=True),
        ]
    )
    assert {labels["UUID"]: v for labels, v in metrics.samples["gpufleet_gpu_lost"]} == {
        "GPU-a": 0,
        "GPU-c": 1,
    }
    assert [labels["UUID"] for labels, _ in metrics.samples["DCGM_FI_DEV_GPU_UTIL"]] == ["GPU-a"]


def test_label_values_are_escaped() -> None:
    metrics = scrape(
        [GpuSample("GPU-a", 0, 0.0, utilization_gpu_pct=1)],
        assignments={"GPU-a": Assignment(1, "a\\b", "job", project='say "hi"\nthere')},
    )
    ((labels, _),) = metrics.samples["DCGM_FI_DEV_GPU_UTIL"]
    assert (labels["gpufleet_user"], labels["gpufleet_project"]) == ("a\\b", 'say "hi"\nthere')


def test_a_workload_s_traffic_is_a_pair_of_counters_named_after_it() -> None:
    held = Assignment(7, "alice", "", project="vision", marker="m7")
    found = network_families(
        {"m7": Traffic(received=10, sent=20), "stranger": Traffic(received=1, sent=1)},
        {"GPU-a": held, "GPU-b": held},
        "node-a",
    )
    metrics = parse(exposition(found))
    assert metrics.types == {
        "gpufleet_workload_network_receive_bytes_total": "counter",
        "gpufleet_workload_network_transmit_bytes_total": "counter",
    }
    # One pair per workload and node, whatever its GPUs; a marker nobody holds is left out.
    assert metrics.samples["gpufleet_workload_network_transmit_bytes_total"] == [
        (
            {
                "Hostname": "node-a",
                "hpc_job": "7",
                "gpufleet_user": "alice",
                "gpufleet_project": "vision",
            },
            20,
        )
    ]
    assert metrics.values("gpufleet_workload_network_receive_bytes_total") == [10]
