"""``python -m gpufleet.recovery.fake_nvml``: the faults an admin injects on the demo's fake
GPUs, as a process reading them through the real nvidia-ml-py bindings and the node
agent's maintenance see them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.maintenance import MaintenanceFailed, MaintenanceSettings, run_maintenance
from gpufleet.recovery import fake_nvml
from gpufleet.recovery.fake_nvml import FakeGpu, write_control

pytest.importorskip("pynvml")

A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"

# What a process using NVML sees: each GPU lost or not and its ECC counts, then the XIDs
# delivered to an event set registered on every GPU (each once).
READER = r"""
import json
from pynvml import *
nvmlInit()
gpus = []
for i in range(nvmlDeviceGetCount()):
    try:
        h = nvmlDeviceGetHandleByIndex(i)
    except NVMLError_GpuIsLost:
        gpus.append({"lost": True})
        continue
    ecc = {f"{kind}_{counter}": nvmlDeviceGetTotalEccErrors(h, k, c)
           for kind, k in (("corrected", NVML_MEMORY_ERROR_TYPE_CORRECTED),
                           ("uncorrected", NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
           for counter, c in (("volatile", NVML_VOLATILE_ECC), ("aggregate", NVML_AGGREGATE_ECC))}
    gpus.append({"lost": False, "uuid": nvmlDeviceGetUUID(h), **ecc})
events = nvmlEventSetCreate()
for i in range(nvmlDeviceGetCount()):
    try:
        handle = nvmlDeviceGetHandleByIndex(i)
        nvmlDeviceRegisterEvents(handle, nvmlEventTypeXidCriticalError, events)
    except NVMLError_GpuIsLost:
        pass
xids = []
while True:
    try:
        e = nvmlEventSetWait_v2(events, 300)
    except NVMLError_Timeout:
        break
    xids.append([nvmlDeviceGetUUID(e.device), e.eventData])
print(json.dumps({"gpus": gpus, "xids": xids}))
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_nvml.build(tmp_path_factory.mktemp("lib"))


@pytest.fixture
def control(tmp_path: Path) -> Path:
    """A demo agent's control file, where the command finds it: under the data directory."""
    path = tmp_path / "data" / "agent" / "fake-nvml" / "control"
    path.parent.mkdir(parents=True)
    write_control(path, [FakeGpu(A, index=0), FakeGpu(B, index=1, utilization_gpu=37)])
    path.chmod(0o644)
    return path


def fake(control: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as an admin runs it on the demo: the data directory in the environment."""
    env = {k: v for k, v in os.environ.items() if k != fake_nvml.CONTROL_ENV}
    env["GPUFLEET_DATA_DIR"] = str(control.parents[2])
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.recovery.fake_nvml", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def seen(library: Path, control: Path) -> dict[str, Any]:
    env = {**os.environ, **fake_nvml.environment(library.parent, control)}
    done = subprocess.run(
        [sys.executable, "-c", READER], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_an_xid_reaches_nvml_once_on_the_gpu_named(library: Path, control: Path) -> None:
    done = fake(control, "xid", "GPU-bbbb", "48")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"XID 48 queued on GPU 1 ({B})")
    again = fake(control, "xid", "1", "79")
    assert again.returncode == 0, again.stderr
    # Delivered in the order written, each once, on GPU 1 only.
    assert seen(library, control)["xids"] == [[B, 48], [B, 79]]
    listed = fake(control, "list")
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[2].split() == ["1", B, "-", "0/0", "0/0", "48,", "79"]


def test_a_lost_gpu_and_ecc_counts_are_put_back_by_a_reset(library: Path, control: Path) -> None:
    assert fake(control, "lose", "0").returncode == 0
    assert fake(control, "ecc", "1", "--corrected", "5").returncode == 0
    assert fake(control, "ecc", B, "--corrected", "5", "--uncorrected", "1").returncode == 0
    before = seen(library, control)["gpus"]
    assert before[0] == {"lost": True}
    assert before[1] == {
        "lost": False,
        "uuid": B,
        "corrected_volatile": 10,
        "corrected_aggregate": 10,
        "uncorrected_volatile": 1,
        "uncorrected_aggregate": 1,
    }
    done = fake(control, "reset", "0", "1")
    assert done.returncode == 0, done.stderr
    after = seen(library, control)["gpus"]
    assert after[0]["lost"] is False and after[0]["uuid"] == A
    # A reset clears what is volatile; the GPU's lifetime counts stay, as on a real one.
    assert after[1]["corrected_volatile"] == after[1]["uncorrected_volatile"] == 0
    assert after[1]["corrected_aggregate"] == 10 and after[1]["uncorrected_aggregate"] == 1
    # The other lines are as they were, and the file is still readable by sessions.
    assert "gpu.1.utilization_gpu=37" in control.read_text().splitlines()
    assert control.stat().st_mode & 0o777 == 0o644


def test_the_agents_diagnostics_fail_and_pass_as_told(control: Path) -> None:
    settings = MaintenanceSettings("gpu-node-a", control, (), (), ())
    request = {"uuids": [A, B]}
    failing = fake(control, "diagnostics", "0", "fail", "memory", "test", "failed")
    assert failing.returncode == 0, failing.stderr
    with pytest.raises(MaintenanceFailed, match=f"{A}: memory test failed"):
        asyncio.run(run_maintenance("diagnose", request, settings))
    assert fake(control, "diagnostics", A, "pass").returncode == 0
    passed = asyncio.run(run_maintenance("diagnose", request, settings))
    assert passed == {"summary": "2 fake GPU(s) passed"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["xid", "7", "48"], "there is no GPU 7 in "),
        (["xid", "GPU-", "48"], "'GPU-' starts the UUIDs of GPUs 0, 1: give more of it"),
        (["lose", "GPU-cccc"], "no GPU in "),
        (["xid", "0", "0"], "XID 0 is not one"),
        (["ecc", "0", "--corrected", "-3"], "ECC counts only rise"),
    ],
)
def test_bad_input_says_what_to_fix_and_changes_nothing(
    control: Path, args: list[str], says: str
) -> None:
    before = control.read_text()
    done = fake(control, *args)
    assert done.returncode == 2
    assert says in done.stderr
    assert control.read_text() == before


def test_without_a_control_file_it_says_where_it_looked(tmp_path: Path) -> None:
    missing = tmp_path / "data" / "agent" / "fake-nvml" / "control"
    done = fake(missing, "list")
    assert done.returncode == 2
    assert f"no fake NVML control file at {missing}" in done.stderr
    assert "$GPUFLEET_DATA_DIR" in done.stderr
