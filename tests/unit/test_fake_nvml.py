"""The fake NVML library, seen through the real nvidia-ml-py bindings.

pynvml loads ``libnvidia-ml.so.1`` once per process, found through ``LD_LIBRARY_PATH``, so
every check runs pynvml in a child process started with ``fake_nvml.environment(...)``. The
child evaluates the Python expressions a test sends it, one JSON line each way, which lets a
test change the control file between two calls of the same process.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.recovery import fake_nvml
from gpufleet.recovery.fake_nvml import FakeGpu, FakeMig, Xid, write_control

pynvml = pytest.importorskip("pynvml")

CHILD = r"""
import ctypes, json, sys, threading, time
import pynvml
from pynvml import *

def address(handle):
    # A device handle's pointer value, to tell handles apart.
    return ctypes.cast(handle, ctypes.c_void_p).value

def fields(s):
    out = {}
    for name, _ in s._fields_:
        v = getattr(s, name)
        out[name] = v.decode() if isinstance(v, bytes) else v
    return out

def timed(fn, *args):
    t = time.monotonic()
    try:
        fn(*args)
        outcome = "ok"
    except NVMLError as e:
        outcome = type(e).__name__
    return outcome, time.monotonic() - t

class Waiter:
    # nvmlEventSetWait_v2 in a thread; waited() says how long it has been blocked.

    def __init__(self, event_set, timeout_ms):
        self.entered = None
        self.result = None
        threading.Thread(target=self._run, args=(event_set, timeout_ms), daemon=True).start()

    def _run(self, event_set, timeout_ms):
        self.entered = time.monotonic()
        try:
            e = nvmlEventSetWait_v2(event_set, timeout_ms)
            self.result = {"type": e.eventType, "xid": e.eventData,
                           "index": nvmlDeviceGetIndex(e.device),
                           "uuid": nvmlDeviceGetUUID(e.device)}
        except NVMLError as e:
            self.result = type(e).__name__

    def waited(self):
        return 0 if self.entered is None else time.monotonic() - self.entered

ns = dict(globals())
for line in sys.stdin:
    req = json.loads(line)
    try:
        if "exec" in req:
            exec(req["exec"], ns)
            reply = {"ok": None}
        else:
            reply = {"ok": eval(req["eval"], ns)}
    except NVMLError as e:
        reply = {"nvml_error": type(e).__name__, "message": str(e)}
    except Exception as e:
        reply = {"exception": repr(e)}
    print(json.dumps(reply), flush=True)
"""

GIB = 1024**3
REPLY_TIMEOUT_S = 10.0


class NvmlError(Exception):
    """An NVMLError raised in the child; ``name`` is its class, e.g. NVMLError_NotSupported."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


class PynvmlChild:
    """A Python process with pynvml on the fake library, driven one expression at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send(self, kind: str, code: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({kind: code}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Any:
        try:
            reply = json.loads(self._lines.get(timeout=REPLY_TIMEOUT_S))
        except queue.Empty:
            exited = self.proc.poll() is not None and self.proc.stderr is not None
            stderr = self.proc.stderr.read() if exited and self.proc.stderr else ""
            raise AssertionError(f"no reply from the pynvml child; stderr: {stderr}") from None
        if "nvml_error" in reply:
            raise NvmlError(reply["nvml_error"], reply["message"])
        if "exception" in reply:
            raise AssertionError(f"child raised {reply['exception']}")
        return reply["ok"]

    def eval(self, expr: str) -> Any:
        self.send("eval", expr)
        return self.receive()

    def exec(self, code: str) -> None:
        self.send("exec", code)
        self.receive()

    def error(self, expr: str) -> str:
        """The NVMLError class name ``expr`` raises (fails if it does not raise one)."""
        with pytest.raises(NvmlError) as info:
            self.eval(expr)
        return info.value.name

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


@pytest.fixture(scope="session")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_nvml.build(tmp_path_factory.mktemp("fake-nvml-lib"))


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return tmp_path / "nvml-control"


@pytest.fixture
def start(library: Path, control: Path) -> Iterator[Any]:
    children: list[PynvmlChild] = []

    def start_child(init: bool = True, visible: str | None = None) -> PynvmlChild:
        env = {**os.environ, **fake_nvml.environment(library.parent, control)}
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["NVIDIA_VISIBLE_DEVICES"] = visible
        child = PynvmlChild(env)
        children.append(child)
        if init:
            child.exec("nvmlInit()")
        return child

    yield start_child
    for child in children:
        child.close()


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-11111111-2222-3333-4444-555555555555", index=0),
        FakeGpu("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", index=1),
    ]


# ---------------------------------------------------------------- readings


def test_inventory_round_trips(start: Any, control: Path) -> None:
    gpus = two_gpus()
    gpus[1].name = "NVIDIA H100 80GB HBM3"
    gpus[1].pci_bus_id = "0000:c1:00.0"
    gpus[1].memory_total_bytes = 80 * GIB
    gpus[1].serial = "1652922001234"
    write_control(control, gpus, driver_version="535.183.01", cuda_driver_version=12020)
    nv = start()

    assert nv.eval("nvmlDeviceGetCount()") == 2
    assert nv.eval("nvmlSystemGetDriverVersion()") == "535.183.01"
    assert nv.eval("nvmlSystemGetCudaDriverVersion()") == 12020
    assert nv.eval("nvmlSystemGetCudaDriverVersion_v2()") == 12020
    nv.exec("h = nvmlDeviceGetHandleByIndex(1)")
    assert nv.eval("nvmlDeviceGetUUID(h)") == "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    assert nv.eval("nvmlDeviceGetName(h)") == "NVIDIA H100 80GB HBM3"
    assert nv.eval("nvmlDeviceGetIndex(h)") == 1
    assert nv.eval("nvmlDeviceGetSerial(h)") == "1652922001234"
    pci = nv.eval("fields(nvmlDeviceGetPciInfo(h))")
    assert pci["busId"] == "00000000:C1:00.0"
    assert pci["busIdLegacy"] == "0000:C1:00.0"
    assert (pci["domain"], pci["bus"], pci["device"]) == (0, 0xC1, 0)
    assert pci["pciDeviceId"] == 0x20B210DE
    assert nv.eval("nvmlDeviceGetCudaComputeCapability(h)") == [8, 0]
    # Handles found by UUID or bus id are the same device.
    assert nv.eval("nvmlDeviceGetIndex(nvmlDeviceGetHandleByUUID('" + gpus[0].uuid + "'))") == 0
    assert nv.eval("nvmlDeviceGetIndex(nvmlDeviceGetHandleByPciBusId('0000:C1:00.0'))") == 1
    assert nv.error("nvmlDeviceGetHandleByUUID('GPU-nope')") == "NVMLError_NotFound"
    assert nv.error("nvmlDeviceGetHandleByIndex(2)") == "NVMLError_InvalidArgument"


def test_a_process_sees_only_its_visible_devices(start: Any, control: Path) -> None:
    """As in a container: NVIDIA_VISIBLE_DEVICES names the GPUs, renumbered from 0."""
    gpus = [*two_gpus(), FakeGpu("GPU-cccccccc-0000-0000-0000-000000000003", index=2)]
    write_control(control, gpus)
    one = start(visible=f"{gpus[2].uuid},{gpus[0].uuid}")
    assert one.eval("nvmlDeviceGetCount()") == 2
    uuids = "[nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(i)) for i in range(2)]"
    assert one.eval(uuids) == [gpus[0].uuid, gpus[2].uuid]
    assert one.eval("nvmlDeviceGetIndex(nvmlDeviceGetHandleByIndex(1))") == 1
    assert start(visible="1").eval("nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(0))") == (
        gpus[1].uuid
    )
    assert start(visible="none").eval("nvmlDeviceGetCount()") == 0
    assert start(visible="all").eval("nvmlDeviceGetCount()") == 3


def test_readings_round_trip(start: Any, control: Path) -> None:
    gpus = two_gpus()
    gpus[0] = FakeGpu(
        gpus[0].uuid,
        index=0,
        memory_total_bytes=80 * GIB,
        memory_used_bytes=30 * GIB,
        utilization_gpu=87,
        utilization_memory=41,
        power_mw=312_500,
        power_limit_mw=400_000,
        temperature_c=71,
        clocks_event_reasons=pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonSwPowerCap,
        ecc_volatile_uncorrected=2,
        ecc_volatile_corrected=17,
        ecc_aggregate_uncorrected=5,
        ecc_aggregate_corrected=1234,
        remapped_rows_correctable=3,
        remapped_rows_uncorrectable=1,
        remapped_rows_pending=True,
        remapped_rows_failure=False,
        pcie_replay_counter=9,
        nvlink_errors={3: {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 44}},
        processes=[(4242, 20 * GIB), (4343, 10 * GIB)],
    )
    write_control(control, gpus)
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")

    memory = nv.eval("fields(nvmlDeviceGetMemoryInfo(h))")
    assert memory == {"total": 80 * GIB, "used": 30 * GIB, "free": 50 * GIB}
    memory_v2 = nv.eval("fields(nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2))")
    assert (memory_v2["total"], memory_v2["used"], memory_v2["free"]) == (
        80 * GIB,
        30 * GIB,
        50 * GIB,
    )
    assert nv.eval("fields(nvmlDeviceGetUtilizationRates(h))") == {"gpu": 87, "memory": 41}
    assert nv.eval("nvmlDeviceGetPowerUsage(h)") == 312_500
    assert nv.eval("nvmlDeviceGetEnforcedPowerLimit(h)") == 400_000
    assert nv.eval("nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)") == 71
    reasons = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap
    assert nv.eval("nvmlDeviceGetCurrentClocksEventReasons(h)") == reasons
    assert nv.eval("nvmlDeviceGetCurrentClocksThrottleReasons(h)") == reasons
    ecc = (
        "[nvmlDeviceGetTotalEccErrors(h, t, c) for t, c in ["
        "(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC),"
        "(NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC),"
        "(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC),"
        "(NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC)]]"
    )
    assert nv.eval(ecc) == [2, 17, 5, 1234]
    assert nv.eval("nvmlDeviceGetRemappedRows(h)") == [3, 1, 1, 0]
    assert nv.eval("nvmlDeviceGetPcieReplayCounter(h)") == 9
    assert nv.eval("nvmlDeviceGetNvLinkErrorCounter(h, 3, NVML_NVLINK_ERROR_DL_CRC_FLIT)") == 44
    assert nv.eval("nvmlDeviceGetNvLinkErrorCounter(h, 0, NVML_NVLINK_ERROR_DL_REPLAY)") == 0
    assert nv.eval("nvmlDeviceGetNvLinkState(h, 11)") == 1
    assert nv.error("nvmlDeviceGetNvLinkState(h, 12)") == "NVMLError_InvalidArgument"
    procs = nv.eval("[(p.pid, p.usedGpuMemory) for p in nvmlDeviceGetComputeRunningProcesses(h)]")
    assert procs == [[4242, 20 * GIB], [4343, 10 * GIB]]
    # The other GPU has no processes and defaults elsewhere.
    nv.exec("h1 = nvmlDeviceGetHandleByIndex(1)")
    assert nv.eval("nvmlDeviceGetComputeRunningProcesses(h1)") == []
    assert nv.eval("nvmlDeviceGetNvLinkErrorCounter(h1, 3, NVML_NVLINK_ERROR_DL_CRC_FLIT)") == 0
    # Without MIG devices, MIG is reported disabled and cannot be enumerated.
    assert nv.eval("nvmlDeviceGetMigMode(h)") == [0, 0]
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 0)") == "NVMLError_NotSupported"


def test_unsupported_readings_raise_not_supported(start: Any, control: Path) -> None:
    gpus = two_gpus()
    gpus[0].unsupported = {
        "utilization",
        "power",
        "temperature",
        "ecc",
        "remapped_rows",
        "pcie_replay_counter",
        "nvlink",
        "mig",
    }
    gpus[1].nvlink_links = 0  # a PCIe card: no NVLink at all
    write_control(control, gpus)
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")

    for call in (
        "nvmlDeviceGetUtilizationRates(h)",
        "nvmlDeviceGetPowerUsage(h)",
        "nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)",
        "nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)",
        "nvmlDeviceGetRemappedRows(h)",
        "nvmlDeviceGetPcieReplayCounter(h)",
        "nvmlDeviceGetNvLinkErrorCounter(h, 0, NVML_NVLINK_ERROR_DL_REPLAY)",
        "nvmlDeviceGetMigMode(h)",
        "nvmlDeviceGetNvLinkState(nvmlDeviceGetHandleByIndex(1), 0)",
    ):
        assert nv.error(call) == "NVMLError_NotSupported", call
    # What is not marked stays readable.
    assert nv.eval("nvmlDeviceGetMemoryInfo(h).total") == 80 * GIB
    assert nv.eval("nvmlDeviceGetUtilizationRates(nvmlDeviceGetHandleByIndex(1)).gpu") == 0


def test_unimplemented_function_raises_function_not_found(start: Any, control: Path) -> None:
    write_control(control, two_gpus())
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")
    assert nv.error("nvmlDeviceGetFanSpeed(h)") == "NVMLError_FunctionNotFound"
    assert nv.error("nvmlDeviceGetBAR1MemoryInfo(h)") == "NVMLError_FunctionNotFound"
    with pytest.raises(NvmlError) as info:
        nv.eval("nvmlDeviceGetFanSpeed(h)")
    assert info.value.message == "Function Not Found"


def test_error_strings_are_nvmls(start: Any, control: Path) -> None:
    write_control(control, two_gpus())
    nv = start()
    assert nv.eval("nvmlErrorString(NVML_ERROR_GPU_IS_LOST)") == "GPU is lost"
    assert nv.eval("nvmlErrorString(NVML_ERROR_NOT_SUPPORTED)") == "Not Supported"
    assert nv.eval("nvmlErrorString(NVML_ERROR_TIMEOUT)") == "Timeout"
    assert nv.eval("nvmlErrorString(NVML_ERROR_UNINITIALIZED)") == "Uninitialized"
    assert nv.eval("nvmlErrorString(12345)") == "Unknown Error"


def test_lost_gpu(start: Any, control: Path) -> None:
    gpus = two_gpus()
    write_control(control, gpus)
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")
    assert nv.eval("nvmlDeviceGetUUID(h)") == gpus[0].uuid

    gpus[0].lost = True
    write_control(control, gpus)
    for call in (
        "nvmlDeviceGetUUID(h)",
        "nvmlDeviceGetMemoryInfo(h)",
        "nvmlDeviceGetUtilizationRates(h)",
        "nvmlDeviceGetPowerUsage(h)",
        "nvmlDeviceGetHandleByIndex(0)",
    ):
        assert nv.error(call) == "NVMLError_GpuIsLost", call
    assert nv.eval("nvmlDeviceGetCount()") == 2  # still counted
    assert nv.eval("nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(1))") == gpus[1].uuid

    gpus[0].lost = False  # back on the bus (after a reset)
    write_control(control, gpus)
    assert nv.eval("nvmlDeviceGetUUID(h)") == gpus[0].uuid


def test_control_changes_reach_a_running_process(start: Any, control: Path) -> None:
    gpus = two_gpus()
    write_control(control, gpus)
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(1)")
    assert nv.eval("nvmlDeviceGetUtilizationRates(h).gpu") == 0
    assert nv.eval("nvmlDeviceGetComputeRunningProcesses(h)") == []

    gpus[1].utilization_gpu = 99
    gpus[1].processes = [(777, 5 * GIB)]
    gpus[1].ecc_volatile_uncorrected = 1
    write_control(control, gpus)
    assert nv.eval("nvmlDeviceGetUtilizationRates(h).gpu") == 99
    assert nv.eval("[p.pid for p in nvmlDeviceGetComputeRunningProcesses(h)]") == [777]
    assert (
        nv.eval(
            "nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)"
        )
        == 1
    )

    gpus[1].unsupported = {"utilization"}
    write_control(control, gpus)
    assert nv.error("nvmlDeviceGetUtilizationRates(h)") == "NVMLError_NotSupported"


def test_init_without_control_file_is_driver_not_loaded(start: Any) -> None:
    # The control file does not exist: like a machine without the NVIDIA driver.
    nv = start(init=False)
    assert nv.error("nvmlInit()") == "NVMLError_DriverNotLoaded"


def test_calls_before_init_are_uninitialized(start: Any, control: Path) -> None:
    write_control(control, two_gpus())
    nv = start()
    nv.exec("nvmlShutdown()")
    assert nv.error("nvmlDeviceGetCount()") == "NVMLError_Uninitialized"


# ---------------------------------------------------------------- MIG


MIG_A = "MIG-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
MIG_B = "MIG-11223344-5566-7788-99aa-bbccddeeff00"
MIG_C = "MIG-99999999-8888-7777-6666-555555555555"


def mig_gpus() -> list[FakeGpu]:
    """GPU 0 in MIG mode with two slices, GPU 1 whole (MIG disabled)."""
    gpus = two_gpus()
    gpus[0].mig_devices = [
        FakeMig(MIG_A, "3g.40gb", 40 * GIB, 12 * GIB),
        FakeMig(MIG_B, "1g.10gb", 10 * GIB),
    ]
    return gpus


def test_mig_devices_enumerate(start: Any, control: Path) -> None:
    gpus = mig_gpus()
    write_control(control, gpus)
    nv = start()
    assert nv.eval("nvmlDeviceGetCount()") == 2  # whole GPUs only
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")
    assert nv.eval("nvmlDeviceGetMigMode(h)") == [
        pynvml.NVML_DEVICE_MIG_ENABLE,
        pynvml.NVML_DEVICE_MIG_ENABLE,
    ]
    assert nv.eval("nvmlDeviceGetMaxMigDeviceCount(h)") == 7
    assert nv.eval("nvmlDeviceIsMigDeviceHandle(h).value") == 0

    nv.exec("m = [nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(2)]")
    assert nv.eval("[nvmlDeviceGetUUID(x) for x in m]") == [MIG_A, MIG_B]
    assert nv.eval("[nvmlDeviceGetName(x) for x in m]") == [
        "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
    ]
    assert nv.eval("[nvmlDeviceIsMigDeviceHandle(x).value for x in m]") == [1, 1]
    assert nv.eval("fields(nvmlDeviceGetMemoryInfo(m[0]))") == {
        "total": 40 * GIB,
        "used": 12 * GIB,
        "free": 28 * GIB,
    }
    memory_v2 = nv.eval("fields(nvmlDeviceGetMemoryInfo(m[1], nvmlMemory_v2))")
    assert (memory_v2["total"], memory_v2["used"], memory_v2["free"]) == (10 * GIB, 0, 10 * GIB)
    # The parent is the whole GPU; its own readings are unchanged.
    assert nv.eval("nvmlDeviceGetUUID(nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m[1]))") == (
        gpus[0].uuid
    )
    assert nv.eval("nvmlDeviceGetIndex(nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m[0]))") == 0
    assert nv.eval("nvmlDeviceGetMemoryInfo(h).total") == 80 * GIB
    # Handles are distinct per MIG device and from the GPU's.
    assert nv.eval("len({address(h), address(m[0]), address(m[1])})") == 3

    # Past the last MIG device: NOT_FOUND below the maximum, INVALID_ARGUMENT from it on.
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 2)") == "NVMLError_NotFound"
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 6)") == "NVMLError_NotFound"
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 7)") == "NVMLError_InvalidArgument"
    # A whole GPU's handle is no MIG handle.
    assert nv.error("nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)") == (
        "NVMLError_InvalidArgument"
    )


def test_mig_handles_are_not_whole_gpus(start: Any, control: Path) -> None:
    write_control(control, mig_gpus())
    nv = start()
    nv.exec("m = nvmlDeviceGetMigDeviceHandleByIndex(nvmlDeviceGetHandleByIndex(0), 0)")
    # As on real MIG: no per-slice utilization, no NVML index.
    assert nv.error("nvmlDeviceGetUtilizationRates(m)") == "NVMLError_NotSupported"
    assert nv.error("nvmlDeviceGetIndex(m)") == "NVMLError_NotSupported"
    # Calls that need a whole GPU reject a MIG handle.
    for call in (
        "nvmlDeviceGetPowerUsage(m)",
        "nvmlDeviceGetMigMode(m)",
        "nvmlDeviceGetMaxMigDeviceCount(m)",
        "nvmlDeviceGetMigDeviceHandleByIndex(m, 0)",
        "nvmlDeviceGetTotalEccErrors(m, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)",
    ):
        assert nv.error(call) == "NVMLError_InvalidArgument", call


def test_a_gpu_without_mig_devices_has_mig_disabled(start: Any, control: Path) -> None:
    write_control(control, mig_gpus())
    nv = start()
    nv.exec("h1 = nvmlDeviceGetHandleByIndex(1)")
    assert nv.eval("nvmlDeviceGetMigMode(h1)") == [0, 0]
    assert nv.error("nvmlDeviceGetMaxMigDeviceCount(h1)") == "NVMLError_NotSupported"
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h1, 0)") == "NVMLError_NotSupported"
    assert nv.eval("fields(nvmlDeviceGetUtilizationRates(h1))") == {"gpu": 0, "memory": 0}


def test_handle_by_mig_uuid(start: Any, control: Path) -> None:
    gpus = mig_gpus()
    write_control(control, gpus)
    nv = start()
    nv.exec(f"m = nvmlDeviceGetHandleByUUID({MIG_B!r})")
    assert nv.eval("nvmlDeviceIsMigDeviceHandle(m).value") == 1
    assert nv.eval("nvmlDeviceGetUUID(m)") == MIG_B
    assert nv.eval("nvmlDeviceGetMemoryInfo(m).total") == 10 * GIB
    by_index = "nvmlDeviceGetMigDeviceHandleByIndex(nvmlDeviceGetHandleByIndex(0), 1)"
    assert nv.eval(f"address(m) == address({by_index})")
    assert nv.error(f"nvmlDeviceGetHandleByUUID({MIG_C!r})") == "NVMLError_NotFound"


def test_mig_devices_follow_control_changes(start: Any, control: Path) -> None:
    gpus = mig_gpus()
    write_control(control, gpus)
    nv = start()
    nv.exec("h = nvmlDeviceGetHandleByIndex(0)")
    nv.exec("m = [nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(2)]")

    gpus[0].mig_devices[1].memory_used_bytes = 3 * GIB
    write_control(control, gpus)
    assert nv.eval("nvmlDeviceGetMemoryInfo(m[1]).used") == 3 * GIB

    # A lost parent makes its MIG devices lost too.
    gpus[0].lost = True
    write_control(control, gpus)
    for call in (
        "nvmlDeviceGetUUID(m[0])",
        "nvmlDeviceGetName(m[0])",
        "nvmlDeviceGetMemoryInfo(m[1])",
        "nvmlDeviceGetUtilizationRates(m[1])",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m[0])",
        f"nvmlDeviceGetHandleByUUID({MIG_A!r})",
    ):
        assert nv.error(call) == "NVMLError_GpuIsLost", call

    # Back, with one MIG device fewer: the handle of the removed one is stale.
    gpus[0].lost = False
    gpus[0].mig_devices.pop()
    write_control(control, gpus)
    assert nv.eval("nvmlDeviceGetUUID(m[0])") == MIG_A
    assert nv.error("nvmlDeviceGetUUID(m[1])") == "NVMLError_GpuIsLost"
    assert nv.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 1)") == "NVMLError_NotFound"

    # MIG mode off again.
    gpus[0].mig_devices = []
    write_control(control, gpus)
    assert nv.eval("nvmlDeviceGetMigMode(h)") == [0, 0]
    assert nv.error("nvmlDeviceGetUUID(m[0])") == "NVMLError_GpuIsLost"


def test_a_process_sees_only_its_visible_mig_devices(start: Any, control: Path) -> None:
    gpus = [*mig_gpus(), FakeGpu("GPU-cccccccc-0000-0000-0000-000000000003", index=2)]
    gpus[2].mig_devices = [FakeMig(MIG_C, "7g.80gb", 80 * GIB)]
    write_control(control, gpus)

    # One MIG uuid: its parent GPU, renumbered 0, with only that MIG device.
    one = start(visible=MIG_B)
    assert one.eval("nvmlDeviceGetCount()") == 1
    one.exec("h = nvmlDeviceGetHandleByIndex(0)")
    assert one.eval("nvmlDeviceGetUUID(h)") == gpus[0].uuid
    assert one.eval("nvmlDeviceGetUUID(nvmlDeviceGetMigDeviceHandleByIndex(h, 0))") == MIG_B
    assert one.error("nvmlDeviceGetMigDeviceHandleByIndex(h, 1)") == "NVMLError_NotFound"
    assert one.error(f"nvmlDeviceGetHandleByUUID({MIG_A!r})") == "NVMLError_NotFound"

    # MIG uuids of two GPUs, plus a whole GPU named by index.
    mixed = start(visible=f"{MIG_C},1,{MIG_A}")
    assert mixed.eval("nvmlDeviceGetCount()") == 3
    uuids = "[nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(i)) for i in range(3)]"
    assert mixed.eval(uuids) == [gpus[0].uuid, gpus[1].uuid, gpus[2].uuid]
    migs = (
        "[nvmlDeviceGetUUID(nvmlDeviceGetMigDeviceHandleByIndex(nvmlDeviceGetHandleByIndex(i), 0))"
        " for i in (0, 2)]"
    )
    assert mixed.eval(migs) == [MIG_A, MIG_C]
    assert mixed.error(f"nvmlDeviceGetHandleByUUID({MIG_B!r})") == "NVMLError_NotFound"
    assert mixed.eval("nvmlDeviceGetMigMode(nvmlDeviceGetHandleByIndex(1))") == [0, 0]

    # A GPU named by its own uuid keeps all its MIG devices.
    whole = start(visible=gpus[0].uuid)
    assert whole.eval(f"nvmlDeviceGetUUID(nvmlDeviceGetHandleByUUID({MIG_B!r}))") == MIG_B


# ---------------------------------------------------------------- XID events


def register_all(nv: PynvmlChild) -> None:
    nv.exec(
        "es = nvmlEventSetCreate()\n"
        "for i in range(nvmlDeviceGetCount()):\n"
        "    nvmlDeviceRegisterEvents(nvmlDeviceGetHandleByIndex(i),"
        " nvmlEventTypeXidCriticalError, es)"
    )


def wait_until(condition: Any, what: str, timeout_s: float = 5.0) -> float:
    """Poll ``condition()`` until true; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
    return time.monotonic() - started


def test_xid_wakes_a_waiting_call(start: Any, control: Path) -> None:
    gpus = two_gpus()
    write_control(control, gpus)
    nv = start()
    assert nv.eval("nvmlDeviceGetSupportedEventTypes(nvmlDeviceGetHandleByIndex(0))") == (
        pynvml.nvmlEventTypeXidCriticalError
    )
    register_all(nv)

    nv.exec("w = Waiter(es, 5000)")
    # Blocked for several of the library's 20 ms polls before the XID exists, so it can
    # only arrive through a re-read inside the wait.
    wait_until(lambda: nv.eval("w.waited()") > 0.1, "the wait to block")
    gpus[1].xid_events.append(79)
    write_control(control, gpus)
    latency = wait_until(lambda: nv.eval("w.result") is not None, "the XID")
    assert nv.eval("w.result") == {
        "type": pynvml.nvmlEventTypeXidCriticalError,
        "xid": 79,
        "index": 1,
        "uuid": gpus[1].uuid,
    }
    assert latency < 0.5, f"the waiting call took {latency:.3f} s to see the XID"

    # Delivered once: re-reading the file (which still lists it) does not deliver it again.
    gpus[1].utilization_gpu = 5
    write_control(control, gpus)
    assert nv.eval("timed(nvmlEventSetWait_v2, es, 100)")[0] == "NVMLError_Timeout"


def test_xids_are_delivered_in_order_once_each(start: Any, control: Path) -> None:
    gpus = two_gpus()
    write_control(control, gpus)
    nv = start()
    register_all(nv)
    first = gpus[0].queue_xid(48)
    gpus[1].queue_xid(63)
    gpus[0].queue_xid(94)
    assert isinstance(first, Xid)
    write_control(control, gpus)

    next_event = (
        "(lambda e: [nvmlDeviceGetIndex(e.device), e.eventData])(nvmlEventSetWait_v2(es, 1000))"
    )
    got = [nv.eval(next_event) for _ in range(3)]
    assert got == [[0, 48], [1, 63], [0, 94]]
    assert nv.eval("timed(nvmlEventSetWait_v2, es, 50)")[0] == "NVMLError_Timeout"


def test_wait_times_out_when_nothing_comes(start: Any, control: Path) -> None:
    write_control(control, two_gpus())
    nv = start()
    register_all(nv)
    outcome, elapsed = nv.eval("timed(nvmlEventSetWait_v2, es, 200)")
    assert outcome == "NVMLError_Timeout"
    assert 0.19 <= elapsed < 1.0
    outcome, elapsed = nv.eval("timed(nvmlEventSetWait_v2, es, 0)")
    assert outcome == "NVMLError_Timeout"
    assert elapsed < 0.1


def test_unregistered_gpu_and_unsupported_xids_are_not_delivered(start: Any, control: Path) -> None:
    gpus = two_gpus()
    gpus[1].unsupported = {"xid_events"}
    write_control(control, gpus)
    nv = start()
    assert (
        nv.error(
            "nvmlDeviceRegisterEvents(nvmlDeviceGetHandleByIndex(1),"
            " nvmlEventTypeXidCriticalError, nvmlEventSetCreate())"
        )
        == "NVMLError_NotSupported"
    )
    nv.exec(
        "es = nvmlEventSetCreate()\n"
        "nvmlDeviceRegisterEvents(nvmlDeviceGetHandleByIndex(0), nvmlEventTypeXidCriticalError, es)"
    )
    gpus[1].xid_events.append(79)
    write_control(control, gpus)
    assert nv.eval("timed(nvmlEventSetWait_v2, es, 100)")[0] == "NVMLError_Timeout"


def test_one_thread_samples_while_another_waits(start: Any, control: Path) -> None:
    gpus = two_gpus()
    write_control(control, gpus)
    nv = start()
    register_all(nv)
    nv.exec("w = Waiter(es, 5000)")
    wait_until(lambda: nv.eval("w.waited()") > 0.05, "the wait to block")
    # The blocked wait does not hold up calls from another thread.
    started = time.monotonic()
    assert nv.eval("nvmlDeviceGetUtilizationRates(nvmlDeviceGetHandleByIndex(0)).gpu") == 0
    assert nv.eval("nvmlDeviceGetCount()") == 2
    assert time.monotonic() - started < 0.5
    assert nv.eval("w.result") is None
    gpus[0].xid_events.append(31)
    write_control(control, gpus)
    wait_until(lambda: nv.eval("w.result") is not None, "the XID")
    assert nv.eval("w.result['xid']") == 31


# ---------------------------------------------------------------- Python side


def test_struct_layouts_match_pynvml() -> None:
    # fake_nvml.c static-asserts these sizes; pynvml must agree.
    assert ctypes.sizeof(pynvml.c_nvmlMemory_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert pynvml.nvmlMemory_v2 == 40 | (2 << 24)
    assert ctypes.sizeof(pynvml.c_nvmlUtilization_t) == 8
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlEventData_t) == 32


def test_build_skips_an_up_to_date_library(library: Path) -> None:
    before = library.stat()
    assert fake_nvml.build(library.parent) == library
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_build_without_compiler_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-gpufleet")
    with pytest.raises(fake_nvml.FakeNvmlBuildError, match="not found"):
        fake_nvml.build(tmp_path)


def test_environment_prepends_the_library_folder(tmp_path: Path) -> None:
    env = fake_nvml.environment(
        tmp_path / "lib", tmp_path / "ctl", base={"LD_LIBRARY_PATH": "/opt/x"}
    )
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / 'lib'}:/opt/x"
    assert env[fake_nvml.CONTROL_ENV] == str(tmp_path / "ctl")
    assert fake_nvml.environment(tmp_path, tmp_path / "c", base={})["LD_LIBRARY_PATH"] == str(
        tmp_path
    )


def test_write_control_is_atomic_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "ctl"
    write_control(path, two_gpus())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctl"]  # no temporary left
    assert "gpu_count=2" in path.read_text().splitlines()

    with pytest.raises(ValueError, match="indices"):
        write_control(path, [FakeGpu("GPU-a", index=0), FakeGpu("GPU-b", index=2)])
    with pytest.raises(ValueError, match="unsupported"):
        write_control(path, [FakeGpu("GPU-a", index=0, unsupported={"fan"})])
    with pytest.raises(ValueError, match="bus id"):
        write_control(path, [FakeGpu("GPU-a", index=0, pci_bus_id="07:00")])
    with pytest.raises(ValueError, match="one line"):
        write_control(path, [FakeGpu("GPU-a", index=0, name="A\nB")])


def test_write_control_writes_and_validates_mig_devices(tmp_path: Path) -> None:
    path = tmp_path / "ctl"
    write_control(path, mig_gpus())
    lines = path.read_text().splitlines()
    assert f"gpu.0.mig={MIG_A},3g.40gb,{40 * GIB},{12 * GIB}" in lines
    assert f"gpu.0.mig={MIG_B},1g.10gb,{10 * GIB},0" in lines
    assert not [line for line in lines if line.startswith("gpu.1.mig=")]

    def gpu_with(*migs: FakeMig, unsupported: set[str] | None = None) -> list[FakeGpu]:
        return [FakeGpu("GPU-a", index=0, mig_devices=list(migs), unsupported=unsupported or set())]

    eight = [FakeMig(f"MIG-{i}", "1g.10gb", GIB) for i in range(8)]
    with pytest.raises(ValueError, match="at most 7"):
        write_control(path, gpu_with(*eight))
    write_control(path, gpu_with(*eight[:7]))
    with pytest.raises(ValueError, match="MIG-"):
        write_control(path, gpu_with(FakeMig("GPU-x", "1g.10gb", GIB)))
    with pytest.raises(ValueError, match="unique"):
        write_control(path, gpu_with(FakeMig("MIG-x", "1g.10gb", GIB), FakeMig("MIG-x", "1g", 1)))
    other = FakeGpu("GPU-b", index=1, mig_devices=[FakeMig("MIG-x", "1g.10gb", GIB)])
    with pytest.raises(ValueError, match="unique"):
        write_control(path, [*gpu_with(FakeMig("MIG-x", "1g.10gb", GIB)), other])
    with pytest.raises(ValueError, match="','"):
        write_control(path, gpu_with(FakeMig("MIG-x", "1g,10gb", GIB)))
    with pytest.raises(ValueError, match="negative"):
        write_control(path, gpu_with(FakeMig("MIG-x", "1g.10gb", -1)))
    with pytest.raises(ValueError, match="unsupported"):
        write_control(path, gpu_with(FakeMig("MIG-x", "1g.10gb", GIB), unsupported={"mig"}))


def test_xid_sequence_numbers_stick(tmp_path: Path) -> None:
    gpu = FakeGpu("GPU-a", index=0, xid_events=[79])
    write_control(tmp_path / "ctl", [gpu])
    (xid,) = gpu.xid_events
    assert isinstance(xid, Xid) and xid.code == 79
    write_control(tmp_path / "ctl", [gpu])
    assert gpu.xid_events == [xid]
    assert gpu.queue_xid(48).seq > xid.seq


def test_load_in_process(library: Path, control: Path) -> None:
    # A fresh interpreter without LD_LIBRARY_PATH: load_in_process makes pynvml use the fake.
    write_control(control, two_gpus())
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH",)}
    env.pop(fake_nvml.CONTROL_ENV, None)
    code = (
        "import sys, pynvml\n"
        "from gpufleet.recovery import fake_nvml\n"
        "fake_nvml.load_in_process(sys.argv[1], sys.argv[2])\n"
        "pynvml.nvmlInit()\n"
        "print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetUUID("
        "pynvml.nvmlDeviceGetHandleByIndex(0)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(library), str(control)],
        env=env,
        # Away from the checkout, as a session's process runs.
        cwd=control.parent,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["2", two_gpus()[0].uuid]
