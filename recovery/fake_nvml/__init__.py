"""A fake NVML library, so gpufleet's NVML code paths run on machines without a GPU.

``fake_nvml.c`` (next to this file) builds into a ``libnvidia-ml.so.1`` that the real
nvidia-ml-py bindings (``pynvml``) load instead of the driver's, when its folder comes first on
``LD_LIBRARY_PATH``. Everything it reports comes from a text control file, named by the
environment variable ``GPUFLEET_FAKE_NVML_CONTROL`` and re-read whenever it changes, so a test
can change readings, lose a GPU or queue an XID while the process under test runs::

    lib = build(tmp / "lib")
    gpus = [FakeGpu("GPU-aaaa…", index=0)]
    write_control(tmp / "nvml.ctl", gpus)
    env = {**os.environ, **environment(lib.parent, tmp / "nvml.ctl")}
    subprocess.run([...], env=env)      # pynvml in that process sees one A100

    gpus[0].utilization_gpu = 90
    gpus[0].xid_events.append(79)       # delivered once to nvmlEventSetWait callers
    write_control(tmp / "nvml.ctl", gpus)

NVML functions the fake does not export make pynvml raise ``NVMLError_FunctionNotFound``;
readings listed in ``FakeGpu.unsupported`` raise ``NVMLError_NotSupported``. A GPU whose
``mig_devices`` is not empty is in MIG mode, and pynvml enumerates those ``FakeMig`` slices
(``nvmlDeviceGetMigDeviceHandleByIndex`` …). The file format is documented at the top of
``fake_nvml.c``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

__all__ = [
    "CONTROL_ENV",
    "LIBRARY_NAME",
    "SOURCE",
    "UNSUPPORTABLE",
    "FakeGpu",
    "FakeMig",
    "FakeNvmlBuildError",
    "Xid",
    "build",
    "environment",
    "load_in_process",
    "write_control",
]

CONTROL_ENV = "GPUFLEET_FAKE_NVML_CONTROL"
LIBRARY_NAME = "libnvidia-ml.so.1"
SOURCE = Path(__file__).with_name("fake_nvml.c")
CFLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-Wall",
    "-Werror",
    "-fvisibility=hidden",
    "-pthread",
    f"-Wl,-soname,{LIBRARY_NAME}",
)

#: Feature names ``FakeGpu.unsupported`` accepts; calls for them return NOT_SUPPORTED.
UNSUPPORTABLE = frozenset(
    {
        "memory",  # nvmlDeviceGetMemoryInfo(_v2)
        "utilization",  # nvmlDeviceGetUtilizationRates
        "power",  # nvmlDeviceGetPowerUsage
        "power_limit",  # nvmlDeviceGetEnforcedPowerLimit, ...GetPowerManagementLimit
        "temperature",  # nvmlDeviceGetTemperature
        "clocks_event_reasons",  # nvmlDeviceGetCurrentClocksEventReasons / ...ThrottleReasons
        "ecc",  # nvmlDeviceGetTotalEccErrors
        "remapped_rows",  # nvmlDeviceGetRemappedRows
        "pcie_replay_counter",  # nvmlDeviceGetPcieReplayCounter
        "nvlink",  # nvmlDeviceGetNvLinkState, ...GetNvLinkErrorCounter
        "processes",  # nvmlDeviceGetComputeRunningProcesses(_v2/_v3)
        "serial",  # nvmlDeviceGetSerial
        "xid_events",  # nvmlDeviceRegisterEvents(XidCriticalError)
        "mig",  # nvmlDeviceGetMigMode, ...MaxMigDeviceCount, ...MigDeviceHandleByIndex
        "cuda_compute_capability",  # nvmlDeviceGetCudaComputeCapability
        "clocks",  # nvmlDeviceGetClockInfo
        "memory_temperature",  # nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)
        "energy",  # nvmlDeviceGetTotalEnergyConsumption
        "encoder",  # nvmlDeviceGetEncoderUtilization
        "decoder",  # nvmlDeviceGetDecoderUtilization
        "pcie_throughput",  # nvmlDeviceGetPcieThroughput
    }
)

_MAX_GPUS = 32  # MAX_GPUS, MAX_PROCS, MAX_XIDS, MAX_LINKS, MAX_MIGS in fake_nvml.c
_MAX_PROCS = 64
_MAX_XIDS = 64
_MAX_LINKS = 36
_MAX_MIGS = 7
_MIG_UUID_MAX = 95  # struct fake_mig: char uuid[96], profile[32]
_MIG_PROFILE_MAX = 31
_NVLINK_COUNTERS = 5  # NVML_NVLINK_ERROR_COUNT
_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


class FakeNvmlBuildError(RuntimeError):
    """The fake NVML library could not be compiled (no C compiler, or a compile error)."""


# ---------------------------------------------------------------- building


def build(out_dir: Path) -> Path:
    """Compile ``fake_nvml.c`` into ``out_dir/libnvidia-ml.so.1`` and return its path.

    Skips the compile when the library there was built from the same source with the same
    flags. Uses ``$CC`` if set, else ``gcc``. Safe to call from concurrent processes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    stamp = out_dir / (LIBRARY_NAME + ".stamp")
    compiler = os.environ.get("CC") or "gcc"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join((compiler, *CFLAGS)).encode()).hexdigest()
    if target.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return target

    cc = shutil.which(compiler)
    if cc is None:
        raise FakeNvmlBuildError(
            f"cannot build the fake NVML library: C compiler {compiler!r} not found on PATH "
            "(install gcc, or set CC to a C compiler)"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LIBRARY_NAME}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *CFLAGS, "-o", tmp_name, str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise FakeNvmlBuildError(
                f"compiling {SOURCE} failed (exit {result.returncode}):\n{result.stderr}"
            )
        # Sessions and job ranks load it as their own users (read-only, never writable).
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    _atomic_write(stamp, digest + "\n")
    return target


def environment(
    lib_dir: Path, control_path: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables a process needs to load the fake: ``LD_LIBRARY_PATH`` with ``lib_dir``
    first (then ``base``'s, default ``os.environ``'s) and ``GPUFLEET_FAKE_NVML_CONTROL``.
    Merge them into a full environment: ``{**os.environ, **environment(...)}``."""
    base = os.environ if base is None else base
    paths = [str(Path(lib_dir).resolve())]
    if base.get("LD_LIBRARY_PATH"):
        paths.append(base["LD_LIBRARY_PATH"])
    return {
        "LD_LIBRARY_PATH": os.pathsep.join(paths),
        CONTROL_ENV: str(Path(control_path).resolve()),
    }


def load_in_process(library: Path, control_path: Path) -> None:
    """Make ``pynvml`` in *this* process use the fake, without touching ``LD_LIBRARY_PATH``.

    Loads the library by path first: the dynamic loader then resolves pynvml's
    ``CDLL("libnvidia-ml.so.1")`` to it by its soname. Must run before pynvml loads any NVML
    library in this process (pynvml keeps the first one it loads).
    """
    import ctypes
    import sys

    pynvml = sys.modules.get("pynvml")
    loaded = getattr(pynvml, "nvmlLib", None)
    if loaded is not None and not hasattr(loaded, "gpufleet_fake_nvml_format"):
        raise RuntimeError("pynvml already loaded the real NVML library in this process")
    os.environ[CONTROL_ENV] = str(Path(control_path).resolve())
    ctypes.CDLL(str(Path(library).resolve()), mode=ctypes.RTLD_GLOBAL)


# ---------------------------------------------------------------- control file


_seq_lock = threading.Lock()
_last_seq = 0


def _next_seq() -> int:
    """Increasing across calls and, being based on the clock, across processes."""
    global _last_seq
    with _seq_lock:
        _last_seq = max(_last_seq + 1, time.time_ns())
        return _last_seq


@dataclass(frozen=True)
class Xid:
    """A queued critical XID event. ``seq`` must grow with every new event of a GPU: the
    library delivers each (GPU, seq) once per event set, in ``seq`` order."""

    code: int
    seq: int = field(default_factory=_next_seq)


@dataclass
class FakeMig:
    """One MIG device (slice) of a ``FakeGpu`` in MIG mode, as pynvml sees it through
    ``nvmlDeviceGetMigDeviceHandleByIndex``/``nvmlDeviceGetHandleByUUID``: its UUID
    (``MIG-…``), its name (``"<GPU name> MIG <profile>"``) and its memory."""

    uuid: str
    profile: str  # e.g. "1g.10gb", "3g.40gb"
    memory_total_bytes: int
    memory_used_bytes: int = 0

    def _line(self, gpu_index: int) -> str:
        where = f"GPU {gpu_index}: MIG device {self.uuid!r}"
        if not self.uuid.startswith("MIG-"):
            raise ValueError(f"{where}: a MIG uuid must start with 'MIG-'")
        for name, text, limit in (
            ("uuid", self.uuid, _MIG_UUID_MAX),
            ("profile", self.profile, _MIG_PROFILE_MAX),
        ):
            if not text or any(c in text for c in ",\r\n") or len(text.encode()) > limit:
                raise ValueError(
                    f"{where}: {name} must be 1..{limit} bytes on one line, without ','"
                )
        total, used = int(self.memory_total_bytes), int(self.memory_used_bytes)
        if total < 0 or used < 0:
            raise ValueError(f"{where}: memory must not be negative")
        return f"gpu.{gpu_index}.mig={self.uuid},{self.profile},{total},{used}"


@dataclass
class FakeGpu:
    """One fake GPU, as ``write_control`` describes it to the library.

    ``xid_events`` holds the XIDs still to deliver: plain ints are given a sequence number
    (replaced by ``Xid`` in the list) the first time they are written, so writing the same
    list again does not deliver them again. ``unsupported`` names readings (see
    ``UNSUPPORTABLE``) whose calls return NVML_ERROR_NOT_SUPPORTED. ``lost`` makes every call
    on the GPU return NVML_ERROR_GPU_IS_LOST, including getting its handle by index.
    ``nvlink_errors`` maps link → {NVML_NVLINK_ERROR_* counter: value}. A non-empty
    ``mig_devices`` (at most 7, uuids ``MIG-…``, unique) puts the GPU in MIG mode; the
    top-level count and index enumeration still list whole GPUs only, as in real NVML.
    """

    uuid: str
    _: KW_ONLY
    index: int
    name: str = "NVIDIA A100-SXM4-80GB"
    pci_bus_id: str = ""  # default: 00000000:<07 + index>:00.0
    serial: str = ""  # default: 1320000000 + index
    pci_device_id: int = 0x20B210DE
    pci_subsystem_id: int = 0x147F10DE
    memory_total_bytes: int = 80 * 1024**3
    memory_used_bytes: int = 0
    utilization_gpu: int = 0
    utilization_memory: int = 0
    power_mw: int = 60_000
    power_limit_mw: int = 400_000
    temperature_c: int = 35
    clocks_event_reasons: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_volatile_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    pcie_replay_counter: int = 0
    memory_reserved_bytes: int = 0  # nvmlDeviceGetMemoryInfo_v2's; the v1 call counts it used
    sm_clock_mhz: int = 1410
    mem_clock_mhz: int = 1593
    memory_temperature_c: int = 45
    energy_mj: int = 0  # since the driver loaded
    encoder_utilization: int = 0
    decoder_utilization: int = 0
    pcie_tx_kbps: int = 0
    pcie_rx_kbps: int = 0
    nvlink_tx_kib: int = 0  # data sent over all links since the driver loaded
    nvlink_rx_kib: int = 0
    nvlink_links: int = 12
    nvlink_errors: dict[int, dict[int, int]] = field(default_factory=dict)
    cuda_compute_capability: tuple[int, int] = (8, 0)
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    lost: bool = False
    xid_events: list[int | Xid] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    mig_devices: list[FakeMig] = field(default_factory=list)

    def queue_xid(self, code: int) -> Xid:
        """Queue a critical XID for delivery; returns it (with its sequence number)."""
        xid = Xid(code)
        self.xid_events.append(xid)
        return xid

    def effective_pci_bus_id(self) -> str:
        """The bus id the library reports: ``DDDDDDDD:BB:DD.F``, upper case."""
        raw = self.pci_bus_id or f"00000000:{0x07 + self.index:02X}:00.0"
        m = _BUS_ID.match(raw)
        if not m:
            raise ValueError(f"GPU {self.index}: bad PCI bus id {raw!r} (want DDDD:BB:DD.F)")
        domain, bus, device, function = (int(g, 16) for g in m.groups())
        return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"

    def _check(self) -> None:
        """Raises ValueError for what the library would misread or ignore."""
        for name, text in (("uuid", self.uuid), ("name", self.name), ("serial", self.serial)):
            if "\n" in text or "\r" in text:
                raise ValueError(f"GPU {self.index}: {name} must be one line")
        if not self.uuid:
            raise ValueError(f"GPU {self.index}: uuid is required")
        unknown = set(self.unsupported) - UNSUPPORTABLE
        if unknown:
            raise ValueError(
                f"GPU {self.index}: unknown unsupported feature(s) {sorted(unknown)}; "
                f"known: {sorted(UNSUPPORTABLE)}"
            )
        if len(self.processes) > _MAX_PROCS or len(self.xid_events) > _MAX_XIDS:
            raise ValueError(
                f"GPU {self.index}: at most {_MAX_PROCS} processes and {_MAX_XIDS} XIDs"
            )
        if not 0 <= self.nvlink_links <= _MAX_LINKS:
            raise ValueError(f"GPU {self.index}: nvlink_links must be 0..{_MAX_LINKS}")
        if len(self.mig_devices) > _MAX_MIGS:
            raise ValueError(f"GPU {self.index}: at most {_MAX_MIGS} MIG devices")
        mig_uuids = [m.uuid for m in self.mig_devices]
        if len(set(mig_uuids)) != len(mig_uuids):
            raise ValueError(f"GPU {self.index}: MIG device uuids must be unique")
        if self.mig_devices and "mig" in self.unsupported:
            raise ValueError(f"GPU {self.index}: MIG devices on a GPU whose MIG is unsupported")

    def _lines(self) -> list[str]:
        self._check()

        # Give plain-int XIDs their sequence number once, in place (see the class doc).
        self.xid_events[:] = [x if isinstance(x, Xid) else Xid(int(x)) for x in self.xid_events]

        p = f"gpu.{self.index}."
        major, minor = self.cuda_compute_capability
        scalars: dict[str, object] = {
            "uuid": self.uuid,
            "name": self.name,
            "serial": self.serial or str(1320000000 + self.index),
            "pci_bus_id": self.effective_pci_bus_id(),
            "pci_device_id": f"0x{self.pci_device_id:08X}",
            "pci_subsystem_id": f"0x{self.pci_subsystem_id:08X}",
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "utilization_gpu": self.utilization_gpu,
            "utilization_memory": self.utilization_memory,
            "power_mw": self.power_mw,
            "power_limit_mw": self.power_limit_mw,
            "temperature_c": self.temperature_c,
            "clocks_event_reasons": self.clocks_event_reasons,
            "ecc_volatile_uncorrected": self.ecc_volatile_uncorrected,
            "ecc_volatile_corrected": self.ecc_volatile_corrected,
            "ecc_aggregate_uncorrected": self.ecc_aggregate_uncorrected,
            "ecc_aggregate_corrected": self.ecc_aggregate_corrected,
            "remapped_rows_correctable": self.remapped_rows_correctable,
            "remapped_rows_uncorrectable": self.remapped_rows_uncorrectable,
            "remapped_rows_pending": int(self.remapped_rows_pending),
            "remapped_rows_failure": int(self.remapped_rows_failure),
            "pcie_replay_counter": self.pcie_replay_counter,
            "memory_reserved_bytes": self.memory_reserved_bytes,
            "sm_clock_mhz": self.sm_clock_mhz,
            "mem_clock_mhz": self.mem_clock_mhz,
            "memory_temperature_c": self.memory_temperature_c,
            "energy_mj": self.energy_mj,
            "encoder_utilization": self.encoder_utilization,
            "decoder_utilization": self.decoder_utilization,
            "pcie_tx_kbps": self.pcie_tx_kbps,
            "pcie_rx_kbps": self.pcie_rx_kbps,
            "nvlink_tx_kib": self.nvlink_tx_kib,
            "nvlink_rx_kib": self.nvlink_rx_kib,
            "nvlink_links": self.nvlink_links,
            "cuda_compute_capability": f"{int(major)}.{int(minor)}",
            "lost": int(self.lost),
        }
        for key, value in scalars.items():
            if isinstance(value, int) and value < 0:
                raise ValueError(f"GPU {self.index}: {key} must not be negative")
        lines = [f"{p}{key}={value}" for key, value in scalars.items()]
        for link, counters in sorted(self.nvlink_errors.items()):
            for counter, value in sorted(counters.items()):
                if not (0 <= link < _MAX_LINKS and 0 <= counter < _NVLINK_COUNTERS):
                    raise ValueError(f"GPU {self.index}: bad NVLink counter {link}/{counter}")
                lines.append(f"{p}nvlink_error={int(link)},{int(counter)},{int(value)}")
        lines += [f"{p}process={int(pid)},{int(used)}" for pid, used in self.processes]
        lines += [f"{p}xid={x.seq},{x.code}" for x in self.xid_events if isinstance(x, Xid)]
        lines += [f"{p}unsupported={name}" for name in sorted(self.unsupported)]
        lines += [mig._line(self.index) for mig in self.mig_devices]
        return lines


def write_control(
    path: Path,
    gpus: list[FakeGpu],
    driver_version: str = "550.54.15",
    cuda_driver_version: int = 12040,
) -> None:
    """Write the control file atomically (temporary file, then rename over ``path``).

    GPU indices must be 0..n-1, each once (NVML indices are dense); their order in ``gpus``
    does not matter.
    """
    indices = sorted(g.index for g in gpus)
    if indices != list(range(len(gpus))):
        raise ValueError(f"GPU indices must be 0..{len(gpus) - 1}, each once; got {indices}")
    if len(gpus) > _MAX_GPUS:
        raise ValueError(f"at most {_MAX_GPUS} fake GPUs")
    if "\n" in driver_version:
        raise ValueError("driver_version must be one line")
    mig_uuids = [m.uuid for g in gpus for m in g.mig_devices]
    uuids = mig_uuids + [g.uuid for g in gpus]
    repeated = sorted({u for u in mig_uuids if uuids.count(u) > 1})
    if repeated:
        raise ValueError(f"MIG device uuids must be unique; repeated: {repeated}")
    lines = [
        "# gpufleet fake NVML control file; format: recovery/fake_nvml/fake_nvml.c",
        "format=1",
        f"driver_version={driver_version}",
        f"cuda_driver_version={int(cuda_driver_version)}",
        f"gpu_count={len(gpus)}",
    ]
    for gpu in sorted(gpus, key=lambda g: g.index):
        lines += gpu._lines()
    _atomic_write(Path(path), "\n".join(lines) + "\n")


_tmp_counter = itertools.count()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_tmp_counter)}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def reset_gpus(path: Path, uuids: Collection[str]) -> list[str]:
    """What ``nvidia-smi --gpu-reset`` (or a node's recycle) does to the fake GPUs named:
    their pending XIDs, volatile ECC counts and pending row remaps are cleared, and a GPU
    that fell off the bus is back. The rest of the control file stays as it is. Returns the
    UUIDs found."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    wanted = set(uuids)
    indexes = {}
    for line in lines:
        key, _, value = line.partition("=")
        if key.startswith("gpu.") and key.endswith(".uuid") and value in wanted:
            indexes[key[len("gpu.") : -len(".uuid")]] = value
    cleared = {
        "lost",
        "ecc_volatile_uncorrected",
        "ecc_volatile_corrected",
        "remapped_rows_pending",
    }
    kept = []
    for line in lines:
        key, _, _value = line.partition("=")
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "gpu" and parts[1] in indexes:
            if parts[2] == "xid":
                continue
            if parts[2] in cleared:
                line = f"{key}=0"
        kept.append(line)
    _atomic_write(Path(path), "\n".join(kept) + "\n")
    return sorted(indexes.values())
