"""GPU metrics under dcgm-exporter's names, types and labels, read from NVML at scrape time.

Dashboards and alerts built for NVIDIA's dcgm-exporter read these series unchanged:
every field of its default set that NVML can read, under its own name and type, counters
included (a counter keeps its name: no ``_total`` is added, as dcgm-exporter adds none).
The labels are dcgm-exporter's (``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``, ``pci_bus_id``, ``DCGM_FI_DRIVER_VERSION``; ``pod``, ``namespace`` and
``container`` for a GPU a Kubernetes pod holds) with ``hpc_job``, as dcgm-exporter's
HPC job mapping names it, for the gpufleet workload holding the GPU on either backend,
and gpufleet's ``gpufleet_user`` and ``gpufleet_project``. None of them changes with a
job's step or attempt: a GPU's series change only when it changes hands (and on
Kubernetes when a pod is replaced, as they do under dcgm-exporter).

A reading the GPU does not support is left out of its family, never exported as 0.
``docs/monitoring.md`` lists what is exported and what is not, and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..recovery.nvml import GpuInfo, GpuSample
from .network_usage import Traffic
from .placements import PodIdentity

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
    "hpc_job",
    "gpufleet_user",
    "gpufleet_project",
)

Kind = Literal["gauge", "counter"]
Reading = float | int | bool | None


@dataclass(frozen=True)
class Assignment:
    """Who holds a GPU now, as the controller told the agent."""

    workload_id: int
    username: str
    name: str  # server name or job name
    project: str = ""
    marker: str = ""  # what its processes carry (recovery/processes.py)

    @classmethod
    def from_heartbeat(cls, answer: Mapping[str, Any]) -> Assignment:
        """One of the heartbeat answer's ``assignments`` (``api.schemas.AssignmentOut``)."""
        optional = ("project", "marker")
        return cls(
            int(answer["workload_id"]),
            str(answer["username"]),
            str(answer["name"]),
            **{key: str(answer.get(key) or "") for key in optional},
        )


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    help: str
    read: Callable[[GpuSample], Reading]


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _fb_used(s: GpuSample) -> int | None:
    """Used without the driver's reserve, as DCGM counts it (used + free + reserved =
    total); NVML's v1 ``used`` counts the reserve as used."""
    if s.memory_used_bytes is None:
        return None
    return _mib(s.memory_used_bytes - (s.memory_reserved_bytes or 0))


def _fb_free(s: GpuSample) -> int | None:
    if s.memory_used_bytes is None or s.memory_total_bytes is None:
        return None
    return _mib(s.memory_total_bytes - s.memory_used_bytes)


# dcgm-exporter's default set (its default-counters.csv), in its order, with its types and
# help texts; then what gpufleet adds from its other fields. Not here, because NVML cannot
# read them: DCGM_FI_DEV_VGPU_LICENSE_STATUS (vGPU guests only) and the profiling fields
# DCGM_FI_PROF_GR_ENGINE_ACTIVE, _PIPE_TENSOR_ACTIVE and _DRAM_ACTIVE (DCGM's profiler).
# DCGM_FI_DEV_XID_ERRORS comes from the agent's XID watch, not from a sample.
FIELDS = (
    Field(
        "DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda s: s.sm_clock_mhz
    ),
    Field(
        "DCGM_FI_DEV_MEM_CLOCK",
        "gauge",
        "Memory clock frequency (in MHz).",
        lambda s: s.memory_clock_mhz,
    ),
    Field(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "gauge",
        "Memory temperature (in C).",
        lambda s: s.memory_temperature_c,
    ),
    Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda s: s.temperature_c),
    Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda s: s.power_watts),
    Field(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda s: s.energy_mj,
    ),
    Field(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
        lambda s: s.pcie_replays,
    ),
    Field(
        "DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda s: s.utilization_gpu_pct
    ),
    Field(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory utilization (in %).",
        lambda s: s.utilization_memory_pct,
    ),
    Field(
        "DCGM_FI_DEV_ENC_UTIL",
        "gauge",
        "Encoder utilization (in %).",
        lambda s: s.encoder_utilization_pct,
    ),
    Field(
        "DCGM_FI_DEV_DEC_UTIL",
        "gauge",
        "Decoder utilization (in %).",
        lambda s: s.decoder_utilization_pct,
    ),
    Field("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", _fb_free),
    Field("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", _fb_used),
    Field(
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory reserved (in MiB).",
        lambda s: _mib(s.memory_reserved_bytes),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total NVLink data sent and received, all links (in bytes).",
        lambda s: s.nvlink_data_bytes,
    ),
    Field(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors.",
        lambda s: s.remapped_rows_uncorrectable,
    ),
    Field(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors.",
        lambda s: s.remapped_rows_correctable,
    ),
    Field(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed.",
        lambda s: s.remapped_rows_failure,
    ),
    Field(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "The rate of data transmitted over the PCIe bus, including both protocol headers "
        "and data payloads, in bytes per second.",
        lambda s: s.pcie_tx_bytes_per_s,
    ),
    Field(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "The rate of data received over the PCIe bus, including both protocol headers "
        "and data payloads, in bytes per second.",
        lambda s: s.pcie_rx_bytes_per_s,
    ),
    # Beyond the default set: dcgm-exporter's names for fields its CSV lists commented out.
    Field(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "gauge",
        "Current clock event (throttle) reasons bitmask.",
        lambda s: s.clocks_event_reasons,
    ),
    Field(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        lambda s: s.ecc_corrected_volatile,
    ),
    Field(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        lambda s: s.ecc_uncorrected_volatile,
    ),
    Field(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
        lambda s: s.ecc_corrected_aggregate,
    ),
    Field(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
        lambda s: s.ecc_uncorrected_aggregate,
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
        lambda s: s.nvlink_replay_errors,
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
        lambda s: s.nvlink_recovery_errors,
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        lambda s: s.nvlink_crc_flit_errors,
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink data CRC errors.",
        lambda s: s.nvlink_crc_data_errors,
    ),
)


@dataclass
class Family:
    """One metric family of a scrape: its samples as (label values in LABELS order, value)."""

    name: str
    kind: Kind
    help: str
    samples: list[tuple[Sequence[str], float]] = field(default_factory=list)
    labels: Sequence[str] = LABELS


def _labels(
    sample: GpuSample,
    info: GpuInfo | None,
    host: str,
    driver_version: str,
    held: Assignment | None,
    pod: PodIdentity | None,
) -> tuple[str, ...]:
    return (
        str(sample.index),
        sample.uuid,
        f"nvidia{sample.index}",
        info.name if info else "",
        host,
        info.pci_bus_id if info else "",
        driver_version,
        pod.container if held and pod else "",
        pod.namespace if held and pod else "",
        pod.pod if held and pod else "",
        str(held.workload_id) if held else "",
        held.username if held else "",
        held.project if held else "",
    )


def families(
    samples: Iterable[GpuSample],
    inventory: Mapping[str, GpuInfo],
    hosts: Mapping[str, str],
    driver_version: str,
    assignments: Mapping[str, Assignment],
    last_xid: Mapping[str, int],
    pods: Mapping[str, PodIdentity] | None = None,
) -> list[Family]:
    """The metric families of one scrape (pure: samples and context in, families out).

    ``hosts`` names each GPU's node (one agent may serve several declared nodes); ``pods``
    the Kubernetes container each GPU of a held pod was given, by UUID."""
    made = {f.name: Family(f.name, f.kind, f.help) for f in FIELDS}
    xid = Family("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")
    lost = Family("gpufleet_gpu_lost", "gauge", "1 when NVML reports the GPU lost.")
    for sample in samples:
        labels = _labels(
            sample,
            inventory.get(sample.uuid),
            hosts.get(sample.uuid, ""),
            driver_version,
            assignments.get(sample.uuid),
            (pods or {}).get(sample.uuid),
        )
        lost.samples.append((labels, 1.0 if sample.lost else 0.0))
        if sample.uuid in last_xid:
            xid.samples.append((labels, float(last_xid[sample.uuid])))
        if sample.lost:
            continue
        for f in FIELDS:
            value = f.read(sample)
            if value is not None:
                made[f.name].samples.append((labels, float(value)))
    return [*made.values(), xid, lost]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**63 else repr(value)


NETWORK_LABELS = ("Hostname", "hpc_job", "gpufleet_user", "gpufleet_project")


def network_families(
    traffic: Mapping[str, Traffic], assignments: Mapping[str, Assignment], hostname: str
) -> list[Family]:
    """Each workload's bytes in and out on this node (``traffic`` by workload marker); the
    processes of a workload the controller did not name to this agent are left out."""
    received = Family(
        "gpufleet_workload_network_receive_bytes_total",
        "counter",
        "Bytes the workload's pods (their network namespaces) or ranks (their TCP sockets) "
        "received on this node; RDMA traffic is not seen.",
        labels=NETWORK_LABELS,
    )
    sent = Family(
        "gpufleet_workload_network_transmit_bytes_total",
        "counter",
        "Bytes the workload's pods (their network namespaces) or ranks (their TCP sockets) "
        "sent on this node; RDMA traffic is not seen.",
        labels=NETWORK_LABELS,
    )
    holders = {a.marker: a for a in assignments.values() if a.marker}
    for marker, used in sorted(traffic.items()):
        held = holders.get(marker)
        if held is None:
            continue
        labels = (hostname, str(held.workload_id), held.username, held.project)
        received.samples.append((labels, float(used.received)))
        sent.samples.append((labels, float(used.sent)))
    return [received, sent]


def exposition(found: Iterable[Family]) -> str:
    """Prometheus's text format (version 0.0.4), each family under its own name whatever
    its type. Empty label values are left out, as Prometheus treats them as absent."""
    lines: list[str] = []
    for family in found:
        help_text = family.help.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {family.name} {help_text}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for values, value in family.samples:
            pairs = ",".join(
                f'{name}="{_escape(v)}"' for name, v in zip(family.labels, values, strict=True) if v
            )
            lines.append(f"{family.name}{{{pairs}}} {_number(value)}")
    return "\n".join(lines) + "\n"
