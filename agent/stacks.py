"""Taking a pod's ranks' Python stacks with py-spy, for a trace (state/traces.py).

The controller lists a pod with ``trace`` set while a trace of its attempt awaits it. The
agent finds the pod's rank processes by the pod's marker (every process of a pod carries
``<marker>.<pod>``; torchrun gives each rank ``RANK``), takes each rank's dump with
``py-spy dump --pid`` (the oldest process of a rank: its data-loader workers inherit the
variables), and sends them with its next sync, for the local backend's pods and for the
pods Kubernetes runs on its nodes alike. It does so before it applies the list, so the
ranks of a pod it must stop are read before they get the checkpoint signal.

py-spy reads another process's memory (ptrace): the agent runs as root, or with
``CAP_SYS_PTRACE`` and the host's PID namespace as a DaemonSet. A rank's code chooses
what py-spy reads, so py-spy runs with a deadline and its output is cut to a size; what it
could not do is said in the rank's ``error``, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..recovery import processes
from ..recovery.stacks import where_of

DUMP_TIMEOUT_S = 10.0
MAX_OUTPUT = 64 * 1024
NO_RANK_PROCESS = "no process of this rank runs here (not started yet, or ended)"


def rank_pids(marker: str, ranks: range) -> dict[int, int]:
    """The process of each of ``ranks`` that carries ``marker`` exactly (the oldest one)."""
    found: dict[int, tuple[int, int]] = {}
    for process in processes.marked_process_details(("RANK",)):
        rank = process.environ.get("RANK", "")
        if process.marker != marker or not rank.isdigit() or int(rank) not in ranks:
            continue
        seen = found.get(int(rank))
        if seen is None or process.started < seen[0]:
            found[int(rank)] = (process.started, process.pid)
    return {rank: pid for rank, (_, pid) in found.items()}


async def dump(py_spy: str, pid: int) -> tuple[str, str]:
    """py-spy's dump of ``pid`` and, where it failed, why."""
    try:
        child = await asyncio.create_subprocess_exec(
            py_spy,
            "dump",
            "--pid",
            str(pid),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        return "", f"py-spy could not be run ({py_spy}: {e.strerror or e})"
    try:
        out, err = await asyncio.wait_for(child.communicate(), DUMP_TIMEOUT_S)
    except TimeoutError:
        child.kill()
        await child.wait()
        return "", f"py-spy did not finish within {DUMP_TIMEOUT_S:.0f} s"
    text = out[:MAX_OUTPUT].decode(errors="replace")
    if child.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return text, f"py-spy exited {child.returncode}: {last[0][:500]}"
    return text, ""


class StackTaker:
    """Answers the traces its pods are listed with; the answers wait for the next sync."""

    def __init__(self, py_spy: str, log: logging.Logger):
        self.py_spy = py_spy
        self.log = log
        self.answered: set[tuple[int, int, int]] = set()  # (trace, workload, pod)
        self.unsent: list[dict[str, Any]] = []

    async def answer(self, listed: Iterable[Mapping[str, Any]]) -> None:
        for pod in listed:
            trace = pod.get("trace")
            key = (int(trace or 0), int(pod["workload_id"]), int(pod["pod_index"]))
            if not trace or key in self.answered:
                continue
            self.answered.add(key)
            per_pod = int(pod["gpus_per_pod"])
            first = key[2] * per_pod
            marker = processes.part_marker(str(pod["marker"]), key[2])
            ranks = range(first, first + per_pod)
            pids = await asyncio.to_thread(rank_pids, marker, ranks)
            # Every rank at once: a pod's stacks take one py-spy deadline at most.
            dumps = await asyncio.gather(*(dump(self.py_spy, pid) for pid in pids.values()))
            by_rank = dict(zip(pids, dumps, strict=True))
            taken: list[dict[str, Any]] = []
            for rank in ranks:
                if rank not in by_rank:
                    taken.append({"rank": rank, "error": NO_RANK_PROCESS})
                    continue
                text, error = by_rank[rank]
                taken.append(
                    {
                        "rank": rank,
                        "pid": pids[rank],
                        "where": where_of(text),
                        "text": text,
                        "error": error,
                    }
                )
            self.log.info("job %s pod %s: stacks taken for trace %s", key[1], key[2], key[0])
            self.unsent.append(
                {"trace_id": key[0], "workload_id": key[1], "pod_index": key[2], "ranks": taken}
            )

    def take(self) -> list[dict[str, Any]]:
        taken, self.unsent = self.unsent, []
        return taken

    def restore(self, taken: list[dict[str, Any]]) -> None:
        self.unsent = taken + self.unsent

    def forget_all_but(self, traces: Iterable[int]) -> None:
        """Forget answers to traces no pod is listed with any more (they closed)."""
        keep = set(traces)
        self.answered = {key for key in self.answered if key[0] in keep}
