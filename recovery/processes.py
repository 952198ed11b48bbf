"""Finding and ending every process of a workload (a session or a job rank), wherever it went.

A session's processes are not one process group: Jupyter starts each kernel in a session
of its own (``start_new_session``), and a user may start more. What they share is the
environment they inherited, so every process of a workload carries
``GPUFLEET_SESSION_MARKER=<random UUID>`` and is found by reading ``/proc/<pid>/environ``
(readable by the same user, or by root). GPUs are released only once no such process
remains. The marker is random per start, not the workload id: two deployments on one
machine (or a test suite beside a demo) number their workloads independently.

Used by the local backend's spawner (sessions, through ``gpufleet.clusters.workload_processes``,
as DESIGN.md's import table has it), by the node agent's rank runner (job ranks), by the
controller's reconciler (``marked_processes``: every marked process, to find those no open
workload owns), so the rule "nothing of it runs any more" is written once, and by the node
agent's GPU read-back (``marked_process_details``: which GPUs each workload's container was
given, from its environment).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER_VARIABLE = "GPUFLEET_SESSION_MARKER"
# Set in every Kubernetes pod's container (the downward API's name and namespace, and the
# container's name), so the node agent names the pod holding a GPU in its metrics.
POD_NAME_VARIABLE = "GPUFLEET_POD_NAME"
POD_NAMESPACE_VARIABLE = "GPUFLEET_POD_NAMESPACE"
CONTAINER_VARIABLE = "GPUFLEET_CONTAINER_NAME"
POD_VARIABLES = (POD_NAME_VARIABLE, POD_NAMESPACE_VARIABLE, CONTAINER_VARIABLE)


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
    return sorted(_marked_starts(marker, proc))


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
            stat = _stat(int(entry.name), proc)
        except OSError:  # gone, or another user's
            continue
        if stat is None:
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


def _stat(pid: int, proc: Path) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (field 3 on). The name
    is the process's own choice (any bytes, a ')' included), so it is cut off as bytes:
    what follows the last ')' is the kernel's, in ASCII."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw.rsplit(b")", 1)[1].decode("ascii").split()


def start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None if it is gone."""
    stat = _stat(pid, proc)
    return None if stat is None else int(stat[19])


def running(pid: int, started: int, proc: Path = Path("/proc")) -> bool:
    """Whether process ``pid``, which started ``started`` clock ticks after boot, still
    runs: its pid is not reused, and it is neither a zombie nor dead.

    A process that is exiting drops its memory before it closes its files, and its
    environment (``/proc/<pid>/environ``) reads empty from that moment: it carries no
    marker any more, yet it may still hold a GPU's device file while the driver tears its
    context down. Only this says when it is really over; a zombie is (it holds nothing,
    its parent reaps it).
    """
    stat = _stat(pid, proc)
    return stat is not None and stat[0] not in ("Z", "X") and int(stat[19]) == started


# Every marked process a scan of this process saw, by (proc, pid): (start, marker). An
# exiting process stops showing its marker before it is over, so an ender that first looks
# once a marker's processes are being ended (a second ender: the rank runner stopping a
# pod it took over while the leftover sweep ends the job's marker) finds them here.
_ever_marked: dict[tuple[Path, int], tuple[int, str]] = {}
_ever_marked_lock = threading.Lock()


def _marked_starts(marker: str, proc: Path, remembered: bool = False) -> dict[int, int]:
    """``{pid: start}`` of the live processes carrying ``marker`` or one of its parts'; with
    ``remembered``, also those an earlier scan of this process saw carrying it that still
    run (an exiting process no longer shows its marker)."""
    part = marker + "."
    found = marked_process_details((), proc)
    showing = {process.pid for process in found}
    with _ever_marked_lock:
        for key, (started, _) in list(_ever_marked.items()):
            # What shows its marker runs; only the rest is looked up again.
            if key[0] == proc and key[1] not in showing and not running(key[1], started, proc):
                del _ever_marked[key]
        for process in found:
            _ever_marked[proc, process.pid] = (process.started, process.marker)
        if remembered:
            seen = _ever_marked.items()
            carrying = [(pid, s, m) for (where, pid), (s, m) in seen if where == proc]
        else:
            carrying = [(f.pid, f.started, f.marker) for f in found]
    return {pid: started for pid, started, m in carrying if m == marker or m.startswith(part)}


class Watch:
    """Every process of one marker seen so far: gone only when none carries the marker
    and none of those seen still :func:`running`."""

    def __init__(self, marker: str, proc: Path = Path("/proc")):
        self.marker, self.proc = marker, proc
        self.seen: dict[int, int] = {}

    def alive(self) -> list[int]:
        """The pids of what still runs (refreshing what carries the marker)."""
        self.seen.update(_marked_starts(self.marker, self.proc, remembered=True))
        self.seen = {
            pid: started for pid, started in self.seen.items() if running(pid, started, self.proc)
        }
        return sorted(self.seen)


async def _gone_within(watch: Watch, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not watch.alive():
            return True
        await asyncio.sleep(0.1)
    return not watch.alive()


async def end_all(
    marker: str, term_grace: float = 5.0, kill_wait: float = 5.0, term: bool = True
) -> bool:
    """SIGTERM every marked process group, then SIGKILL what remains (``term=False``: a
    SIGTERM was sent already, by an agent before this one: wait the grace, then SIGKILL).

    Returns True once nothing of the marker runs (:class:`Watch`), False if something
    survived SIGKILL (a process stuck in the kernel): the caller must then keep the GPUs
    allocated.
    """
    watch = Watch(marker)
    pids = watch.alive()
    if not pids:
        return True
    if term:
        _signal_groups(pids, signal.SIGTERM)
    if await _gone_within(watch, term_grace):
        return True
    _signal_groups(watch.alive(), signal.SIGKILL)
    return await _gone_within(watch, kill_wait)
