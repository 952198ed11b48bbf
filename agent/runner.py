"""The local backend's rank runner: job ranks as process trees that hold their GPUs.

Each rank runs in a session of its own with exactly its GPUs (``CUDA_VISIBLE_DEVICES`` by
UUID in PCI bus order, ``NVIDIA_VISIBLE_DEVICES`` the same) and a marker every descendant
inherits. Its stdout and stderr go to files of their own, which survive the rank. Stopping
a rank sends SIGTERM to all of it (the checkpoint signal), waits the grace period, then
SIGKILLs what is left; a rank counts as stopped only when no process carries its marker,
so its GPUs can be released.

A rank outlives the agent that started it: it runs under a small shell of its own (in a
session of its own, so neither the agent's end nor a Ctrl-C reaches it), which records the
rank's exit status in ``<rank>.exit`` when it ends, and the runner writes what it takes to
find the rank again in ``<rank>.launcher``. A runner started later (the agent restarted,
crashed or was upgraded) takes the rank over with :meth:`RankRunner.adopt`: it watches it
as its own, and learns how it ended from the file, whoever was there to see it. A stop
begun before the restart (``<rank>.stopping``) is carried on without a second SIGTERM.

The runner does the work; it does not decide. The node agent calls it for the controller.
What a rank's process starts with (its command line under its shell, its variables, its
working directory) is :func:`rank_process`'s, a pure function; :meth:`RankRunner.start`
starts it and records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..recovery import processes


class RunnerError(Exception):
    """Base class for the rank runner's errors."""


class RankExists(RunnerError):
    """A rank with this id is already running on this node."""


class UnknownRank(RunnerError):
    """No rank with this id was started by this runner."""


class StopFailed(RunnerError):
    """Something of the rank survived SIGKILL; its GPUs must stay allocated."""


@dataclass(frozen=True)
class RankSpec:
    rank_id: str  # unique on the node, e.g. "<workload>-<pod>"
    argv: tuple[str, ...]
    gpu_uuids: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    # The marker its processes carry; None: a new random one. The controller gives a
    # job's pods the parts of the job's recorded marker (processes.part_marker).
    marker: str | None = None


# The rank's shell: it runs the command, then records its exit status for whichever agent
# is there to read it. A trapped (not ignored) SIGTERM, SIGINT or SIGHUP lets it outlive a
# signal sent to its whole process group and still record how the command ended; the
# command itself starts with the default handlers (an ignored signal would survive exec).
LAUNCHER = (
    "/bin/sh",
    "-c",
    'trap : TERM INT HUP; exit_file=$1; shift; "$@"; code=$?; echo "$code" > "$exit_file"; '
    'exit "$code"',
    "gpufleet-rank",
)
LAUNCHER_GONE_WAIT_S = 10.0  # for the shell to record, once nothing of the rank is left


@dataclass(frozen=True)
class RankProcess:
    """What a rank's process is started with: its command line under the rank's shell
    (``LAUNCHER``), its environment and its working directory."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None


def rank_process(
    spec: RankSpec, marker: str, exit_file: Path, base_env: Mapping[str, str], inherit: bool
) -> RankProcess:
    """How rank ``spec`` is started, its processes marked with ``marker`` and its shell
    recording its exit status in ``exit_file``: with ``inherit``, ``base_env``, its own
    ``env``, its marker and its GPUs' variables; without (a contained rank), only its
    ``env``. Pure."""
    if inherit:
        devices = ",".join(spec.gpu_uuids)
        env = {
            **base_env,
            **spec.env,
            processes.MARKER_VARIABLE: marker,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": devices,
            "NVIDIA_VISIBLE_DEVICES": devices or "none",
        }
    else:
        # A contained rank: its command sets the marker inside, so only the rank's own
        # processes carry it, and SIGTERM reaches them (the checkpoint signal) rather than
        # the sandbox around them, whose end would SIGKILL them at once.
        env = dict(spec.env)
    return RankProcess((*LAUNCHER, str(exit_file), *spec.argv), env, spec.cwd)


@dataclass(frozen=True)
class RankStatus:
    rank_id: str
    pid: int
    state: str  # "running", "exited" (on its own) or "stopped" (by stop())
    # The process's code; None while running, when signalled, or when it ended while no
    # agent watched and left no record of its status (``recorded`` is then False).
    exit_code: int | None
    signal: int | None  # the signal that ended it, if one did
    stdout: Path
    stderr: Path
    started_at: float
    ended_at: float | None = None
    recorded: bool = True
    stopping_since: float | None = None  # a stop begun (perhaps by an earlier agent)


@dataclass
class _Rank:
    marker: str
    status: RankStatus
    launcher_started: int  # its shell's start, in clock ticks after boot (pid reuse)
    watch: processes.Watch
    process: subprocess.Popen[bytes] | None = None  # None: adopted from an earlier agent


class RankRunner:
    def __init__(
        self, log_dir: Path, base_env: Mapping[str, str] | None = None, inherit: bool = True
    ):
        """``inherit``: a rank gets ``base_env``, the marker and its GPUs' variables besides
        its own ``env``; without, only its ``env`` (a contained rank sets the marker and its
        GPUs' variables inside its sandbox, and the command that builds the sandbox gets
        only what its caller chose)."""
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.inherit = inherit
        self._ranks: dict[str, _Rank] = {}

    def _path(self, rank_id: str, suffix: str) -> Path:
        return self.log_dir / f"{rank_id}.{suffix}"

    def start(self, spec: RankSpec) -> RankStatus:
        current = self._ranks.get(spec.rank_id)
        if current is not None and self.status(spec.rank_id).state == "running":
            raise RankExists(f"rank {spec.rank_id} is already running (pid {current.status.pid})")
        marker = spec.marker or processes.new_marker()
        for stale in ("exit", "stopping", "launcher"):
            self._path(spec.rank_id, stale).unlink(missing_ok=True)
        stdout, stderr = self._path(spec.rank_id, "stdout"), self._path(spec.rank_id, "stderr")
        launch = rank_process(
            spec, marker, self._path(spec.rank_id, "exit"), self.base_env, self.inherit
        )
        with stdout.open("wb") as out, stderr.open("wb") as err:
            try:
                process = subprocess.Popen(
                    launch.argv,
                    env=launch.env,
                    cwd=launch.cwd,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except (OSError, ValueError) as e:
                raise RunnerError(f"rank {spec.rank_id} could not start: {e}") from e
        launched = self._record_launch(spec.rank_id, process, marker)
        status = RankStatus(
            spec.rank_id, process.pid, "running", None, None, stdout, stderr, time.time()
        )
        self._ranks[spec.rank_id] = _Rank(
            marker, status, launched, processes.Watch(marker), process
        )
        return status

    def _record_launch(self, rank_id: str, process: subprocess.Popen[bytes], marker: str) -> int:
        """Write what a later runner needs to find the rank again (``<rank>.launcher``);
        its shell's start, in clock ticks after boot. Without the record the rank is
        killed: no later agent could find it, and it must not run on unseen."""
        launched = processes.start_ticks(process.pid) or 0
        record = {
            "pid": process.pid,
            "started": launched,
            "boot": _boot_id(),
            "marker": marker,
            "at": time.time(),
        }
        try:
            write_whole(self._path(rank_id, "launcher"), json.dumps(record) + "\n")
        except OSError as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RunnerError(f"rank {rank_id} could not be recorded: {e}") from e
        return launched

    def adopt(self, rank_id: str) -> RankStatus:
        """Take over rank ``rank_id``, started by an earlier runner with this log
        directory: running if anything of it still runs, else how it ended (from its
        exit file; ``recorded`` False without one). Raises ``UnknownRank`` when no runner
        started it here."""
        current = self._ranks.get(rank_id)
        if current is not None:
            return self.status(rank_id)
        try:
            record = json.loads(self._path(rank_id, "launcher").read_text())
            pid, started, marker = int(record["pid"]), int(record["started"]), str(record["marker"])
            at = float(record["at"])
        except (OSError, ValueError, KeyError, TypeError):
            raise UnknownRank(f"no rank {rank_id} was started on this node") from None
        stopping = _read_float(self._path(rank_id, "stopping"))
        status = RankStatus(
            rank_id,
            pid,
            "running",
            None,
            None,
            self._path(rank_id, "stdout"),
            self._path(rank_id, "stderr"),
            at,
            stopping_since=stopping,
        )
        self._ranks[rank_id] = _Rank(marker, status, started, processes.Watch(marker))
        if record.get("boot", _boot_id()) != _boot_id():
            # The machine restarted since: nothing of it runs, whatever has its pid now.
            self._ranks[rank_id].status = _ended(status, "exited", self._exit_code_of(rank_id))
        return self.status(rank_id)

    def status(self, rank_id: str) -> RankStatus:
        rank = self._rank(rank_id)
        if rank.status.state == "running" and not self._runs(rank):
            code = self._exit_code(rank)
            state = "stopped" if rank.status.stopping_since is not None else "exited"
            rank.status = _ended(rank.status, state, code)
        return rank.status

    def statuses(self) -> list[RankStatus]:
        return [self.status(rank_id) for rank_id in self._ranks]

    def _runs(self, rank: _Rank) -> bool:
        if rank.process is not None:
            launcher_runs = rank.process.poll() is None
        else:
            launcher_runs = processes.running(rank.status.pid, rank.launcher_started)
        return launcher_runs or bool(rank.watch.alive())

    def _exit_code(self, rank: _Rank) -> int | None:
        """How the rank's shell ended: its own exit status when it was this runner's child,
        else what it recorded (None without a record: killed before it could write one)."""
        if rank.process is not None:
            return rank.process.wait()
        return self._exit_code_of(rank.status.rank_id)

    def _exit_code_of(self, rank_id: str) -> int | None:
        text = ""
        with contextlib.suppress(OSError):
            text = self._path(rank_id, "exit").read_text().strip()
        return int(text) if text.lstrip("-").isdigit() and len(text) < 12 else None

    async def stop(self, rank_id: str, grace: float = 30.0) -> RankStatus:
        """SIGTERM all of the rank, SIGKILL what is left after ``grace``; wait until gone.
        A stop an earlier agent began is carried on: the grace counts from its SIGTERM,
        which is not sent again."""
        rank = self._rank(rank_id)
        if self.status(rank_id).state != "running":
            return rank.status
        began = rank.status.stopping_since
        if began is None:
            began = time.time()
            write_whole(self._path(rank_id, "stopping"), f"{began}\n")
            rank.status = replace(rank.status, stopping_since=began)
            term, left = True, grace
        else:
            term, left = False, max(0.0, began + grace - time.time())
        if not await processes.end_all(rank.marker, term_grace=left, term=term):
            raise StopFailed(f"processes of rank {rank_id} survived SIGKILL")
        # Its shell records how the rank ended, then exits.
        deadline = time.monotonic() + LAUNCHER_GONE_WAIT_S
        while time.monotonic() < deadline:
            if not self._runs(rank):
                break
            await asyncio.sleep(0.05)
        else:
            raise StopFailed(f"the shell of rank {rank_id} (pid {rank.status.pid}) did not end")
        rank.status = _ended(rank.status, "stopped", self._exit_code(rank))
        return rank.status

    def forget(self, rank_id: str) -> None:
        """Drop an ended rank (its log files stay); an unknown one is forgotten already."""
        if rank_id not in self._ranks:
            return
        if self.status(rank_id).state == "running":
            raise RunnerError(f"rank {rank_id} is still running; stop it first")
        del self._ranks[rank_id]

    def _rank(self, rank_id: str) -> _Rank:
        try:
            return self._ranks[rank_id]
        except KeyError:
            raise UnknownRank(f"no rank {rank_id} on this node") from None


def _ended(status: RankStatus, state: str, code: int | None) -> RankStatus:
    killed_by = -code if code is not None and code < 0 else None
    return replace(
        status,
        state=state,
        exit_code=None if killed_by else code,
        signal=killed_by,
        ended_at=time.time(),
        recorded=code is not None,
    )


def _boot_id() -> str:
    """This boot of the machine: a pid and its start time name one process only within it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def write_whole(path: Path, text: str) -> None:
    """``path`` with ``text``, whole or not at all: a reader (an agent started later)
    never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None
