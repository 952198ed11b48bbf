"""The node agent's part in the training jobs that Kubernetes runs on its node.

On Kubernetes the cluster manager (``clusters/kube_jobs.py``) makes a job's pods and
reports how they end; the node agent of each node does the rest of what it does for the
local backend's pods, for the pods the controller lists as *watched* on its nodes:

- **Output.** The kubelet keeps each container's output in the CRI log format under
  ``/var/log/pods/<namespace>_<pod>_<uid>/<container>/<restart>.log`` (``pod_log_dirs``):
  one record per line, ``<time> <stdout|stderr> <F|P> <text>``, ``P`` for a part of a
  longer line. torchrun runs with ``--tee=3`` and prefixes every line a rank writes with
  ``[gpufleet rank <n>]:`` (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, set by the pod's
  manifest), so one file splits into each rank's stdout and stderr; lines without the
  prefix are torchrun's own, pod *p*'s "rank" ``-1-p`` as on the local backend. The agent
  sends what is new as chunks at byte offsets of each stream, with its pods' sync, again
  with every sync until one succeeds. The file stays until the pod is deleted, which the
  cluster manager does only once the attempt is over. A pod a restart keeps (its name is
  the attempt's that made it) goes on in the same file: the next attempt's output is what
  follows the point the last one's was read to.
- **Progress.** A rank's ``gpufleet.progress`` reports reach the agent's progress port
  (``GPUFLEET_PROGRESS_URL`` in the pod) and count for the watched pod whose marker the
  calling process carries, running as that pod's account, checked against the kernel's
  view of the connection exactly as for the local backend's pods (``peers.py``).

An agent that restarts reads each file again from its start; the controller keeps only the
part of a chunk past what it has stored, so nothing is stored twice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api.jobs import RANK_LINE_PREFIX_TEMPLATE
from . import peers
from .progress import RankReport, own_checkpoints_only

RANK_LINE = re.compile(
    re.escape(RANK_LINE_PREFIX_TEMPLATE.encode()).replace(re.escape(b"${rank}"), rb"(\d{1,9})")
)
CONTAINER = "torchrun"
READ_BYTES = 512 * 1024  # per pod and pass: a pod that wrote more is read on at the next


@dataclass
class WatchedPod:
    """One watched pod: who it is, where its output is read to, and each stream's offset."""

    workload_id: int
    pod_index: int
    attempt: int
    marker: str
    uid: int | None
    checkpoint_uri: str
    name: str  # the Kubernetes pod's name
    file: Path | None = None
    position: int = 0  # bytes of whole records of the file read
    offsets: dict[tuple[int, str], int] = field(default_factory=dict)  # text sent per stream
    closed: bool = False  # its attempt is over: read no more
    # The rank whose line each stream is in the middle of (a P record continues it).
    open_line: dict[str, int | None] = field(default_factory=dict)
    unsent: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return self.workload_id, self.pod_index

    @property
    def launcher_rank(self) -> int:
        return -1 - self.pod_index


def pod_name(workload_id: int, attempt: int, pod_index: int) -> str:
    """The name the cluster manager gives pod ``pod_index`` of an attempt."""
    return f"gf-job-{workload_id}-a{attempt}-{pod_index}"


def split_records(pod: WatchedPod, data: bytes) -> list[tuple[int, str, bytes]]:
    """The (rank, stream, text) pieces of whole CRI records in ``data``, in order."""
    pieces: list[tuple[int, str, bytes]] = []
    for record in data.split(b"\n"):
        parts = record.split(b" ", 3)
        if len(parts) < 3 or parts[1] not in (b"stdout", b"stderr"):
            continue
        stream = parts[1].decode()
        text = parts[3] if len(parts) == 4 else b""
        rank = pod.open_line.get(stream)
        if rank is None:  # a new line: whose is it?
            found = RANK_LINE.match(text)
            if found:
                rank, text = int(found.group(1)), text[found.end() :]
            else:
                rank = pod.launcher_rank
        whole = parts[2] == b"F"
        pod.open_line[stream] = None if whole else rank
        pieces.append((rank, stream, text + (b"\n" if whole else b"")))
    return pieces


class KubePods:
    """The watched pods of this agent's nodes (see the module docstring)."""

    def __init__(self, log_dirs: Sequence[Path], log: logging.Logger):
        self.log_dirs = [Path(d) for d in log_dirs]
        self.log = log
        self.pods: dict[tuple[int, int], WatchedPod] = {}
        # Where the output of pods no longer watched was read to, by pod name: a pod kept
        # into the next attempt reads on from there.
        self.read_to: dict[str, tuple[Path | None, int]] = {}

    def known(self) -> list[tuple[int, int]]:
        return sorted(self.pods)

    def watch(self, listed: Iterable[Mapping[str, Any]]) -> None:
        """The pods the controller lists now. A pod of a new attempt starts afresh; one no
        longer listed is read to its end once more, then forgotten."""
        wanted: dict[tuple[int, int], Mapping[str, Any]] = {
            (int(p["workload_id"]), int(p["pod_index"])): p for p in listed
        }
        for key, pod in list(self.pods.items()):
            if key not in wanted or int(wanted[key].get("attempt", 1)) != pod.attempt:
                try:
                    if not pod.closed:
                        self._read(pod)
                except OSError as e:  # the kubelet removed a deleted pod's files
                    self.log.info("job %s pod %s: its output is gone: %s", *pod.key, e)
                # Read no further: what a kept pod writes from now on is the next attempt's.
                pod.closed = True
                if pod.unsent:
                    continue  # forgotten once its last chunks were acknowledged
                del self.pods[key]
                self.read_to[pod.name] = (pod.file, pod.position)
        for key, listed_pod in wanted.items():
            if key in self.pods:
                continue
            attempt = int(listed_pod.get("attempt", 1))
            made_by = int(listed_pod.get("created_attempt") or attempt)
            account = listed_pod.get("account") or {}
            spec = listed_pod.get("spec") or {}
            name = pod_name(key[0], made_by, key[1])
            file, position = self.read_to.pop(name, (None, 0))
            self.pods[key] = WatchedPod(
                workload_id=key[0],
                pod_index=key[1],
                attempt=attempt,
                marker=f"{listed_pod['marker']}.{key[1]}",
                uid=int(account["uid"]) if "uid" in account else None,
                checkpoint_uri=str(spec.get("checkpoint_uri") or ""),
                name=name,
                file=file,
                position=position,
            )
        named = {
            pod_name(k[0], int(p.get("created_attempt") or p.get("attempt", 1)), k[1])
            for k, p in wanted.items()
        }
        self.read_to = {n: r for n, r in self.read_to.items() if n in named}

    # ------------------------------------------------------------------ output
    def chunks(self) -> list[dict[str, Any]]:
        """Every watched pod's output not yet acknowledged, read on where it was."""
        out: list[dict[str, Any]] = []
        for pod in list(self.pods.values()):
            try:
                if not pod.closed:
                    self._read(pod)
            except OSError as e:
                self.log.warning("job %s pod %s: its output cannot be read: %s", *pod.key, e)
            out += pod.unsent
        return out

    def acknowledged(self, sent: int) -> None:
        """The controller stored the first ``sent`` chunks of the last ``chunks()``."""
        for pod in self.pods.values():
            done = min(sent, len(pod.unsent))
            pod.unsent = pod.unsent[done:]
            sent -= done

    def _find(self, pod: WatchedPod) -> Path | None:
        for root in self.log_dirs:
            for directory in sorted(root.glob(f"*_{pod.name}_*")):
                runs = sorted(
                    (directory / CONTAINER).glob("*.log"),
                    key=lambda p: int(p.stem) if p.stem.isdigit() else -1,
                )
                if runs:
                    return runs[0]  # restartPolicy Never: the one run
        return None

    def _read(self, pod: WatchedPod) -> None:
        if pod.file is None:
            pod.file = self._find(pod)
            if pod.file is None:
                return
        with pod.file.open("rb") as f:
            f.seek(pod.position)
            data = f.read(READ_BYTES)
        whole = data.rfind(b"\n") + 1  # a record being written is read at the next pass
        if whole == 0:
            return
        pod.position += whole
        # One chunk per stream and read: a stream's pieces in one read are contiguous.
        building: dict[tuple[int, str], dict[str, Any]] = {}
        for rank, stream, raw in split_records(pod, data[:whole]):
            # Offsets count the UTF-8 bytes of the text sent, as the local pods' do.
            text = raw.decode(errors="replace")
            offset = pod.offsets.get((rank, stream), 0)
            pod.offsets[rank, stream] = offset + len(text.encode())
            if (rank, stream) in building:
                building[rank, stream]["data"] += text
                continue
            building[rank, stream] = {
                "workload_id": pod.workload_id,
                "rank": rank,
                "stream": stream,
                "offset": offset,
                "data": text,
                "attempt": pod.attempt,
            }
        pod.unsent += building.values()

    # ------------------------------------------------------------------ progress
    def pod_of_caller(self, marker: str, caller: peers.Caller | None) -> tuple[int, int] | None:
        """The watched pod whose marker a report names, once the kernel vouches that the
        caller is one of its processes as its account; None when no watched pod carries
        that marker (it may be one of the agent's own). Raises ``peers.ReportRefused``."""
        pod = next((p for p in list(self.pods.values()) if marker and p.marker == marker), None)
        if pod is None:
            return None
        peers.check_caller(caller, pod.marker, pod.uid)
        return pod.key

    def own_checkpoints(
        self, key: tuple[int, int], report: RankReport
    ) -> tuple[RankReport, list[str]] | None:
        """As the local pods' (``PodKeeper.own_checkpoints``); None for a pod not watched."""
        pod = self.pods.get(key)
        if pod is None:
            return None
        return own_checkpoints_only(report, pod.checkpoint_uri)
