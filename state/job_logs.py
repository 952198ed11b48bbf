"""Ranks' output as the controller keeps it: chunks at byte offsets of each rank's stream,
stored once each, whole however the node agents resent them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import JobLog, Workload, WorkloadKind
from .next_attempt import log_offset

LOG_STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class LogChunk:
    workload_id: int
    rank: int  # a global rank; negative: pod ``-1 - rank``'s launcher
    stream: str  # "stdout" or "stderr"
    offset: int  # bytes of the stream before this chunk (in its attempt's files)
    data: str
    attempt: int = 1


def store_chunks(session: Session, now: datetime, chunks: Iterable[LogChunk]) -> None:
    """Append what is new of each chunk. A chunk at a (rank, stream, offset) already stored
    is the same output sent again, often longer: an agent that took a pod over resends from
    where the controller last acknowledged, in chunks cut where it reads, so the bytes past
    the stored chunk's end are stored after it (``_past_stored``). An attempt's chunks
    continue the job's streams where that attempt's output begins
    (``next_attempt.log_offset``); an earlier attempt's are dropped."""
    arrived = [c for c in chunks if c.stream in LOG_STREAMS and c.offset >= 0 and c.data]
    if not arrived:
        return
    jobs = {
        w.id: w
        for w in session.scalars(
            select(Workload).where(
                Workload.id.in_({c.workload_id for c in arrived}),
                Workload.kind == WorkloadKind.job,
            )
        )
    }
    fresh: dict[tuple[int, int, str, int], LogChunk] = {}
    for chunk in arrived:
        workload = jobs.get(chunk.workload_id)
        if workload is None:
            continue
        offset = log_offset(workload, chunk.attempt, chunk.rank, chunk.stream, chunk.offset)
        if offset is not None:
            fresh[chunk.workload_id, chunk.rank, chunk.stream, offset] = chunk
    if not fresh:
        return
    known = {
        (workload_id, rank, stream, offset)
        for workload_id, rank, stream, offset in session.execute(
            select(JobLog.workload_id, JobLog.rank, JobLog.stream, JobLog.offset).where(
                JobLog.workload_id.in_({key[0] for key in fresh}),
                JobLog.offset.in_({key[3] for key in fresh}),
            )
        )
    }
    for key, chunk in fresh.items():
        workload_id, rank, stream, offset = key
        data = _past_stored(session, key, chunk.data) if key in known else (offset, chunk.data)
        if data is not None:
            session.add(
                JobLog(
                    workload_id=workload_id,
                    rank=rank,
                    stream=stream,
                    offset=data[0],
                    data=data[1],
                    at=now,
                )
            )


def _past_stored(
    session: Session, key: tuple[int, int, str, int], text: str
) -> tuple[int, str] | None:
    """What of ``text``, sent at ``key``'s offset where a chunk is stored, lies past the
    stored chunks that follow one another from there: (its offset, its text), or None."""
    workload_id, rank, stream, offset = key
    raw = text.encode()
    end = offset + len(raw)
    stored: dict[int, str] = {
        start: data
        for start, data in session.execute(
            select(JobLog.offset, JobLog.data).where(
                JobLog.workload_id == workload_id,
                JobLog.rank == rank,
                JobLog.stream == stream,
                JobLog.offset >= offset,
                JobLog.offset < end,
            )
        )
    }
    cut = offset
    while cut in stored and cut < end:
        cut += len(stored[cut].encode())
    while cut < end and raw[cut - offset] & 0xC0 == 0x80:  # inside a character
        cut += 1
    if cut >= end:
        return None
    return cut, raw[cut - offset :].decode(errors="replace")
