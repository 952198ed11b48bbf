"""The node agent's maintenance steps: on fake GPUs the control file answers (a reset
clears exactly the GPU's fault, diagnostics read the answers file); on real ones the
admin's command runs, its status deciding and its last line the summary."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.agent.maintenance import MaintenanceFailed, MaintenanceSettings, run_maintenance
from gpufleet.recovery.fake_nvml import FakeGpu, write_control


def settings(**kw: object) -> MaintenanceSettings:
    base = MaintenanceSettings("node-a", None, (), (), ())
    return replace(base, **kw)  # type: ignore[arg-type]


async def test_a_fake_reset_clears_the_gpus_fault_and_nothing_else(tmp_path: Path) -> None:
    control = tmp_path / "control"
    faulty = FakeGpu(
        "GPU-0",
        index=0,
        xid_events=[48],
        lost=True,
        ecc_volatile_uncorrected=3,
        remapped_rows_pending=True,
        utilization_gpu=40,
    )
    other = FakeGpu("GPU-1", index=1, xid_events=[13], ecc_volatile_uncorrected=2)
    write_control(control, [faulty, other])

    result = await run_maintenance("reset", {"uuids": ["GPU-0"]}, settings(fake_control=control))
    assert result == {"summary": "1 fake GPU(s) reset"}
    lines = control.read_text().splitlines()
    assert not [x for x in lines if x.startswith("gpu.0.xid=")]
    assert "gpu.0.lost=0" in lines and "gpu.0.ecc_volatile_uncorrected=0" in lines
    assert "gpu.0.remapped_rows_pending=0" in lines and "gpu.0.utilization_gpu=40" in lines
    assert [x for x in lines if x.startswith("gpu.1.xid=")]  # GPU-1 keeps its fault
    assert "gpu.1.ecc_volatile_uncorrected=2" in lines
    with pytest.raises(MaintenanceFailed, match="no fake GPU GPU-9 on this node"):
        await run_maintenance("reset", {"uuids": ["GPU-9"]}, settings(fake_control=control))


async def test_fake_diagnostics_fail_the_gpus_the_answers_file_names(tmp_path: Path) -> None:
    control = tmp_path / "control"
    write_control(control, [FakeGpu("GPU-0", index=0), FakeGpu("GPU-1", index=1)])
    asked = {"uuids": ["GPU-0", "GPU-1"]}
    passed = await run_maintenance("diagnose", asked, settings(fake_control=control))
    assert passed == {"summary": "2 fake GPU(s) passed"}
    (tmp_path / "diagnostics").write_text("GPU-1 fail memory test\nGPU-7 fail elsewhere\n")
    with pytest.raises(MaintenanceFailed, match=r"^GPU-1: memory test$"):
        await run_maintenance("diagnose", asked, settings(fake_control=control))


async def test_the_admins_commands_decide_by_their_status(tmp_path: Path) -> None:
    asked = {"uuids": ["GPU-a", "GPU-b"], "indexes": [0, 3]}
    script = "import sys; print('working'); print('reset', sys.argv[1:]); sys.exit({code})"
    ok = settings(reset_command=(sys.executable, "-c", script.format(code=0), "{indexes}"))
    assert await run_maintenance("reset", asked, ok) == {"summary": "reset ['0,3']"}
    bad = settings(recycle_command=(sys.executable, "-c", script.format(code=3), "{node}"))
    with pytest.raises(MaintenanceFailed, match=r"exited with status 3: reset \['node-a'\]"):
        await run_maintenance("recycle", asked, bad)
    with pytest.raises(MaintenanceFailed, match=r"no c\.NodeAgent\.diagnostics_command"):
        await run_maintenance("diagnose", asked, settings())
    missing = settings(diagnostics_command=(str(tmp_path / "dcgmi"),))
    with pytest.raises(MaintenanceFailed, match=r"could not run .*dcgmi"):
        await run_maintenance("diagnose", asked, missing)
    slow = settings(
        recycle_command=(sys.executable, "-c", "import time; time.sleep(30)"), timeout_s=0.5
    )
    with pytest.raises(MaintenanceFailed, match=r"did not finish within [01] s"):
        await run_maintenance("recycle", asked, slow)
