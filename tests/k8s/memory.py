"""Memory limits of the test kubelet's containers, and the kernel's verdict: OOMKilled.

A container whose manifest has ``resources.limits.memory`` runs each time in a cgroup v1
memory cgroup of its own, as a container runtime runs each container::

    /sys/fs/cgroup/memory/gpufleet-test-kubelet/<owner>/<pod uid>/<container>.<run>

- ``<owner>``: the test process (its pid and start time). The kubelets of one test process
  share it; a kubelet that starts removes the owners whose process is gone, with what a
  crashed run left in them (:meth:`MemoryCgroups.sweep`), and never touches a live one's.
- ``<container>.<run>``: one cgroup per run (``run`` is the container's restart count), so
  a restarted container starts with no OOM kill counted and no memory charged from the run
  before, whose leftovers may still be dying.

``memory.limit_in_bytes`` is the limit, and so is ``memory.memsw.limit_in_bytes`` where the
kernel accounts swap: a container may not hide from its limit in swap. Every process of the
run is in the cgroup from its start: the launcher's child writes its own pid to
``cgroup.procs`` before it execs the sandbox (:func:`place_self`), and every descendant
inherits it; only root outside the sandbox could move one out (``/sys`` is read-only
inside).

When a run ends, :meth:`MemoryCgroup.oom_killed` reads the kernel's verdict: the
``oom_kill`` counter of ``memory.oom_control`` (Linux 4.13 and later); without it,
``under_oom``, or a failed charge together with a SIGKILL exit. Like a runtime it counts any
process of the container the OOM killer killed, not only the first one, as the kubelet
reports ``OOMKilled`` for it. The cgroup is removed once its processes are gone (rmdir
fails while one remains); the pod's directory with its last container's.

The memory controller is cgroup v1's; where it is not mounted (a cgroup v2-only machine) or
not writable, :func:`available` says why and containers run without a limit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

CONTROLLER = Path("/sys/fs/cgroup/memory")
PARENT = "gpufleet-test-kubelet"
SIGKILL_EXIT = 128 + signal.SIGKILL  # 137, as a runtime reports a run killed by SIGKILL
KILL_WAIT_S = 5.0  # how long a sweep waits for a crashed run's processes to die
# Every kubelet of this process makes and removes cgroups in the same owner directory: one
# lock orders a removal of a pod's or the owner's directory before or after a creation in it.
_LOCK = threading.Lock()

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE](?P<exponent>[+-]?\d+))?$"
)


# ------------------------------------------------------------------ the manifest (pure)
def quantity_bytes(quantity: str | int | float) -> int:
    """A Kubernetes quantity ("512Mi", "1Gi", "100M", "1e9", "1048576") in bytes, rounded
    up as the kubelet's ``Quantity.Value()`` does; ``ValueError`` for anything else."""
    text = str(quantity).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    try:
        number = Decimal(match["number"])
    except InvalidOperation as e:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from e
    suffix, exponent = match["suffix"] or "", match["exponent"]
    if suffix in _BINARY:
        number *= Decimal(1024) ** _BINARY[suffix]
    elif exponent is not None:
        number = number.scaleb(int(exponent))
    else:
        number = number.scaleb(_DECIMAL[suffix])
    return int(number.to_integral_value(rounding=ROUND_CEILING))


def memory_limit(container: Mapping[str, Any]) -> int | None:
    """The container's memory limit in bytes (``resources.limits.memory``); None without
    one (a request alone limits nothing). ``ValueError`` for a limit that is no quantity or
    not positive."""
    limits = (container.get("resources") or {}).get("limits") or {}
    if limits.get("memory") is None:
        return None
    limit = quantity_bytes(limits["memory"])
    if limit <= 0:
        raise ValueError(f"memory limit {limits['memory']} is not positive")
    return limit


# ------------------------------------------------------------------ one run's cgroup
def place_self(cgroup: Path) -> None:
    """In a launcher's child before exec: move this process into ``cgroup``, so that
    everything it becomes and starts is in it."""
    fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)


class MemoryCgroup:
    """One container run's memory cgroup (made by :meth:`MemoryCgroups.create`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"MemoryCgroup({str(self.path)!r})"

    def pids(self) -> list[int]:
        """The live processes in it (zombies are not listed); [] once it is removed."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(pid) for pid in text.split()]

    def empty(self) -> bool:
        return not self.pids()

    def oom_killed(self, exit_code: int) -> bool:
        """Whether the kernel's OOM killer killed a process of the run (its exit code
        counts only where the kernel keeps no ``oom_kill`` counter)."""
        try:
            fields = _fields(self.path / "memory.oom_control")
        except FileNotFoundError:
            return False
        if "oom_kill" in fields:
            return fields["oom_kill"] > 0
        if fields.get("under_oom", 0) > 0:
            return True
        return exit_code == SIGKILL_EXIT and self._charges_failed()

    def _charges_failed(self) -> bool:
        for name in ("memory.failcnt", "memory.memsw.failcnt"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                if int((self.path / name).read_text()) > 0:
                    return True
        return False

    def remove(self) -> bool:
        """Removes the cgroup, and its pod's directory once that is empty; False while a
        process is still in it (try again once it is gone)."""
        if not _rmdir(self.path):
            return False
        _rmdir(self.path.parent)  # the pod's: kept while another container's cgroup is in it
        return True


def _fields(path: Path) -> dict[str, int]:
    """A cgroup file of ``name value`` lines (memory.oom_control, memory.stat)."""
    fields = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            fields[name] = int(value)
    return fields


def _rmdir(path: Path) -> bool:
    """rmdir of a cgroup: True once it is gone, False while processes or children keep it."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno in (errno.EBUSY, errno.ENOTEMPTY):
            return False
        raise
    return True


# ------------------------------------------------------------------ the kubelets' cgroups
def available(controller: Path = CONTROLLER) -> str | None:
    """None where memory cgroups can be made under ``controller``; else why not."""
    if not (controller / "cgroup.procs").exists():
        return f"the cgroup v1 memory controller is not mounted at {controller}"
    if not os.access(controller, os.W_OK):
        return f"{controller} is not writable by uid {os.geteuid()} (the kubelet runs as root)"
    return None


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks after boot), which a reused pid does not share;
    None where no process has the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_name(pid: int | None = None) -> str:
    """The owner directory's name for the process ``pid`` (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid)}"


def _owner_alive(name: str) -> bool:
    pid, _, started = name.partition("-")
    if not pid.isdigit():
        return False
    return _start_time(int(pid)) == started


class MemoryCgroups:
    """A kubelet's memory cgroups: made under this test process's owner directory, each
    removed by its pod worker once its run is gone; ``close()`` removes what is left empty
    when the kubelet stops. Thread-safe (workers create and remove at once)."""

    def __init__(self, controller: Path = CONTROLLER, parent: str = PARENT) -> None:
        self.parent = controller / parent
        self.root = self.parent / owner_name()
        self._made: set[Path] = set()

    def create(self, pod_uid: str, container: str, run: int, limit: int) -> MemoryCgroup:
        """A fresh cgroup for one run, its limit set (swap included); raises OSError."""
        path = self.root / pod_uid / f"{container}.{run}"
        with _LOCK:
            path.mkdir(parents=True, exist_ok=True)
            self._made.add(path)
        try:
            # The limit first: memsw may never be below it.
            (path / "memory.limit_in_bytes").write_text(str(limit))
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))
        except OSError:
            self.release(MemoryCgroup(path))
            raise
        return MemoryCgroup(path)

    def release(self, cgroup: MemoryCgroup) -> bool:
        """Removes a run's cgroup once nothing runs in it; False while something does."""
        with _LOCK:
            if not cgroup.remove():
                return False
            self._made.discard(cgroup.path)
            return True

    def close(self) -> list[Path]:
        """At the kubelet's stop: removes its cgroups that are empty, and the owner
        directory once no other kubelet of this process has one there. The cgroups still
        in use (their processes would not die), which the next start's sweep removes."""
        with _LOCK:
            kept = [path for path in sorted(self._made) if not MemoryCgroup(path).remove()]
            self._made = set(kept)
            if self.root.exists():
                _rmdir(self.root)
        return kept

    def sweep(self) -> list[Path]:
        """Removes the owner directories of test processes that are gone: the cgroups a
        crashed run left, after killing what still runs in them. Those it could not
        remove."""
        left = []
        with contextlib.suppress(FileNotFoundError):
            for owner in self.parent.iterdir():
                if owner.is_dir() and not _owner_alive(owner.name):
                    left += _remove_tree(owner)
        return left


def _cgroups_below(top: Path) -> Iterator[Path]:
    """``top`` and the cgroups below it, deepest first."""
    for directory, _, _ in os.walk(top, topdown=False):
        yield Path(directory)


def _remove_tree(top: Path) -> list[Path]:
    """Kills every process in the cgroups below ``top`` (a dead test process's leftovers),
    then removes them, deepest first. Those it could not remove."""
    left = []
    for path in _cgroups_below(top):
        cgroup = MemoryCgroup(path)
        deadline = time.monotonic() + KILL_WAIT_S
        while cgroup.pids() and time.monotonic() < deadline:
            for pid in cgroup.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if not _rmdir(path):
            left.append(path)
    return left
