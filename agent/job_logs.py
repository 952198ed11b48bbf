"""A job pod's output as the node agent reads it back: the launcher's and every rank's
stdout and stderr, tailed into chunks at byte offsets, and what a failed pod's ranks said of
their failure.

The files are written by the ranks, which run as their user: every file is opened below
the agent's root-owned jobs directory without following a link (:func:`open_regular`), so
no rank can make the agent (root) read anything else.

How far each stream reached the controller is kept in the pod's ``tails.json``
(:func:`save_tails`), so an agent that takes over a running pod after a restart goes on
where the last one's chunks were acknowledged: nothing is lost, nothing stored twice.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .runner import write_whole

CHUNK_BYTES = 256 * 1024
ERROR_FILE_BYTES = 64 * 1024  # torchrun's error file: the exception and its traceback
# torchrun's summary of a failed child: "rank      : 1 (local_rank: 1)"
# (Nine digits at most: what a rank wrote there is read, and int() refuses 4,300 digits.)
FAILED_RANK = re.compile(r"rank\s*:\s*(\d{1,9})\s*\(local_rank:\s*(\d{1,9})\)")
LAUNCHER_STREAMS = ("stdout", "stderr")
# PyTorch starts the lines a rank writes through its logging with "[rank1]: ".
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
TAILS_FILE = "tails.json"


@dataclass
class LogFile:
    """One file being tailed: where it was read to, and where its stream stands."""

    rank: int
    stream: str
    position: int = 0  # bytes of the file read
    offset: int = 0  # bytes of the stream sent (as UTF-8 text; see read_new)
    # Where the last chunk the controller acknowledged ends: (position, offset).
    acknowledged: tuple[int, int] = (0, 0)
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


def read_new(tail: LogFile, path: Path) -> dict[str, Any] | None:
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


def last_line(path: Path, everything: bool = False) -> str:
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
    except (OSError, ValueError, RecursionError):  # the rank wrote it: anything goes
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


def save_tails(directory: Path, tails: Iterable[LogFile]) -> None:
    """Where each stream of a pod was acknowledged to, in ``<directory>/tails.json``
    (replaced whole: a reader never sees half of it)."""
    data = [
        {
            "rank": t.rank,
            "stream": t.stream,
            "position": t.acknowledged[0],
            "offset": t.acknowledged[1],
        }
        for t in tails
    ]
    write_whole(directory / TAILS_FILE, json.dumps(data))


def load_tails(directory: Path) -> dict[tuple[int, str], LogFile]:
    """The tails :func:`save_tails` kept, each going on from where it was acknowledged;
    none when there is no usable file (every stream is then read from its start, and the
    controller drops what it has at the same offsets)."""
    try:
        with open_regular(directory / TAILS_FILE) as f:
            data = json.loads(f.read(1 << 20))
        tails = {}
        for item in data:
            position, offset = int(item["position"]), int(item["offset"])
            tail = LogFile(
                int(item["rank"]), str(item["stream"]), position, offset, (position, offset)
            )
            tails[tail.rank, tail.stream] = tail
        return tails
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return {}


def pod_log_files(
    launcher_logs: Mapping[str, Path],
    ranks_dir: Path,
    first_rank: int,
    local_ranks: int,
    launcher_rank: int,
) -> list[tuple[int, str, Path]]:
    """Every file of a pod's output, as (rank, stream, path): its launcher's (rank
    ``launcher_rank``, negative) and each local rank's in torchrun's latest attempt."""
    files = [(launcher_rank, stream, launcher_logs[stream]) for stream in LAUNCHER_STREAMS]
    attempts = sorted(ranks_dir.glob("*/attempt_*"))
    if attempts:
        latest = attempts[-1]
        for local in range(local_ranks):
            for stream in LAUNCHER_STREAMS:
                files.append((first_rank + local, stream, latest / str(local) / f"{stream}.log"))
    return files


def failure_reason(
    launcher_stderr: Path, ranks_dir: Path, files: Iterable[tuple[int, str, Path]]
) -> str:
    """What the first rank to fail recorded of its exception in torchrun's error file
    (``TORCHELASTIC_ERROR_FILE``: a script whose entry point is wrapped in torch's
    ``@record``), else the last line it wrote to stderr, else the launcher's."""
    launcher = last_line(launcher_stderr, everything=True)
    # torchrun lists every failed rank, and last the root cause: the first to fail.
    root_cause = launcher.rfind("Root Cause")
    failed = FAILED_RANK.search(launcher, max(root_cause, 0))
    if failed is not None:
        recorded = rank_error(ranks_dir, int(failed.group(2)))
        if recorded:
            return f"rank {failed.group(1)}: {recorded}"
    for rank, stream, path in files:
        if stream != "stderr" or rank < 0:
            continue
        if failed is not None and rank != int(failed.group(1)):
            continue
        line = RANK_PREFIX.sub("", last_line(path))
        if line:
            return f"rank {rank}: {line}"
    return last_line(launcher_stderr)
