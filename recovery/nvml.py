"""The NVML adapter: GPU inventory, samples and XID events through nvidia-ml-py.

A thin layer over ``pynvml`` that returns plain dataclasses. A reading the device (or the
driver) does not support is left out (``None``), never reported as zero: a dashboard must
not show 0 °C for a GPU without a sensor. A lost GPU still yields a sample, marked lost.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

T = TypeVar("T")


class NvmlError(Exception):
    """Base class for the NVML adapter's errors."""


class NvmlUnavailable(NvmlError):
    """No NVML library could be loaded or initialised (no driver, no GPU)."""


@dataclass(frozen=True)
class GpuInfo:
    """A schedulable device: a whole GPU, or a MIG slice of one (``parent_uuid`` set)."""

    uuid: str
    index: int  # the whole GPU's NVML index (a slice shares its parent's)
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    parent_uuid: str | None = None
    mig_profile: str | None = None  # e.g. "1g.10gb"


@dataclass(frozen=True)
class GpuSample:
    uuid: str
    index: int
    at: float  # time.time() of the sample
    lost: bool = False
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_c: int | None = None
    clocks_event_reasons: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_aggregate: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_replays: int | None = None
    # Summed over the GPU's active NVLink links; None without NVLink.
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    nvlink_crc_flit_errors: int | None = None
    nvlink_crc_data_errors: int | None = None
    processes: tuple[tuple[int, int], ...] = field(default=())  # (pid, used bytes)
    # Telemetry for the exporter only (the controller is not sent these).
    memory_reserved_bytes: int | None = None  # the driver's own, neither used nor free
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    memory_temperature_c: int | None = None
    energy_mj: int | None = None  # since the driver loaded
    encoder_utilization_pct: int | None = None
    decoder_utilization_pct: int | None = None
    pcie_tx_bytes_per_s: int | None = None
    pcie_rx_bytes_per_s: int | None = None
    nvlink_data_bytes: int | None = None  # sent and received, all links, since driver load


# A field's scope for "every NVLink link together" (nvml.h: UINT_MAX sums over the links).
ALL_LINKS = 0xFFFFFFFF


class Telemetry(TypedDict):
    """``GpuSample``'s readings for the exporter only."""

    memory_reserved_bytes: int | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    memory_temperature_c: int | None
    energy_mj: int | None
    encoder_utilization_pct: int | None
    decoder_utilization_pct: int | None
    pcie_tx_bytes_per_s: int | None
    pcie_rx_bytes_per_s: int | None
    nvlink_data_bytes: int | None


@dataclass(frozen=True)
class XidEvent:
    uuid: str
    index: int
    xid: int
    at: float


def _nvml() -> Any:
    import pynvml

    return pynvml


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """One NVML session. Use as a context manager, or call ``close``."""

    def __init__(self) -> None:
        nvml = _nvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not start: {e}") from e
        self._nvml = nvml
        self._event_set: Any = None
        self._identity: dict[int, tuple[str, int]] = {}  # handle address -> (uuid, index)

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._event_set is not None:
            self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        self._nvml.nvmlShutdown()

    # ------------------------------------------------------------ readings
    def _optional(self, call: Callable[[], T]) -> T | None:
        """``call()``, or None where the device or driver does not support it."""
        nvml = self._nvml
        try:
            return call()
        except (
            nvml.NVMLError_NotSupported,
            nvml.NVMLError_FunctionNotFound,
            nvml.NVMLError_NoPermission,
        ):
            return None

    def driver_version(self) -> str:
        return _decode(self._nvml.nvmlSystemGetDriverVersion())

    def _handles(self) -> Iterator[tuple[int, Any]]:
        """(index, handle) for every device; the handle is None for a lost GPU."""
        nvml = self._nvml
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                yield index, nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError_GpuIsLost:
                yield index, None

    def inventory(self) -> list[GpuInfo]:
        """The devices NVML can describe now: whole GPUs, or the MIG slices of a GPU in
        MIG mode (the GPU itself is then not offered). A lost GPU is not offered."""
        nvml = self._nvml
        gpus: list[GpuInfo] = []
        for index, handle in self._handles():
            if handle is None:
                continue
            with contextlib.suppress(nvml.NVMLError_GpuIsLost):
                whole = GpuInfo(
                    uuid=_decode(nvml.nvmlDeviceGetUUID(handle)),
                    index=index,
                    name=_decode(nvml.nvmlDeviceGetName(handle)),
                    pci_bus_id=_decode(nvml.nvmlDeviceGetPciInfo(handle).busId),
                    memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
                slices = self._mig_slices(handle, whole)
                gpus.extend(slices if slices is not None else [whole])
        return gpus

    def _mig_slices(self, handle: Any, whole: GpuInfo) -> list[GpuInfo] | None:
        """The MIG slices of a GPU in MIG mode; None when MIG is off or unsupported."""
        nvml = self._nvml
        mode = self._optional(lambda: nvml.nvmlDeviceGetMigMode(handle))
        if mode is None or mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return None
        slices = []
        for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError_NotFound:
                continue
            name = _decode(nvml.nvmlDeviceGetName(mig))
            slices.append(
                GpuInfo(
                    uuid=_decode(nvml.nvmlDeviceGetUUID(mig)),
                    index=whole.index,
                    name=name,
                    pci_bus_id=whole.pci_bus_id,
                    memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(mig).total),
                    parent_uuid=whole.uuid,
                    mig_profile=name.rsplit(" MIG ", 1)[-1] if " MIG " in name else None,
                )
            )
        return slices

    def sample(self, known: dict[int, str] | None = None) -> list[GpuSample]:
        """One sample of every GPU. ``known`` maps index → UUID for GPUs already seen, so
        a GPU that is lost (and can no longer tell its UUID) is still reported."""
        nvml = self._nvml
        samples = []
        try:
            for index, handle in self._handles():
                now = time.time()
                uuid = (known or {}).get(index, f"index-{index}")
                try:
                    if handle is None:
                        raise nvml.NVMLError_GpuIsLost()
                    uuid = _decode(nvml.nvmlDeviceGetUUID(handle))
                    samples.append(self._sample_one(handle, uuid, index, now))
                except nvml.NVMLError_GpuIsLost:
                    samples.append(GpuSample(uuid, index, now, lost=True))
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML failed while sampling: {e}") from e
        return samples

    def _sample_one(self, handle: Any, uuid: str, index: int, now: float) -> GpuSample:
        nvml = self._nvml
        optional = self._optional
        utilization = optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        remapped = optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        processes = optional(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        links = self._nvlink_errors(handle)
        telemetry = self._telemetry(handle)

        def ecc(kind: int, counter: int) -> int | None:
            return optional(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(handle, kind, counter)))

        return GpuSample(
            uuid=uuid,
            index=index,
            at=now,
            utilization_gpu_pct=None if utilization is None else int(utilization.gpu),
            utilization_memory_pct=None if utilization is None else int(utilization.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temperature_c=optional(
                lambda: int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            ),
            clocks_event_reasons=optional(
                lambda: int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
            ),
            ecc_uncorrected_volatile=ecc(
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            ),
            ecc_corrected_volatile=ecc(
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
            ),
            ecc_uncorrected_aggregate=ecc(
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_AGGREGATE_ECC
            ),
            ecc_corrected_aggregate=ecc(
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_AGGREGATE_ECC
            ),
            remapped_rows_correctable=None if remapped is None else int(remapped[0]),
            remapped_rows_uncorrectable=None if remapped is None else int(remapped[1]),
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failure=None if remapped is None else bool(remapped[3]),
            pcie_replays=optional(lambda: int(nvml.nvmlDeviceGetPcieReplayCounter(handle))),
            nvlink_replay_errors=links.get("nvlink_replay_errors"),
            nvlink_recovery_errors=links.get("nvlink_recovery_errors"),
            nvlink_crc_flit_errors=links.get("nvlink_crc_flit_errors"),
            nvlink_crc_data_errors=links.get("nvlink_crc_data_errors"),
            processes=tuple((int(p.pid), int(p.usedGpuMemory or 0)) for p in processes),
            **telemetry,
        )

    def _lenient(self, call: Callable[[], T]) -> T | None:
        """``call()``, or None on any NVML error but a lost GPU: a reading only the exporter
        shows never costs the sample the controller needs."""
        nvml = self._nvml
        try:
            return call()
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError:
            return None

    def _telemetry(self, handle: Any) -> Telemetry:
        """The readings only the exporter shows, each None where NVML cannot read it."""
        nvml = self._nvml
        optional = self._lenient
        memory = optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2))
        # A link's field is read per link (its scope): ALL_LINKS asks for their sum.
        fields = self._field_values(
            handle,
            (nvml.NVML_FI_DEV_MEMORY_TEMP, 0),
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        )
        nvlink_kib = [fields.get(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)]
        nvlink_kib.append(fields.get(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX))

        def clock(kind: int) -> int | None:
            return optional(lambda: int(nvml.nvmlDeviceGetClockInfo(handle, kind)))

        def pcie(counter: int) -> int | None:
            kb_per_s = optional(lambda: int(nvml.nvmlDeviceGetPcieThroughput(handle, counter)))
            return None if kb_per_s is None else kb_per_s * 1024

        encoder = optional(lambda: nvml.nvmlDeviceGetEncoderUtilization(handle))
        decoder = optional(lambda: nvml.nvmlDeviceGetDecoderUtilization(handle))
        return {
            "memory_reserved_bytes": None if memory is None else int(memory.reserved),
            "sm_clock_mhz": clock(nvml.NVML_CLOCK_SM),
            "memory_clock_mhz": clock(nvml.NVML_CLOCK_MEM),
            "memory_temperature_c": fields.get(nvml.NVML_FI_DEV_MEMORY_TEMP),
            "energy_mj": optional(lambda: int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))),
            "encoder_utilization_pct": None if encoder is None else int(encoder[0]),
            "decoder_utilization_pct": None if decoder is None else int(decoder[0]),
            "pcie_tx_bytes_per_s": pcie(nvml.NVML_PCIE_UTIL_TX_BYTES),
            "pcie_rx_bytes_per_s": pcie(nvml.NVML_PCIE_UTIL_RX_BYTES),
            "nvlink_data_bytes": (
                None if None in nvlink_kib else sum(int(k or 0) for k in nvlink_kib) * 1024
            ),
        }

    def _field_values(self, handle: Any, *fields: tuple[int, int]) -> dict[int, int]:
        """The integer values NVML answers for (field id, scope) pairs, by field id; a field
        it refuses is absent."""
        nvml = self._nvml
        values = self._lenient(lambda: nvml.nvmlDeviceGetFieldValues(handle, list(fields)))
        read: dict[int, int] = {}
        for value in values or ():
            if value.nvmlReturn != nvml.NVML_SUCCESS:
                continue
            if value.valueType == nvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                read[int(value.fieldId)] = int(value.value.uiVal)
            elif value.valueType == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
                read[int(value.fieldId)] = int(value.value.ullVal)
        return read

    def _nvlink_errors(self, handle: Any) -> dict[str, int]:
        """Error counters summed over active links; empty for a GPU without NVLink."""
        nvml = self._nvml
        counters = {
            "nvlink_replay_errors": nvml.NVML_NVLINK_ERROR_DL_REPLAY,
            "nvlink_recovery_errors": nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
            "nvlink_crc_flit_errors": nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            "nvlink_crc_data_errors": nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
        }
        totals: dict[str, int] = {}

        def read_counter(link: int, counter: int) -> int:
            return int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))

        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
            except (
                nvml.NVMLError_NotSupported,
                nvml.NVMLError_FunctionNotFound,
                nvml.NVMLError_InvalidArgument,
            ):
                break  # no NVLink, or past the last link
            for name, counter in counters.items():
                value = self._optional(functools.partial(read_counter, link, counter))
                if value is not None:
                    totals[name] = totals.get(name, 0) + value
        return totals

    # ------------------------------------------------------------ events
    def watch_xids(self) -> None:
        """Register every GPU for critical XID events (once)."""
        nvml = self._nvml
        if self._event_set is not None:
            return
        self._event_set = nvml.nvmlEventSetCreate()
        for index, handle in self._handles():
            if handle is None:
                continue
            with contextlib.suppress(nvml.NVMLError_NotSupported, nvml.NVMLError_GpuIsLost):
                # An XID often comes with the GPU falling off the bus, after which it can
                # no longer say who it is: remember that now.
                self._identity[_address(handle)] = (_decode(nvml.nvmlDeviceGetUUID(handle)), index)
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._event_set
                )

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """The next XID event, or None after ``timeout_ms`` (blocks: call from a thread)."""
        nvml = self._nvml
        self.watch_xids()
        try:
            event = nvml.nvmlEventSetWait(self._event_set, timeout_ms)
        except nvml.NVMLError_Timeout:
            return None
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML failed while waiting for events: {e}") from e
        if event.eventType != nvml.nvmlEventTypeXidCriticalError:
            return None
        uuid, index = self._identity.get(_address(event.device), ("unknown", -1))
        return XidEvent(uuid=uuid, index=index, xid=int(event.eventData), at=time.time())


def _address(handle: Any) -> int:
    import ctypes

    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def gpu_type_of(model: str, memory_bytes: int, names: Mapping[str, str]) -> str:
    """The fleet's GPU type for an NVML model name: from ``names``, else derived.

    "NVIDIA A100-SXM4-80GB" → "A100-80GB"; "NVIDIA H100 80GB HBM3" → "H100-80GB".
    """
    if model in names:
        return names[model]
    base = model.removeprefix("NVIDIA ").split()[0].split("-")[0]
    size = re.search(r"(\d+)\s*GB", model)
    gigabytes = int(size.group(1)) if size else round(memory_bytes / 10**9)
    return f"{base}-{gigabytes}GB"
