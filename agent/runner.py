"""The local backend's rank runner: job ranks as process trees that hold their GPUs.

Each rank runs in a session of its own with exactly its GPUs (``CUDA_VISIBLE_DEVICES`` by
UUID in PCI bus order, ``NVIDIA_VISIBLE_DEVICES`` the same) and a marker every descendant
inherits. Its stdout and stderr go to files of their own, which survive the rank. Stopping
a rank sends SIGTERM to all of it (the checkpoint signal), waits the grace period, then
SIGKILLs what is left; a rank counts as stopped only when no process carries its marker,
so its GPUs can be released.

The runner does the work; it does not decide. The node agent calls it for the controller.
"""

from __future__ import annotations

import os
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


@dataclass(frozen=True)
class RankStatus:
    rank_id: str
    pid: int
    state: str  # "running", "exited" (on its own) or "stopped" (by stop())
    exit_code: int | None  # the process's code; None while running or when signalled
    signal: int | None  # the signal that ended it, if one did
    stdout: Path
    stderr: Path
    started_at: float
    ended_at: float | None = None


@dataclass
class _Rank:
    spec: RankSpec
    process: subprocess.Popen[bytes]
    marker: str
    status: RankStatus


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

    def start(self, spec: RankSpec) -> RankStatus:
        current = self._ranks.get(spec.rank_id)
        if current is not None and self.status(spec.rank_id).state == "running":
            raise RankExists(f"rank {spec.rank_id} is already running (pid {current.process.pid})")
        marker = spec.marker or processes.new_marker()
        devices = ",".join(spec.gpu_uuids)
        if self.inherit:
            env = {
                **self.base_env,
                **spec.env,
                processes.MARKER_VARIABLE: marker,
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "CUDA_VISIBLE_DEVICES": devices,
                "NVIDIA_VISIBLE_DEVICES": devices or "none",
            }
        else:
            # A contained rank: its command sets the marker inside, so only the rank's own
            # processes carry it, and SIGTERM reaches them (the checkpoint signal) rather
            # than the sandbox around them, whose end would SIGKILL them at once.
            env = dict(spec.env)
        stdout = self.log_dir / f"{spec.rank_id}.stdout"
        stderr = self.log_dir / f"{spec.rank_id}.stderr"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            try:
                process = subprocess.Popen(
                    list(spec.argv),
                    env=env,
                    cwd=spec.cwd,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                raise RunnerError(f"rank {spec.rank_id} could not start: {e}") from e
        status = RankStatus(
            spec.rank_id, process.pid, "running", None, None, stdout, stderr, time.time()
        )
        self._ranks[spec.rank_id] = _Rank(spec, process, marker, status)
        return status

    def status(self, rank_id: str) -> RankStatus:
        rank = self._rank(rank_id)
        if rank.status.state == "running":
            code = rank.process.poll()
            if code is not None and not processes.marked_pids(rank.marker):
                rank.status = _ended(rank.status, "exited", code)
        return rank.status

    def statuses(self) -> list[RankStatus]:
        return [self.status(rank_id) for rank_id in self._ranks]

    async def stop(self, rank_id: str, grace: float = 30.0) -> RankStatus:
        """SIGTERM all of the rank, SIGKILL what is left after ``grace``; wait until gone."""
        rank = self._rank(rank_id)
        if self.status(rank_id).state != "running":
            return rank.status
        if not await processes.end_all(rank.marker, term_grace=grace):
            raise StopFailed(f"processes of rank {rank_id} survived SIGKILL")
        code = rank.process.wait()
        rank.status = _ended(rank.status, "stopped", code)
        return rank.status

    def forget(self, rank_id: str) -> None:
        """Drop an ended rank (its log files stay)."""
        if self.status(rank_id).state == "running":
            raise RunnerError(f"rank {rank_id} is still running; stop it first")
        del self._ranks[rank_id]

    def _rank(self, rank_id: str) -> _Rank:
        try:
            return self._ranks[rank_id]
        except KeyError:
            raise UnknownRank(f"no rank {rank_id} on this node") from None


def _ended(status: RankStatus, state: str, code: int) -> RankStatus:
    killed_by = -code if code < 0 else None
    return replace(
        status,
        state=state,
        exit_code=None if killed_by else code,
        signal=killed_by,
        ended_at=time.time(),
    )
