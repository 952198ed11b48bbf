"""Reading a rank's Python stacks as ``py-spy dump`` prints them (pure).

A dump is a header, then each thread with its frames, innermost first::

    Process 4242: python train.py
    Python v3.11.2 (/usr/bin/python3.11)

    Thread 4242 (idle): "MainThread"
        wait_for_peer (train.py:12)
        <module> (train.py:30)

Where a rank *is* is its main thread's innermost frame (``wait_for_peer (train.py:12)``):
what a hang's event says of each rank, so a reader sees at once which rank waits in a
collective and which in its own code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

THREAD = re.compile(r'^Thread\s+\S+(?:\s+\([^)]*\))?:?\s*(?:"(?P<name>[^"]*)")?')
FRAME = re.compile(r"^\s+(?P<frame>\S.*\(.*:\d+\))\s*$")


@dataclass(frozen=True)
class RankWhere:
    """One rank of a trace, as its event tells it."""

    rank: int
    where: str  # its main thread's innermost frame; "" when none was read
    error: str = ""  # why its stacks could not be taken


def threads_of(dump: str) -> list[tuple[str, list[str]]]:
    """Each thread of a dump with its frames, innermost first, in the dump's order."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if (thread := THREAD.match(line)) is not None:
            threads.append((thread.group("name") or "", []))
        elif threads and (frame := FRAME.match(line)) is not None:
            threads[-1][1].append(frame.group("frame"))
    return threads


def where_of(dump: str) -> str:
    """The main thread's innermost frame (the first thread's where none is named so)."""
    threads = threads_of(dump)
    main = next((t for t in threads if t[0] == "MainThread"), threads[0] if threads else None)
    return main[1][0] if main is not None and main[1] else ""


def summary(ranks: Iterable[RankWhere]) -> str:
    """``rank 0 in f (a.py:1); rank 1 in g (b.py:2)``: every rank, in rank order."""
    said = []
    for rank in sorted(ranks, key=lambda r: r.rank):
        if rank.error:
            said.append(f"rank {rank.rank}: no stacks ({rank.error})")
        else:
            said.append(f"rank {rank.rank} in {rank.where or 'no Python frame'}")
    return "; ".join(said)
