"""GPU metrics in dcgm-exporter's names and labels, read from NVML at scrape time.

The standard Grafana GPU dashboard (NVIDIA's dcgm-exporter dashboard) queries these
names with the labels ``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``,
``pci_bus_id``, ``DCGM_FI_DRIVER_VERSION`` and, for a GPU given to a workload, ``pod``,
``namespace`` and ``container``. On the local backend a session or job has no pod: the
workload is named in ``pod`` as ``<user>-<server or job>`` with ``namespace="gpufleet"``,
and in gpufleet's own labels ``gpufleet_workload`` and ``gpufleet_user``.

A reading the GPU does not support is left out of its family, never exported as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..recovery.nvml import GpuInfo, GpuSample

MIB = 2**20

LABELS = (
    "gpu",
    "UUID",
    "device",
    "modelName",
    "Hostname",
    "pci_bus_id",
    "DCGM_FI_DRIVER_VERSION",
    "container",
    "namespace",
    "pod",
    "gpufleet_workload",
    "gpufleet_user",
)


@dataclass(frozen=True)
class Assignment:
    """Who holds a GPU now, as the controller told the agent."""

    workload_id: int
    username: str
    name: str  # server name or job name


@dataclass(frozen=True)
class Gauge:
    name: str
    help: str
    read: Callable[[GpuSample], float | int | bool | None]
    counter: bool = False


FIELDS = (
    Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda s: s.utilization_gpu_pct),
    Gauge(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "Memory utilization (in %).",
        lambda s: s.utilization_memory_pct,
    ),
    Gauge(
        "DCGM_FI_DEV_FB_USED",
        "Framebuffer memory used (in MiB).",
        lambda s: None if s.memory_used_bytes is None else s.memory_used_bytes // MIB,
    ),
    Gauge(
        "DCGM_FI_DEV_FB_FREE",
        "Framebuffer memory free (in MiB).",
        lambda s: (
            None
            if s.memory_used_bytes is None or s.memory_total_bytes is None
            else (s.memory_total_bytes - s.memory_used_bytes) // MIB
        ),
    ),
    Gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda s: s.power_watts),
    Gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda s: s.temperature_c),
    Gauge(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "Current clock event (throttle) reasons bitmask.",
        lambda s: s.clocks_event_reasons,
    ),
    Gauge(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Single-bit volatile ECC errors.",
        lambda s: s.ecc_corrected_volatile,
    ),
    Gauge(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Double-bit volatile ECC errors.",
        lambda s: s.ecc_uncorrected_volatile,
    ),
    Gauge(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "Single-bit persistent ECC errors.",
        lambda s: s.ecc_corrected_aggregate,
    ),
    Gauge(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "Double-bit persistent ECC errors.",
        lambda s: s.ecc_uncorrected_aggregate,
    ),
    Gauge(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "Rows remapped for correctable errors.",
        lambda s: s.remapped_rows_correctable,
    ),
    Gauge(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "Rows remapped for uncorrectable errors.",
        lambda s: s.remapped_rows_uncorrectable,
    ),
    Gauge(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "Whether row remapping failed.",
        lambda s: s.remapped_rows_failure,
    ),
    Gauge(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "Total PCIe replays.",
        lambda s: s.pcie_replays,
        counter=True,
    ),
    Gauge(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "NVLink replay errors, all links.",
        lambda s: s.nvlink_replay_errors,
        counter=True,
    ),
    Gauge(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "NVLink recovery errors, all links.",
        lambda s: s.nvlink_recovery_errors,
        counter=True,
    ),
    Gauge(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "NVLink flit CRC errors, all links.",
        lambda s: s.nvlink_crc_flit_errors,
        counter=True,
    ),
    Gauge(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "NVLink data CRC errors, all links.",
        lambda s: s.nvlink_crc_data_errors,
        counter=True,
    ),
)


def families(
    samples: Iterable[GpuSample],
    inventory: Mapping[str, GpuInfo],
    hosts: Mapping[str, str],
    driver_version: str,
    assignments: Mapping[str, Assignment],
    last_xid: Mapping[str, int],
) -> list[Metric]:
    """The metric families for one scrape (pure: samples and context in, families out).

    ``hosts`` names each GPU's node (one agent may serve several declared nodes)."""
    out: list[Metric] = []
    made = {
        f.name: (CounterMetricFamily if f.counter else GaugeMetricFamily)(
            f.name, f.help, labels=LABELS
        )
        for f in FIELDS
    }
    xid = GaugeMetricFamily(
        "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error seen.", labels=LABELS
    )
    lost = GaugeMetricFamily(
        "gpufleet_gpu_lost", "1 when NVML reports the GPU lost.", labels=LABELS
    )
    for sample in samples:
        info = inventory.get(sample.uuid)
        held = assignments.get(sample.uuid)
        labels = [
            str(sample.index),
            sample.uuid,
            f"nvidia{sample.index}",
            info.name if info else "",
            hosts.get(sample.uuid, ""),
            info.pci_bus_id if info else "",
            driver_version,
            "notebook" if held else "",
            "gpufleet" if held else "",
            f"{held.username}-{held.name or 'default'}" if held else "",
            str(held.workload_id) if held else "",
            held.username if held else "",
        ]
        lost.add_metric(labels, 1 if sample.lost else 0)
        if sample.uuid in last_xid:
            xid.add_metric(labels, last_xid[sample.uuid])
        if sample.lost:
            continue
        for f in FIELDS:
            value = f.read(sample)
            if value is not None:
                made[f.name].add_metric(labels, float(value))
    out.extend(made.values())
    out.append(xid)
    out.append(lost)
    return out


class GpuCollector(Collector):
    """Reads NVML when Prometheus scrapes; ``source`` supplies everything ``families`` needs."""

    def __init__(self, source: Callable[[], list[Metric]]):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source()
