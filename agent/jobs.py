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
again until the controller has them; stored once; ``job_logs.py``).

Invariants:
- a pod is reported ended only after its whole process group is gone (the runner
  checks the marker), and only after its logs were read to the end: the chunks travel
  in the same sync as the end, and the controller stores them first;
- whatever a job asks for, preparing or starting its pod ends that pod alone (reported
  failed, with what to change): never the agent, never another pod;
- the agent's own restart (a crash, ``kill -9``, an upgrade) costs no pod anything: its
  ranks outlive it, and the next agent takes over every pod it finds alive (from the pod's
  record, ``pod.json``, and the runner's) and goes on watching it, its logs from where the
  controller acknowledged them; a pod that ended meanwhile is reported as it ended;
- the ranks run in their user's containment (``containment.py``): the session sandbox, as
  the account the controller recorded for the user, never as root; a pod without an
  account, or on a machine where the sandbox cannot run, is not started (it is reported
  failed, saying why). They inherit nothing of the agent's environment: never its token.

The local backend runs every pod of a job through this one agent, so the rendezvous is
this machine's loopback with a port the keeper picks for each job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..recovery import processes
from ..recovery.classify import ENDED_BY_AGENT_RESTART, NODE_COULD_NOT_START, REFUSED_AS_ASKED
from . import peers
from .containment import OUTER_PATH
from .job_launch import (
    JobRefused,
    PodPlace,
    RankSandbox,
    contained_command,
    free_port,
    pinned_environment,
    rank_account,
)
from .job_logs import (
    LogFile,
    failure_reason,
    load_tails,
    open_regular,
    pod_log_files,
    read_new,
    save_tails,
)
from .network_guard import GuardUnavailable, NetworkGuard
from .progress import MAX_SAVED, MAX_STEP_TIMES, RankReport, merge, own_checkpoints_only
from .runner import (
    RankRunner,
    RankSpec,
    RankStatus,
    RunnerError,
    StopFailed,
    UnknownRank,
    write_whole,
)

__all__ = ["PodKeeper", "RankSandbox"]

INHERITED = ("LANG", "LC_ALL", "TZ")
CHUNKS_PER_SYNC = 32  # 8 MiB per pod and sync at most: a chatty rank cannot swell a request
RECORD_FILE = "pod.json"
# Why a pod ended with nothing to say for itself: no agent watched it end, and its shell
# was killed before it could record how (the machine went down with it, say).
ENDED_UNWATCHED = (
    "ended while no node agent watched it, and left no exit status (the machine may have restarted)"
)


@dataclass
class _Pod:
    place: PodPlace
    first_rank: int
    local_ranks: int
    marker: str  # its processes' marker: how its ranks' progress reports say who they are
    grace_s: float = 30.0
    state: str = "running"  # running | exited | stopped | failed
    # How its process group ended ("exited" on its own, or "stopped" by the agent), noted
    # as soon as it is gone; reported once its logs have been read to the end.
    ending: tuple[str, RankStatus] | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    stopping: asyncio.Task[None] | None = None
    logs: dict[tuple[int, str], LogFile] = field(default_factory=dict)
    launched: bool = False  # the runner knows its rank (False: it never started)
    uid: int | None = None  # whom its ranks run as: progress comes only from that account
    checkpoint_uri: str = ""  # its job's checkpoint location: reports must point inside
    adopted: bool = False  # taken over from an earlier agent: said in the next report

    @property
    def key(self) -> tuple[int, int]:
        return self.place.workload_id, self.place.pod_index

    @property
    def attempt(self) -> int:
        return self.place.attempt

    def record(self, port: int | None) -> dict[str, Any]:
        """What the next agent needs to take this pod over (``pod.json``)."""
        return {
            "workload_id": self.place.workload_id,
            "pod_index": self.place.pod_index,
            "attempt": self.place.attempt,
            "first_rank": self.first_rank,
            "local_ranks": self.local_ranks,
            "marker": self.marker,
            "grace_s": self.grace_s,
            "uid": self.uid,
            "port": port,
            "checkpoint_uri": self.checkpoint_uri,
        }


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
        # Each job's rendezvous port here, and the uid it is open to: workload -> (port, uid).
        self._ports: dict[int, tuple[int, int]] = {}
        self._unsent: list[dict[str, Any]] = []
        # Where each unsent chunk leaves its stream: (pod, tail, position, offset).
        self._unsent_ends: list[tuple[_Pod, LogFile, int, int]] = []
        # Leftover markers being ended, and those found gone (not yet reported).
        self._ending_leftovers: dict[str, asyncio.Task[None]] = {}
        self._gone: set[str] = set()

    # ------------------------------------------------------------ take-over
    def recover(self) -> list[tuple[int, int]]:
        """Take over every pod an earlier agent of this node started that still runs
        (blocking: reads the pods' records and ``/proc``); the pods taken over. Called
        once, before the loopback guard is installed, so their rendezvous ports stay
        guarded (:meth:`rendezvous`)."""
        taken = []
        for path in sorted(self.jobs_dir.glob(f"*/pod-*/{RECORD_FILE}")):
            record = _read_record(path)
            if record is None:
                continue
            pod = self._adopt(record)
            if pod is None or pod.ending is not None:
                self._drop_unwatched(pod)  # ended meanwhile: told when the controller asks
                continue
            taken.append(pod.key)
            self.log.info(
                "took over job %s pod %s (attempt %s) from the agent before",
                *pod.key,
                pod.attempt,
            )
        return taken

    def rendezvous(self) -> dict[int, int]:
        """The rendezvous ports of the jobs running here, with the uid each is open to."""
        return dict(self._ports.values())

    def _adopt(self, record: Mapping[str, Any]) -> _Pod | None:
        """The pod of ``record`` as this agent's own, running or ended (``ending`` set);
        None when no runner started it here."""
        place = PodPlace(
            self.jobs_dir,
            int(record["workload_id"]),
            int(record["pod_index"]),
            int(record["attempt"]),
        )
        try:
            status = self.runner.adopt(place.rank_id)
        except UnknownRank:
            return None
        pod = _Pod(
            place,
            int(record["first_rank"]),
            int(record["local_ranks"]),
            str(record["marker"]),
            grace_s=float(record["grace_s"]),
            launched=True,
            uid=None if record.get("uid") is None else int(record["uid"]),
            checkpoint_uri=str(record.get("checkpoint_uri") or ""),
            adopted=True,
            logs=load_tails(place.directory),
        )
        if status.state != "running":
            pod.ending = ("exited" if status.stopping_since is None else "stopped", status)
        port = record.get("port")
        if port is not None and pod.uid is not None and status.state == "running":
            self._ports[place.workload_id] = (int(port), pod.uid)
        self._pods[pod.key] = pod
        return pod

    def _drop_unwatched(self, pod: _Pod | None) -> None:
        if pod is not None:
            del self._pods[pod.key]
            self.runner.forget(pod.place.rank_id)

    async def _take_over(self, desired: Mapping[str, Any]) -> None:
        """A pod the controller saw start that this agent does not know: an earlier agent
        started it. Taken over from its record (running, or reported as it ended); without
        one, what is left of it is ended and it is reported failed."""
        place = _place_of(self.jobs_dir, desired)
        record = _read_record(place.directory / RECORD_FILE)
        # On the loop, though it reads /proc: the keeper's state changes only here.
        pod = None if record is None else self._adopt(record)
        if pod is not None:
            if pod.state == "running" and pod.ending is None:
                self._allow_rendezvous(pod.place.workload_id)
            return
        marker = processes.part_marker(str(desired["marker"]), place.pod_index)
        if not await processes.end_all(marker):
            return  # something survived SIGKILL: not gone, so not reported
        lost = self._placeholder(desired)
        lost.state = "failed"
        lost.reason = (
            f"{ENDED_BY_AGENT_RESTART} and found no record of it (started by an agent of "
            "an earlier release, or its files are gone); the job restarts, charged nothing"
        )

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
    def pod_of_caller(self, marker: str, caller: peers.Caller | None) -> tuple[int, int]:
        """The running pod a progress report comes from: the pod whose marker it names,
        only if the calling process is one of that pod's, running as its account. Raises
        ``peers.ReportRefused`` otherwise. Blocking (reads ``/proc``)."""
        pod = next(
            (
                p
                for p in list(self._pods.values())  # a copy: this runs in a thread
                if marker and p.marker == marker and p.state == "running"
            ),
            None,
        )
        if pod is None:
            raise peers.ReportRefused("no pod of this machine carries that marker")
        peers.check_caller(caller, pod.marker, pod.uid)
        return pod.key

    def own_checkpoints(
        self, key: tuple[int, int], report: RankReport
    ) -> tuple[RankReport, list[str]]:
        """The report with only the checkpoints inside its job's checkpoint location (a
        rank cannot make another job, or its own next attempt, resume from elsewhere), and
        what was left out, in words. Raises ``peers.ReportRefused`` when the pod is gone."""
        pod = self._pods.get(key)
        if pod is None:
            raise peers.ReportRefused("that pod no longer runs here")
        return own_checkpoints_only(report, pod.checkpoint_uri)

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
                ][-MAX_SAVED:]
                # Within what the controller takes, or every later sync would be refused.
                kept["step_times_s"] = [*kept["step_times_s"], *newer["step_times_s"]][
                    -MAX_STEP_TIMES:
                ]
                if "step_at" in newer:
                    kept.pop("epoch", None)  # a newer step says its own epoch, if any
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
            p.state != "running" or p.ending is not None or p.adopted for p in self._pods.values()
        )

    def running(self) -> bool:
        """Whether any pod's ranks still run here."""
        return any(p.state == "running" for p in self._pods.values())

    def report(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every known pod's state and the log chunks not yet acknowledged. What one pod's
        files hold never stops the report of another, nor the agent."""
        for pod in self._pods.values():
            try:
                self._observe(pod)
            except Exception:  # the pod's files are its ranks' to write: anything goes
                self.log.exception("job %s pod %s: its state could not be read", *pod.key)
                if pod.state == "running" and pod.ending is not None:
                    state, status = pod.ending
                    self._record_end(pod, state, status, reason_unread=True)
        pods = [
            {
                "workload_id": pod.place.workload_id,
                "pod_index": pod.place.pod_index,
                "state": pod.state,
                "exit_code": pod.exit_code,
                "signal": pod.signal,
                "reason": pod.reason[:2000],
                "attempt": pod.attempt,
                "adopted": pod.adopted,
            }
            for pod in self._pods.values()
        ]
        return pods, list(self._unsent)

    def _observe(self, pod: _Pod) -> None:
        """Notice the pod's end, read its new output, and once it ended and its output was
        read whole, record how it ended."""
        if pod.state == "running" and pod.ending is None and pod.stopping is None:
            status = self.runner.status(pod.place.rank_id)
            if status.state != "running":
                pod.ending = (status.state, status)
        drained = self._read_logs(pod)
        if pod.state == "running" and pod.ending is not None and drained:
            state, status = pod.ending
            self._record_end(pod, state, status)  # logs whole: the group is gone

    def synced(self, chunks: int, reported: Iterable[Mapping[str, Any]] = ()) -> None:
        """The controller stored the first ``chunks`` chunks of the last report, and heard
        of the pods ``reported``: where each stream was acknowledged to is kept on disk
        for an agent that takes the pod over, and a take-over was said."""
        acknowledged = self._unsent_ends[:chunks]
        del self._unsent[:chunks], self._unsent_ends[:chunks]
        moved: dict[tuple[int, int], _Pod] = {}
        for pod, tail, position, offset in acknowledged:
            tail.acknowledged = (position, offset)
            moved[pod.key] = pod
        for pod in moved.values():
            if pod.launched and pod.place.directory.is_dir():
                with contextlib.suppress(OSError):
                    save_tails(pod.place.directory, pod.logs.values())
        for item in reported:
            said = self._pods.get((int(item["workload_id"]), int(item["pod_index"])))
            if said is not None and item.get("adopted"):
                said.adopted = False

    async def apply(self, desired: Iterable[Mapping[str, Any]]) -> None:
        """Make what runs here what the controller listed. One pod's trouble, whatever
        its job asked for, ends that pod alone: never this agent, never another pod."""
        wanted: set[tuple[int, int]] = set()
        for pod in desired:
            key = (int(pod["workload_id"]), int(pod["pod_index"]))
            wanted.add(key)
            try:
                await self._apply_one(pod, key)
            except Exception as e:  # the pod fails, saying why; the agent goes on
                self.log.exception("job %s pod %s: could not be handled", *key)
                known = self._pods.get(key)
                if known is None or (known.state == "running" and not known.launched):
                    failed = self._placeholder(pod)
                    failed.state = "failed"
                    failed.reason = (
                        f"{NODE_COULD_NOT_START}the node agent failed preparing it "
                        f"({type(e).__name__}: {e})"
                    )
        for key, known in list(self._pods.items()):
            if key in wanted:
                continue
            if known.state == "running":
                self._stop(known)  # not ours any more: the controller ended it
            elif known.stopping is None or known.stopping.done():
                self._forget(known)

    async def _apply_one(self, pod: Mapping[str, Any], key: tuple[int, int]) -> None:
        known = self._pods.get(key)
        attempt = int(pod.get("attempt", 1))
        if known is not None and known.attempt < attempt:
            if known.state == "running":
                self._stop(known)  # of an attempt that has ended: it must not run on
                return
            self._forget(known)  # the pod of an ended attempt: the new one starts anew
            known = None
        if pod["run"] and known is None:
            if pod["started"]:
                await self._take_over(pod)
            else:
                await self._start(pod)
        elif not pod["run"]:
            if known is None:
                await self._absent(pod)
            else:
                self._stop(known)

    # ------------------------------------------------------------- starting
    async def _start(self, desired: Mapping[str, Any]) -> None:
        place = _place_of(self.jobs_dir, desired)
        spec = desired["spec"]
        per_pod = int(desired["gpus_per_pod"])
        pod = _Pod(
            place,
            first_rank=place.pod_index * per_pod,
            local_ranks=per_pod,
            marker=processes.part_marker(str(desired["marker"]), place.pod_index),
            grace_s=float(spec.get("grace_s", 30.0)),
            checkpoint_uri=str(spec.get("checkpoint_uri") or ""),
        )
        self._pods[pod.key] = pod
        try:
            account, system = rank_account(desired, self.sandbox)
            pod.uid = account.uid
            pinned = await asyncio.to_thread(pinned_environment, desired, self.sandbox)
            port = self._port_for(place.workload_id, account.uid)
            argv, outer_env = await asyncio.to_thread(
                contained_command,
                desired,
                place,
                account,
                system,
                self.sandbox,
                port,
                self.progress_url,
                pinned,
            )
            # The record first: whenever the runner's exists, the next agent finds this.
            await asyncio.to_thread(_write_record, place.directory, pod.record(port))
            self.runner.start(
                RankSpec(
                    rank_id=place.rank_id,
                    argv=tuple(argv),
                    gpu_uuids=tuple(desired["gpu_uuids"]),
                    env=outer_env,
                    cwd="/",
                    marker=pod.marker,
                )
            )
            pod.launched = True
        except (OSError, RunnerError, ValueError) as e:
            # What the job asked for is its own error; anything else is this node's.
            refused = isinstance(e, JobRefused)
            pod.state = "failed"
            pod.reason = f"{REFUSED_AS_ASKED if refused else NODE_COULD_NOT_START}{e}"
            level = logging.INFO if refused else logging.WARNING
            self.log.log(level, "job %s pod %s %s", *pod.key, pod.reason)
            return
        self.log.info(
            "started job %s pod %s (%d rank(s)) on %s as uid %s",
            *pod.key,
            per_pod,
            desired["node"],
            pod.uid,
        )

    def _port_for(self, workload_id: int, uid: int) -> int:
        """The job's rendezvous port on this machine, open to its user alone."""
        if workload_id not in self._ports:
            self._ports[workload_id] = (free_port(), uid)
            self._allow_rendezvous(workload_id)
        return self._ports[workload_id][0]

    def _allow_rendezvous(self, workload_id: int) -> None:
        rendezvous = self._ports.get(workload_id)
        if self.guard is None or rendezvous is None:
            return
        # Its rendezvous store answers anyone who connects: only its user may.
        try:
            self.guard.allow_rendezvous(*rendezvous)
        except GuardUnavailable as e:
            raise RunnerError(str(e)) from e

    async def _absent(self, desired: Mapping[str, Any]) -> None:
        """A pod to stop that this agent does not run: make sure nothing of it does."""
        marker = processes.part_marker(str(desired["marker"]), int(desired["pod_index"]))
        if not await processes.end_all(marker):
            return  # something survived SIGKILL: not gone, so not reported
        pod = self._placeholder(desired)
        pod.state = "stopped"

    def _placeholder(self, desired: Mapping[str, Any]) -> _Pod:
        place = _place_of(self.jobs_dir, desired)
        marker = processes.part_marker(str(desired["marker"]), place.pod_index)
        pod = _Pod(place, 0, 0, marker)
        self._pods[pod.key] = pod
        return pod

    # ------------------------------------------------------------- stopping
    def _stop(self, pod: _Pod) -> None:
        if pod.state != "running" or pod.stopping is not None or pod.ending is not None:
            return  # ended, or being stopped already
        if not pod.launched:
            pod.state, pod.reason = "stopped", "stopped before it started"
            return

        async def stop() -> None:
            try:
                status = await self.runner.stop(pod.place.rank_id, grace=pod.grace_s)
            except StopFailed as e:
                self.log.error("job %s pod %s: %s", *pod.key, e)
                pod.stopping = None  # still running: the next apply tries again
                return
            pod.ending = ("stopped", status)  # reported by report(), with its last logs

        self.log.info("stopping job %s pod %s", *pod.key)
        pod.stopping = asyncio.create_task(stop())

    def _record_end(
        self, pod: _Pod, state: str, status: RankStatus, reason_unread: bool = False
    ) -> None:
        pod.state, pod.exit_code, pod.signal = state, status.exit_code, status.signal
        if state == "exited" and not status.recorded:
            pod.state, pod.reason = "failed", ENDED_UNWATCHED
        elif state == "exited" and status.exit_code != 0:
            pod.reason = (
                "its ranks' account of the failure could not be read"
                if reason_unread
                else failure_reason(
                    self._launcher_log(pod, "stderr"), pod.place.ranks_dir, self._log_files(pod)
                )
            )
        self.log.info(
            "job %s pod %s %s (exit code %s, signal %s)",
            *pod.key,
            pod.state,
            status.exit_code,
            status.signal,
        )

    def _forget(self, pod: _Pod) -> None:
        del self._pods[pod.key]
        if pod.launched:
            self.runner.forget(pod.place.rank_id)
            # Reported ended and no longer listed: no later agent needs to take it over.
            (pod.place.directory / RECORD_FILE).unlink(missing_ok=True)
        workload_id = pod.place.workload_id
        if not any(key[0] == workload_id for key in self._pods):
            rendezvous = self._ports.pop(workload_id, None)
            if rendezvous is not None and self.guard is not None:
                try:
                    self.guard.forget_rendezvous(rendezvous[0])
                except GuardUnavailable as e:
                    self.log.warning("could not close job %s's rendezvous rule: %s", workload_id, e)

    # ------------------------------------------------------------- logs
    def _launcher_log(self, pod: _Pod, stream: str) -> Path:
        return self.runner.log_dir / f"{pod.place.rank_id}.{stream}"

    def _log_files(self, pod: _Pod) -> list[tuple[int, str, Path]]:
        if not pod.launched:
            return []
        launcher = {stream: self._launcher_log(pod, stream) for stream in ("stdout", "stderr")}
        return pod_log_files(
            launcher, pod.place.ranks_dir, pod.first_rank, pod.local_ranks, -1 - pod.place.pod_index
        )

    def _read_logs(self, pod: _Pod) -> bool:
        """Queue what is new in the pod's log files, at most ``CHUNKS_PER_SYNC`` chunks;
        whether that was all of it."""
        read = 0
        for rank, stream, path in self._log_files(pod):
            tail = pod.logs.setdefault((rank, stream), LogFile(rank, stream))
            while read < CHUNKS_PER_SYNC:
                chunk = read_new(tail, path)
                if chunk is None:
                    break
                read += 1
                self._unsent.append(
                    {"workload_id": pod.place.workload_id, "attempt": pod.attempt, **chunk}
                )
                self._unsent_ends.append((pod, tail, tail.position, tail.offset))
            else:
                return False
        return True


def _place_of(jobs_dir: Path, desired: Mapping[str, Any]) -> PodPlace:
    return PodPlace(
        jobs_dir,
        int(desired["workload_id"]),
        int(desired["pod_index"]),
        int(desired.get("attempt", 1)),
    )


def _write_record(directory: Path, record: Mapping[str, Any]) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_whole(directory / RECORD_FILE, json.dumps(record))


def _read_record(path: Path) -> dict[str, Any] | None:
    """A pod's record as its agent wrote it; None when missing or unreadable. Read without
    following links (the pod's directory is the agent's, but its ranks write below it)."""
    try:
        with open_regular(path) as f:
            record = json.loads(f.read(1 << 16))
        for name in ("workload_id", "pod_index", "attempt", "first_rank", "local_ranks"):
            int(record[name])
        for name in ("uid", "port"):
            if record.get(name) is not None:
                int(record[name])
        str(record["marker"])
        float(record["grace_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None
