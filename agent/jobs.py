"""The node agent's job pods: torchrun process groups for the pods the controller placed
on this agent's nodes, their per-rank logs, and their ends.

The controller says what should run (``DesiredPod``s from ``POST /agent/pods``); the
keeper makes it so and reports what runs. Each pod is one ``torchrun`` launcher run by
the ``RankRunner`` with exactly the pod's GPUs, under the session's own Python:

    <python> -m torch.distributed.run --nnodes=<pods> --node-rank=<pod>
        --nproc-per-node=<gpus per pod> --master-addr=<addr> --master-port=<port>
        --log-dir=<pod dir>/ranks --redirects=3 <script> <args...>

so every GPU gets one rank with the usual RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. torchrun writes each local rank's stdout and stderr to files of their own;
the keeper sends what is new in them with every sync, as chunks at byte offsets (sent
again until the controller has them; stored once).

Invariants:
- a pod is reported ended only after its whole process group is gone (the runner
  checks the marker), and only after its logs were read to the end: the chunks travel
  in the same sync as the end, and the controller stores them first;
- a pod this agent was told to run but does not know although the controller saw it
  start (the agent restarted) is not started again: what is left of it is ended and it
  is reported failed, so the job fails visibly instead of running twice;
- the ranks run in their user's containment (``containment.py``): the session sandbox, as
  the account the controller recorded for the user, never as root; a pod without an
  account, or on a machine where the sandbox cannot run, is not started (it is reported
  failed, saying why). They inherit nothing of the agent's environment: never its token.

The local backend runs every pod of a job through this one agent, so the rendezvous is
this machine's loopback with a port the keeper picks for each job.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import os
import pwd
import re
import socket
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from ..recovery import processes
from ..snapshotter.sandbox import (
    RootEntry,
    SandboxDirs,
    SandboxMode,
    SandboxSupport,
    host_root,
    layer_dirs,
    owned_prefix,
    prepare_dirs,
    write_identity,
)
from .checkpoints import checkpoint_credentials, checkpoint_place
from .containment import OUTER_PATH, RankAccount, rank_command, rank_environment
from .network_guard import GuardUnavailable, NetworkGuard
from .progress import RankReport, merge
from .runner import RankRunner, RankSpec, RankStatus, RunnerError, StopFailed

INHERITED = ("LANG", "LC_ALL", "TZ")
CHUNK_BYTES = 256 * 1024
ERROR_FILE_BYTES = 64 * 1024  # torchrun's error file: the exception and its traceback
CHUNKS_PER_SYNC = 32  # 8 MiB per pod and sync at most: a chatty rank cannot swell a request
# torchrun's summary of a failed child: "rank      : 1 (local_rank: 1)"
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_LAUNCHER_STREAMS = ("stdout", "stderr")
# PyTorch starts the lines a rank writes through its logging with "[rank1]: ".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


@dataclass
class _LogFile:
    """One file being tailed: where it was read to, and where its stream stands."""

    rank: int
    stream: str
    position: int = 0  # bytes of the file read
    offset: int = 0  # bytes of the stream sent (as UTF-8 text; see _read_new)
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


@dataclass
class _Pod:
    workload_id: int
    pod_index: int
    rank_id: str
    directory: Path
    first_rank: int
    local_ranks: int
    grace_s: float = 30.0
    state: str = "running"
    # How its process group ended ("exited" on its own, or "stopped" by the agent), noted
    # as soon as it is gone; reported once its logs have been read to the end.
    ending: tuple[str, RankStatus] | None = None  # running | exited | stopped | failed
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    stopping: asyncio.Task[None] | None = None
    logs: dict[tuple[int, str], _LogFile] = field(default_factory=dict)
    marker: str = ""  # its processes' marker: how its ranks' progress reports say who they are
    attempt: int = 1  # the job's attempt it belongs to (its reports and chunks say so)


@dataclass(frozen=True)
class RankSandbox:
    """Where and how this node runs ranks (``containment.py``): the sandbox the machine
    allows, the sessions' base environment and the prefix of a job's own environment
    inside, users' homes, and what every rank sees read-only (the fake NVML library)."""

    support: SandboxSupport
    base_env: Path
    prefix: Path
    home_dir_template: str
    read_only: tuple[Path, ...] = ()
    root: tuple[RootEntry, ...] = field(default_factory=host_root)
    unavailable: str = ""  # why no rank may start here (the loopback guard cannot be had)
    checkpoint_root: Path = Path(".gpufleet/checkpoints")  # users' checkpoints (c.NodeAgent)
    # Each user's S3 credentials for their checkpoint prefix, and where S3 is
    # (c.NodeAgent.checkpoint_credentials_file, checkpoint_s3_endpoint).
    s3_credentials: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    s3_endpoint: str = ""
    s3_region: str = "us-east-1"

    def home(self, username: str) -> Path:
        return Path(self.home_dir_template.format(username=username))


class PodKeeper:
    def __init__(
        self,
        jobs_dir: Path,
        log: logging.Logger,
        base_env: Mapping[str, str],
        sandbox: RankSandbox,
        guard: NetworkGuard | None = None,
        progress_url: str = "",
    ):
        self.progress_url = progress_url  # where ranks report progress (agent/progress.py)
        self._progress: dict[tuple[int, int], dict[str, Any]] = {}
        self.jobs_dir = Path(jobs_dir)
        self.jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Resolved: every log path below it then has no link the agent put there, so
        # open_regular may refuse every link it meets.
        self.jobs_dir = self.jobs_dir.resolve()
        self.log = log
        self.base_env = {k: v for k, v in base_env.items() if k in INHERITED}
        self.sandbox = sandbox
        self.guard = guard
        self.runner = RankRunner(
            self.jobs_dir / "launchers", {**self.base_env, "PATH": OUTER_PATH}, inherit=False
        )
        self._pods: dict[tuple[int, int], _Pod] = {}
        self._ports: dict[int, int] = {}
        self._unsent: list[dict[str, Any]] = []
        # Leftover markers being ended, and those found gone (not yet reported).
        self._ending_leftovers: dict[str, asyncio.Task[None]] = {}
        self._gone: set[str] = set()

    # ------------------------------------------------------------- the sync
    def known(self) -> list[tuple[int, int]]:
        return sorted(self._pods)

    # ------------------------------------------------------------ leftovers
    def end_leftovers(self, leftovers: Iterable[Mapping[str, Any]]) -> None:
        """End what may be left of pods the controller gave up on while this node's agent
        was silent (an agent before this one may have run them): every process carrying
        each marker, then report the marker gone (``take_gone``)."""
        for leftover in leftovers:
            marker = str(leftover["marker"])
            if marker and marker not in self._ending_leftovers and marker not in self._gone:
                self._ending_leftovers[marker] = asyncio.create_task(self._end_leftover(marker))

    async def _end_leftover(self, marker: str) -> None:
        try:
            if await processes.end_all(marker):
                self.log.info("nothing carrying leftover marker %s runs any more", marker)
                self._gone.add(marker)
            else:
                self.log.error("processes with leftover marker %s survived SIGKILL", marker)
        finally:
            del self._ending_leftovers[marker]

    def ending_leftovers(self) -> bool:
        return bool(self._ending_leftovers)

    def take_gone(self) -> list[str]:
        """The leftover markers to report gone with this sync (``restore_gone`` if it fails)."""
        gone = sorted(self._gone)
        self._gone.clear()
        return gone

    def restore_gone(self, gone: Iterable[str]) -> None:
        self._gone.update(gone)

    # ------------------------------------------------------------- progress
    def pod_of_marker(self, marker: str) -> tuple[int, int] | None:
        """The running pod whose processes carry ``marker``."""
        if not marker:
            return None
        for key, pod in self._pods.items():
            if pod.marker == marker and pod.state == "running":
                return key
        return None

    def note_progress(self, key: tuple[int, int], report: RankReport, now: datetime) -> None:
        self._progress[key] = merge(self._progress.get(key), report, now)

    def take_progress(self) -> list[dict[str, Any]]:
        """The progress to send with this sync (given back with ``restore_progress`` if the
        sync fails)."""
        taken = [
            {"workload_id": wid, "pod_index": pod, **kept}
            for (wid, pod), kept in sorted(self._progress.items())
        ]
        self._progress = {}
        return taken

    def restore_progress(self, taken: list[dict[str, Any]]) -> None:
        for item in taken:
            key = (int(item["workload_id"]), int(item["pod_index"]))
            newer = self._progress.get(key)
            kept = {k: v for k, v in item.items() if k not in ("workload_id", "pod_index")}
            if newer is not None:  # what came since wins; what was saved is kept
                kept["checkpoints_saved"] = [
                    *kept.get("checkpoints_saved", []),
                    *newer.get("checkpoints_saved", []),
                ]
                kept["step_times_s"] = [*kept["step_times_s"], *newer["step_times_s"]]
                kept.update(
                    {
                        k: v
                        for k, v in newer.items()
                        if k not in ("checkpoints_saved", "step_times_s")
                    }
                )
            self._progress[key] = kept

    def busy(self) -> bool:
        """Something to report now: a pod ended, log chunks or gone leftovers wait."""
        return bool(self._unsent or self._gone) or any(
            p.state != "running" or p.ending is not None for p in self._pods.values()
        )

    def report(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every known pod's state and the log chunks not yet acknowledged."""
        for pod in self._pods.values():
            if pod.state == "running" and pod.ending is None and pod.stopping is None:
                status = self.runner.status(pod.rank_id)
                if status.state != "running":
                    pod.ending = ("exited", status)
            chunks, drained = self._read_logs(pod)
            self._unsent += chunks
            if pod.state == "running" and pod.ending is not None and drained:
                state, status = pod.ending
                self._record_end(pod, state, status)  # logs whole: the group is gone
        pods = [
            {
                "workload_id": pod.workload_id,
                "pod_index": pod.pod_index,
                "state": pod.state,
                "exit_code": pod.exit_code,
                "signal": pod.signal,
                "reason": pod.reason[:2000],
                "attempt": pod.attempt,
            }
            for pod in self._pods.values()
        ]
        return pods, list(self._unsent)

    def acknowledged(self, chunks: int) -> None:
        """The controller stored the first ``chunks`` chunks of the last report."""
        del self._unsent[:chunks]

    async def apply(self, desired: Iterable[Mapping[str, Any]]) -> None:
        wanted: set[tuple[int, int]] = set()
        for pod in desired:
            key = (int(pod["workload_id"]), int(pod["pod_index"]))
            wanted.add(key)
            known = self._pods.get(key)
            attempt = int(pod.get("attempt", 1))
            if known is not None and known.attempt < attempt and known.state != "running":
                self._forget(known)  # the pod of an ended attempt: the new one starts anew
                known = None
            if pod["run"] and known is None:
                if pod["started"]:
                    await self._lost(pod)
                else:
                    pinned = await asyncio.to_thread(self._pinned_environment, pod)
                    self._start(pod, pinned)
            elif not pod["run"]:
                if known is None:
                    await self._absent(pod)
                else:
                    self._stop(known)
        for key, known in list(self._pods.items()):
            if key in wanted:
                continue
            if known.state == "running":
                self._stop(known)  # not ours any more: the controller ended it
            elif known.stopping is None or known.stopping.done():
                self._forget(known)

    # ------------------------------------------------------------- starting
    def _pinned_environment(self, desired: Mapping[str, Any]) -> Path | str | None:
        """The copy of its session's environment the controller made when the job was
        submitted (its overlay upper directory as it was then), with a layer directory for
        each of the root's; None for a job without one. A copy that is gone is why the pod
        does not start (a str). Blocking."""
        pinned = str(desired["spec"].get("environment_pinned") or "")
        if not pinned or not self.sandbox.support.overlay:
            return None
        path = Path(pinned)
        if not path.is_dir() or path.resolve() != path:
            return f"its copy of its session's environment {pinned} is not there any more"
        for layer in layer_dirs(path, self.sandbox.root):
            layer.mkdir(exist_ok=True)
        return path

    def _start(self, desired: Mapping[str, Any], pinned: Path | str | None = None) -> None:
        workload_id, pod_index = int(desired["workload_id"]), int(desired["pod_index"])
        attempt = int(desired.get("attempt", 1))
        spec = desired["spec"]
        # Each attempt has directories of its own: its logs start empty.
        suffix = "" if attempt == 1 else f"-attempt-{attempt}"
        pod_dir = self.jobs_dir / str(workload_id) / f"pod-{pod_index}{suffix}"
        per_pod = int(desired["gpus_per_pod"])
        pod = _Pod(
            workload_id,
            pod_index,
            f"{workload_id}-{pod_index}{suffix}",
            pod_dir,
            first_rank=pod_index * per_pod,
            local_ranks=per_pod,
            grace_s=float(spec.get("grace_s", 30.0)),
            marker=processes.part_marker(str(desired["marker"]), pod_index),
            attempt=attempt,
        )
        self._pods[workload_id, pod_index] = pod
        try:
            if isinstance(pinned, str):
                raise RunnerError(pinned)
            argv, outer_env = self._contained(desired, pod, pinned)
            self.runner.start(
                RankSpec(
                    rank_id=pod.rank_id,
                    argv=tuple(argv),
                    gpu_uuids=tuple(desired["gpu_uuids"]),
                    env=outer_env,
                    cwd="/",
                    marker=processes.part_marker(str(desired["marker"]), pod_index),
                )
            )
        except (OSError, RunnerError, ValueError) as e:
            pod.state, pod.reason = "failed", f"could not start: {e}"
            self.log.warning("job %s pod %s %s", workload_id, pod_index, pod.reason)
            return
        self.log.info(
            "started job %s pod %s (%d rank(s)) on %s as uid %s",
            workload_id,
            pod_index,
            per_pod,
            desired["node"],
            (desired.get("account") or {}).get("uid"),
        )

    def _contained(
        self, desired: Mapping[str, Any], pod: _Pod, pinned: Path | None
    ) -> tuple[list[str], dict[str, str]]:
        """The pod's torchrun as its user's contained command, its directories made; and
        the agent's own environment for it. Raises ``RunnerError`` where it cannot run
        contained. Blocking (small files and directories only)."""
        workload_id, pod_index = pod.workload_id, pod.pod_index
        spec = desired["spec"]
        sandbox = self.sandbox
        account_json = desired.get("account")
        if not account_json or int(account_json.get("uid", 0)) == 0:
            raise RunnerError("the controller gave no account to run its ranks as")
        if sandbox.unavailable:
            raise RunnerError(sandbox.unavailable)
        if sandbox.support.mode is SandboxMode.NONE:
            raise RunnerError(
                f"job ranks run only in the bubblewrap sandbox, and it cannot run on this "
                f"node ({sandbox.support.reason}); install bubblewrap"
            )
        if not (sandbox.base_env / "bin" / "python").exists():
            raise RunnerError(
                f"the sessions' base environment {sandbox.base_env} is missing on this node "
                "(scripts/build-session-env)"
            )
        username = str(desired["username"])
        uid, gid = int(account_json["uid"]), int(account_json["gid"])
        system = account_json.get("mode") == "system"
        try:
            home = Path(pwd.getpwnam(username).pw_dir) if system else sandbox.home(username)
        except KeyError:
            raise RunnerError(f"there is no account {username} on this node") from None
        account = RankAccount(username, uid, gid, home)
        job_dir = self.jobs_dir / str(workload_id)
        job_dir.mkdir(mode=0o700, exist_ok=True)
        # What the ranks write (torchrun's per-rank logs) is theirs; the keeper reads it
        # back without following their links (_read_new).
        ranks_dir = pod.directory / "ranks"
        dirs = SandboxDirs(pod.directory / "sandbox")
        for path in (pod.directory, dirs.root):
            path.mkdir(mode=0o700, exist_ok=True)
        ranks_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(ranks_dir, uid, gid)
        _prepare_layers(dirs, sandbox.root, account, sandbox.prefix)
        writable_at: list[tuple[Path, Path]] = []
        if not sandbox.support.overlay:
            # No layer of its own to hold the job's environment: a directory of the pod's,
            # at the prefix's place (an empty mount point of root's on the host).
            sandbox.prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
            _owned_directory(pod.directory / "env", uid, gid)
            writable_at.append((pod.directory / "env", sandbox.prefix))
        script = job_dir / str(spec["script_name"])
        if not script.exists():
            script.write_text(str(spec["script"]))
            script.chmod(0o644)
        writable = [ranks_dir]
        checkpoint = str(spec.get("checkpoint_uri", ""))
        if checkpoint and "://" not in checkpoint:
            place = checkpoint_place(Path(checkpoint), account, sandbox.checkpoint_root)
            if place != account.home:
                writable.append(place)
        if not account.home.is_dir():
            _owned_directory(account.home, uid, gid, mode=0o700)
        cwd = Path(str(spec.get("cwd") or account.home))
        if not (cwd == account.home or cwd.is_relative_to(account.home)) or not cwd.is_dir():
            cwd = account.home
        port = self._ports.get(workload_id)
        if port is None:
            port = _free_port()
            if self.guard is not None:
                # Its rendezvous store answers anyone who connects: only its user may.
                try:
                    self.guard.allow_rendezvous(port, uid)
                except GuardUnavailable as e:
                    raise RunnerError(str(e)) from e
            self._ports[workload_id] = port
        per_pod = int(desired["gpus_per_pod"])
        python = str(spec.get("python") or sandbox.prefix / "bin" / "python")
        argv = (
            python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={desired['pods']}",
            f"--node-rank={pod_index}",
            f"--nproc-per-node={per_pod}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            f"--log-dir={ranks_dir}",
            "--redirects=3",
            str(script),
            *(str(a) for a in spec.get("args", [])),
        )
        marker = processes.part_marker(str(desired["marker"]), pod_index)
        devices = ",".join(desired["gpu_uuids"])
        platform = {
            processes.MARKER_VARIABLE: marker,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": devices,
            "NVIDIA_VISIBLE_DEVICES": devices or "none",
            "PYTHONUNBUFFERED": "1",
            "GPUFLEET_JOB_ID": str(workload_id),
            "GPUFLEET_JOB_NAME": str(desired["name"]),
            "GPUFLEET_POD_INDEX": str(pod_index),
            "GPUFLEET_CHECKPOINT_URI": checkpoint,
            "GPUFLEET_ATTEMPT": str(pod.attempt),
            "GPUFLEET_RESUME_FROM": str(desired.get("resume_from") or ""),
            **({"GPUFLEET_PROGRESS_URL": self.progress_url} if self.progress_url else {}),
            **_fake_nvml_env(sandbox.read_only),
            **checkpoint_credentials(checkpoint, username, sandbox),
        }
        chosen = {str(k): str(v) for k, v in dict(spec.get("env", {})).items()}
        env = rank_environment(account, sandbox.base_env, sandbox.prefix, chosen, platform)
        read_only = [(path, path) for path in (*sandbox.read_only, script)]
        # The passwd and group files over the host's: the user has an entry inside (a
        # system account has its own already).
        if not system:
            read_only += write_identity(dirs.root, username, uid, gid, account.home)
        command = rank_command(
            sandbox.support,
            dirs,
            root=sandbox.root,
            account=account,
            base_env=sandbox.base_env,
            prefix=sandbox.prefix,
            argv=argv,
            env=env,
            cwd=cwd,
            writable=writable,
            writable_at=writable_at,
            read_only=read_only,
            pinned=pinned,
        )
        return command, {"PATH": OUTER_PATH, "LANG": "C.UTF-8"}

    async def _lost(self, desired: Mapping[str, Any]) -> None:
        """A pod that started under an earlier agent: end what is left, report it failed."""
        marker = processes.part_marker(str(desired["marker"]), int(desired["pod_index"]))
        await processes.end_all(marker)
        pod = self._placeholder(desired)
        pod.state = "failed"
        pod.reason = "the node agent restarted and lost track of this pod's processes"

    async def _absent(self, desired: Mapping[str, Any]) -> None:
        """A pod to stop that this agent does not run: make sure nothing of it does."""
        marker = processes.part_marker(str(desired["marker"]), int(desired["pod_index"]))
        if not await processes.end_all(marker):
            return  # something survived SIGKILL: not gone, so not reported
        pod = self._placeholder(desired)
        pod.state = "stopped"

    def _placeholder(self, desired: Mapping[str, Any]) -> _Pod:
        workload_id, pod_index = int(desired["workload_id"]), int(desired["pod_index"])
        pod = _Pod(workload_id, pod_index, "", Path(), 0, 0, attempt=int(desired.get("attempt", 1)))
        self._pods[workload_id, pod_index] = pod
        return pod

    # ------------------------------------------------------------- stopping
    def _stop(self, pod: _Pod) -> None:
        if pod.state != "running" or pod.stopping is not None or pod.ending is not None:
            return  # ended, or being stopped already

        async def stop() -> None:
            try:
                status = await self.runner.stop(pod.rank_id, grace=pod.grace_s)
            except StopFailed as e:
                self.log.error("job %s pod %s: %s", pod.workload_id, pod.pod_index, e)
                pod.stopping = None  # still running: the next apply tries again
                return
            pod.ending = ("stopped", status)  # reported by report(), with its last logs

        self.log.info("stopping job %s pod %s", pod.workload_id, pod.pod_index)
        pod.stopping = asyncio.create_task(stop())

    def _record_end(self, pod: _Pod, state: str, status: RankStatus) -> None:
        pod.state, pod.exit_code, pod.signal = state, status.exit_code, status.signal
        if state == "exited" and status.exit_code != 0:
            pod.reason = self._failure_reason(pod)
        self.log.info(
            "job %s pod %s %s (exit code %s, signal %s)",
            pod.workload_id,
            pod.pod_index,
            state,
            status.exit_code,
            status.signal,
        )

    def _forget(self, pod: _Pod) -> None:
        del self._pods[pod.workload_id, pod.pod_index]
        if pod.rank_id:
            self.runner.forget(pod.rank_id)
        if not any(key[0] == pod.workload_id for key in self._pods):
            port = self._ports.pop(pod.workload_id, None)
            if port is not None and self.guard is not None:
                try:
                    self.guard.forget_rendezvous(port)
                except GuardUnavailable as e:
                    self.log.warning(
                        "could not close job %s's rendezvous rule: %s", pod.workload_id, e
                    )

    # ------------------------------------------------------------- logs
    def _log_files(self, pod: _Pod) -> list[tuple[int, str, Path]]:
        if not pod.rank_id:
            return []
        files = [
            (-1 - pod.pod_index, stream, self.runner.log_dir / f"{pod.rank_id}.{stream}")
            for stream in _LAUNCHER_STREAMS
        ]
        attempts = sorted((pod.directory / "ranks").glob("*/attempt_*"))
        if attempts:
            latest = attempts[-1]
            for local in range(pod.local_ranks):
                for stream in _LAUNCHER_STREAMS:
                    path = latest / str(local) / f"{stream}.log"
                    files.append((pod.first_rank + local, stream, path))
        return files

    def _read_logs(self, pod: _Pod) -> tuple[list[dict[str, Any]], bool]:
        """What is new in the pod's log files, at most ``CHUNKS_PER_SYNC`` chunks; and
        whether that was all of it."""
        chunks: list[dict[str, Any]] = []
        for rank, stream, path in self._log_files(pod):
            tail = pod.logs.setdefault((rank, stream), _LogFile(rank, stream))
            while len(chunks) < CHUNKS_PER_SYNC:
                chunk = _read_new(tail, path)
                if chunk is None:
                    break
                chunks.append({"workload_id": pod.workload_id, "attempt": pod.attempt, **chunk})
            else:
                return chunks, False
        return chunks, True

    def _failure_reason(self, pod: _Pod) -> str:
        """What the first rank to fail recorded of its exception in torchrun's error file
        (``TORCHELASTIC_ERROR_FILE``: a script whose entry point is wrapped in torch's
        ``@record``), else the last line it wrote to stderr, else the launcher's."""
        launcher = _last_line(self.runner.log_dir / f"{pod.rank_id}.stderr", everything=True)
        # torchrun lists every failed rank, and last the root cause: the first to fail.
        root_cause = launcher.rfind("Root Cause")
        failed = _FAILED_RANK.search(launcher, max(root_cause, 0))
        if failed is not None:
            recorded = rank_error(pod.directory / "ranks", int(failed.group(2)))
            if recorded:
                return f"rank {failed.group(1)}: {recorded}"
        for rank, stream, path in self._log_files(pod):
            if stream != "stderr" or rank < 0:
                continue
            if failed is not None and rank != int(failed.group(1)):
                continue
            line = _RANK_PREFIX.sub("", _last_line(path))
            if line:
                return f"rank {rank}: {line}"
        return _last_line(self.runner.log_dir / f"{pod.rank_id}.stderr")


def _read_new(tail: _LogFile, path: Path) -> dict[str, Any] | None:
    """The next chunk of ``path`` past what was read, as text; None when nothing new.

    Offsets count the UTF-8 bytes of the text sent, so a stream's offsets stay
    consistent even where the file held bytes that are not UTF-8 (sent as U+FFFD).
    """
    try:
        with open_regular(path) as f:
            f.seek(tail.position)
            raw = f.read(CHUNK_BYTES)
    except OSError:  # gone, not yet there, or not a plain file of the rank's own
        return None
    if not raw:
        return None
    tail.position += len(raw)
    text = tail.decoder.decode(raw)
    if not text:
        return None  # the start of a multi-byte character: the rest comes next time
    chunk = {"rank": tail.rank, "stream": tail.stream, "offset": tail.offset, "data": text}
    tail.offset += len(text.encode())
    return chunk


def _last_line(path: Path, everything: bool = False) -> str:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    if everything:
        return text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def rank_error(ranks_dir: Path, local_rank: int) -> str:
    """The exception a local rank recorded in the error file torchrun gave it
    (``<log dir>/<run>/attempt_<n>/<local rank>/error.json``, the latest attempt's), as
    ``"Type: message"``; "" when it wrote none or the file is not one torch writes."""
    attempts = sorted(ranks_dir.glob("*/attempt_*"))
    if not attempts:
        return ""
    try:
        with open_regular(attempts[-1] / str(local_rank) / "error.json") as f:
            data = json.loads(f.read(ERROR_FILE_BYTES))
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message.strip()[:2000] if isinstance(message, str) else ""


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading as it is, never through a symbolic link: the agent runs
    as root and the ranks, which write these files, could otherwise make it read anything
    (a secret, another user's file) by replacing a log or one of its directories with a
    link. Each directory below the root-owned jobs directory is entered with
    ``O_NOFOLLOW``, and only a plain file is read. Raises ``OSError`` otherwise."""
    parts = path.parts
    fd = os.open(parts[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[1:-1]:
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise OSError(f"{path} is not a plain file")
    return os.fdopen(file_fd, "rb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _prepare_layers(
    dirs: SandboxDirs, root: tuple[RootEntry, ...], account: RankAccount, prefix: Path
) -> None:
    """The pod's own overlay layers, scratch and mount-point directories and /tmp
    (:func:`.sandbox.prepare_dirs`), and the job's environment prefix in its upper layer
    owned by the user, so the launcher can make its venv there."""
    prepare_dirs(dirs, True, root)
    owned_prefix(dirs.upper, prefix, account.uid, account.gid)


def _owned_directory(path: Path, uid: int, gid: int, mode: int = 0o755) -> None:
    """``path`` as a directory of the user's (made with root-owned parents if missing)."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = path.lstat()
    if (info.st_uid, info.st_gid) != (uid, gid):
        os.chown(path, uid, gid, follow_symlinks=False)


def _fake_nvml_env(read_only: tuple[Path, ...]) -> dict[str, str]:
    """Where a rank finds gpufleet's fake NVML library, when this node serves it."""
    for directory in read_only:
        if (directory / "libnvidia-ml.so.1").exists():
            return {
                "LD_LIBRARY_PATH": str(directory),
                "GPUFLEET_FAKE_NVML_CONTROL": str(directory / "control"),
            }
    return {}
