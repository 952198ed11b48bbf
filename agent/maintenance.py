"""Maintenance the node agent runs for the controller (``state/maintenance.py``):
a GPU reset, a node recycle and diagnostics, each a node operation with no workload.

On real GPUs each runs the command the admin configured (``NodeAgent.gpu_reset_command``,
``recycle_command``, ``diagnostics_command``), its arguments formatted with ``{node}``,
``{uuids}`` and ``{indexes}`` (comma-separated); exit status 0 passes, and the last line
of its output is the summary. No command configured fails the step, saying so: the node
or GPU then stays out of service for an admin.

On fake GPUs (the fake NVML library: machines without GPUs, the tests) the control file
answers: a reset clears the GPU's pending XIDs, volatile ECC counts and pending row remaps
and brings it back on the bus; a recycle does that for every GPU of the node;
diagnostics read ``<control directory>/diagnostics``, one line per GPU that fails
(``<uuid> fail <why>``), every GPU not listed passing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traitlets import Float, HasTraits, List, Unicode

from ..recovery import fake_nvml

KINDS = ("reset", "recycle", "diagnose")
OUTPUT_BYTES = 64 * 1024


class MaintenanceFailed(Exception):
    """The step did not pass; the message says why (reported to the controller)."""


@dataclass(frozen=True)
class MaintenanceSettings:
    node: str
    fake_control: Path | None  # the fake NVML control file, when this agent serves one
    reset_command: tuple[str, ...]
    recycle_command: tuple[str, ...]
    diagnostics_command: tuple[str, ...]
    timeout_s: float = 3600.0


class MaintenanceOptions(HasTraits):
    """The node agent's options for maintenance (``c.NodeAgent.*``): its commands and how
    long each may take."""

    gpu_reset_command = List(
        Unicode(),
        ["nvidia-smi", "--gpu-reset", "-i", "{indexes}"],
        help="How this node resets GPUs the recovery loop took out for a hardware fault "
        "(or a degraded GPU at its next idle point), run as the agent's account once "
        "nothing uses them; {node}, {uuids} and {indexes} (comma-separated) are filled in. "
        "Exit status 0 returns them to service. Fake GPUs are reset through their control "
        "file instead.",
    ).tag(config=True)

    recycle_command = List(
        Unicode(),
        help="How this node is recycled after a node fault (XID 79, a lost GPU) or an "
        "admin's `gpufleet recycle`, once it is empty: e.g. a BMC power cycle, or a script "
        "that reboots the machine and waits for it. Empty: a recycle fails, saying so, and "
        "the node stays cordoned for an admin. Fake GPUs are reset instead.",
    ).tag(config=True)

    diagnostics_command = List(
        Unicode(),
        ["dcgmi", "diag", "-r", "2", "-i", "{indexes}"],
        help="The diagnostics run after a recycle (the node's GPUs) or for a GPU blamed "
        "twice for an application fault or an NVLink error; exit status 0 passes and "
        "returns the node or GPU to service. Fake GPUs answer from <fake dir>/diagnostics.",
    ).tag(config=True)

    maintenance_timeout = Float(
        3600.0, help="Seconds a reset, recycle or diagnostics command may take before it fails."
    ).tag(config=True)

    def maintenance_for(self, node: str, fake_control: Path | None) -> MaintenanceSettings:
        return MaintenanceSettings(
            node=node,
            fake_control=fake_control,
            reset_command=tuple(self.gpu_reset_command),
            recycle_command=tuple(self.recycle_command),
            diagnostics_command=tuple(self.diagnostics_command),
            timeout_s=self.maintenance_timeout,
        )


async def run_maintenance(
    kind: str, request: Mapping[str, Any], settings: MaintenanceSettings
) -> dict[str, Any]:
    """Run one step; its result (``summary``). Raises MaintenanceFailed."""
    uuids = [str(u) for u in request.get("uuids", ())]
    indexes = [int(i) for i in request.get("indexes", ())]
    if settings.fake_control is not None:
        return await asyncio.to_thread(_fake, kind, uuids, settings.fake_control)
    command = {
        "reset": settings.reset_command,
        "recycle": settings.recycle_command,
        "diagnose": settings.diagnostics_command,
    }[kind]
    if not command:
        option = {"reset": "gpu_reset_command", "recycle": "recycle_command"}.get(
            kind, "diagnostics_command"
        )
        raise MaintenanceFailed(f"no c.NodeAgent.{option} is configured on {settings.node}")
    values = {
        "node": settings.node,
        "uuids": ",".join(uuids),
        "indexes": ",".join(str(i) for i in indexes),
    }
    return {"summary": await _run([a.format(**values) for a in command], settings.timeout_s)}


def _fake(kind: str, uuids: Sequence[str], control: Path) -> dict[str, Any]:
    if kind in ("reset", "recycle"):
        found = fake_nvml.reset_gpus(control, uuids)
        missing = sorted(set(uuids) - set(found))
        if missing:
            raise MaintenanceFailed(f"no fake GPU {', '.join(missing)} on this node")
        return {"summary": f"{len(found)} fake GPU(s) reset"}
    failing = {}
    answers = control.parent / "diagnostics"
    if answers.exists():
        for line in answers.read_text(encoding="utf-8").splitlines():
            uuid, _, verdict = line.strip().partition(" ")
            if uuid in uuids and verdict.startswith("fail"):
                failing[uuid] = verdict.removeprefix("fail").strip() or "failed"
    if failing:
        raise MaintenanceFailed("; ".join(f"{u}: {why}" for u, why in sorted(failing.items())))
    return {"summary": f"{len(uuids)} fake GPU(s) passed"}


async def _run(argv: list[str], timeout_s: float) -> str:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as e:
        raise MaintenanceFailed(f"could not run {argv[0]}: {e.strerror or e}") from e
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise MaintenanceFailed(f"{argv[0]} did not finish within {timeout_s:.0f} s") from None
    lines = output[-OUTPUT_BYTES:].decode(errors="replace").strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if process.returncode != 0:
        raise MaintenanceFailed(
            f"{argv[0]} exited with status {process.returncode}" + (f": {last}" if last else "")
        )
    return last
