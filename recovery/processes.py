"""Finding and ending every process of a workload (a session or a job rank), wherever it went.

A session's processes are not one process group: Jupyter starts each kernel in a session
of its own (``start_new_session``), and a user may start more. What they share is the
environment they inherited, so every process of a workload carries
``GPUFLEET_SESSION_MARKER=<random UUID>`` and is found by reading ``/proc/<pid>/environ``
(readable by the same user, or by root). GPUs are released only once no such process
remains. The marker is random per start, not the workload id: two deployments on one
machine (or a test suite beside a demo) number their workloads independently.

Used by the local backend's spawner (sessions), by the node agent's rank runner (job
ranks), by the controller's reconciler (``marked_processes``: every marked process, to
find those no open workload owns), so the rule "nothing of it runs any more" is written
once, and by the node agent's GPU read-back (``marked_process_details``: which GPUs each
workload's container was given, from its environment). DESIGN.md's import table lets the
spawner import only the client and the snapshotter; this stdlib-only module is the
exception (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER_VARIABLE = "GPUFLEET_SESSION_MARKER"


def new_marker() -> str:
    return uuid.uuid4().hex


def part_marker(marker: str, part: int) -> str:
    """The marker of one part of a workload (a job's pod): ``<marker>.<part>``.

    The workload's own marker finds its parts too (``marked_pids``), so the reconciler
    ends a whole job by the one marker it records, and the rank runner each pod by its own.
    """
    return f"{marker}.{part}"


def workload_marker(found: str) -> str:
    """The workload's marker for a process's marker, which may be a part's."""
    return found.split(".", 1)[0]


def marked_pids(marker: str, proc: Path = Path("/proc")) -> list[int]:
    """Live processes that carry ``marker`` or the marker of one of its parts."""
    part = marker + "."
    return [
        pid
        for pid, found in marked_processes(proc).items()
        if found == marker or found.startswith(part)
    ]


def marked_processes(proc: Path = Path("/proc")) -> dict[int, str]:
    """Every live process that carries a marker, with its marker: ``{pid: marker}``.

    The reconciler's view of what runs on this machine. A process whose environment
    cannot be read belongs to another user and never to a session of this hub: sessions
    run as the hub's own user, or the hub runs as root and reads everything.
    """
    return {found.pid: found.marker for found in marked_process_details((), proc)}


@dataclass(frozen=True)
class MarkedProcess:
    """A live marked process, with the variables of its environment that were asked for."""

    pid: int
    marker: str
    # When it started, in clock ticks after boot (/proc/<pid>/stat, field 22): of one
    # marker's processes, the oldest is the one its backend started (a container's init).
    started: int
    environ: Mapping[str, str]


def marked_process_details(
    variables: Collection[str], proc: Path = Path("/proc")
) -> list[MarkedProcess]:
    """Every live marked process (as ``marked_processes``) with its start time and the
    ``variables`` of its environment it has.

    ``/proc/<pid>/environ`` is the environment the process was started with, what its
    parent (a container runtime) gave it: its own later ``setenv()`` calls do not show there.
    """
    prefix = f"{MARKER_VARIABLE}=".encode()
    wanted = {f"{name}=".encode() for name in variables}
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if stat[0] == "Z":  # a zombie holds no GPU memory; its parent reaps it
            continue
        marker = None
        values = {}
        for item in environ.split(b"\0"):
            # The first of a repeated variable counts, as for getenv().
            if item.startswith(prefix) and len(item) > len(prefix):
                marker = marker or item[len(prefix) :].decode(errors="replace")
            elif wanted:
                name, sep, value = item.partition(b"=")
                key = name.decode(errors="replace")
                if sep and name + b"=" in wanted and key not in values:
                    values[key] = value.decode(errors="replace")
        if marker is not None:
            found.append(MarkedProcess(int(entry.name), marker, int(stat[19]), values))
    return found


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    """Signal each process group holding one of ``pids``, once.

    Once, because a workload that checkpoints on SIGTERM must not get the signal twice;
    every pid is in the group it was found in, and a process that moves away in between
    is caught by the next pass (the SIGKILL pass looks again).
    """
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            continue


async def _gone_within(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not marked_pids(marker):
            return True
        await asyncio.sleep(0.1)
    return not marked_pids(marker)


async def end_all(marker: str, term_grace: float = 5.0, kill_wait: float = 5.0) -> bool:
    """SIGTERM every marked process group, then SIGKILL what remains.

    Returns True once no marked process is left, False if some survived SIGKILL (a process
    stuck in the kernel): the caller must then keep the GPUs allocated.
    """
    pids = marked_pids(marker)
    if not pids:
        return True
    _signal_groups(pids, signal.SIGTERM)
    if await _gone_within(marker, term_grace):
        return True
    _signal_groups(marked_pids(marker), signal.SIGKILL)
    return await _gone_within(marker, kill_wait)
