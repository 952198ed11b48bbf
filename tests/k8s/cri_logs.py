"""Container output as a kubelet keeps it: the CRI log format of containerd and CRI-O.

Each run of a container writes ``<logs>/<namespace>_<pod>_<uid>/<container>/<restart>.log``
(the layout of ``/var/log/pods``), one record per line the container wrote::

    2026-12-05T10:00:00.123456789Z stdout F the line, without its newline

``F`` ends a line; ``P`` is a part of one: a line longer than ``MAX_RECORD`` bytes is cut
into parts, and output that ends without a newline ends with a ``P``. The container's
stdout and stderr come through pipes, each read by a pump thread of its own, so the two
streams keep their names; a record is written whole under a lock, so the two never mix
inside one. Log shippers and gpufleet's node agent read these files as they read a real
node's.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from pathlib import Path

MAX_RECORD = 16 * 1024  # what containerd writes at most per record
READ_BYTES = 64 * 1024


def _stamp() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond * 1000:09d}Z"


class CriLog:
    """One run's log file and the pumps that fill it from the run's two pipes."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab", buffering=0)
        self._lock = threading.Lock()
        self._open = 2
        self.threads: list[threading.Thread] = []

    def pump(self, stream: str, fd: int) -> None:
        """Copy ``fd`` (a pipe's read end, closed here at its end) into records of
        ``stream`` until every writer has closed it."""
        thread = threading.Thread(
            target=self._pump, args=(stream, fd), name=f"cri-log-{stream}", daemon=True
        )
        self.threads.append(thread)
        thread.start()

    def _pump(self, stream: str, fd: int) -> None:
        pending = b""
        try:
            while chunk := os.read(fd, READ_BYTES):
                pending += chunk
                while (end := pending.find(b"\n")) >= 0:
                    self._line(stream, pending[:end], b"F")
                    pending = pending[end + 1 :]
                while len(pending) > MAX_RECORD:
                    self._line(stream, pending[:MAX_RECORD], b"P")
                    pending = pending[MAX_RECORD:]
            if pending:
                self._line(stream, pending, b"P")
        finally:
            os.close(fd)
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    self._file.close()

    def _line(self, stream: str, content: bytes, tag: bytes) -> None:
        record = f"{_stamp()} {stream} ".encode() + tag + b" " + content + b"\n"
        with self._lock:
            self._file.write(record)


def read_cri(path: Path) -> str:
    """What the container wrote, both streams in the order written (``kubectl logs``)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    out = []
    for record in data.split(b"\n"):
        parts = record.split(b" ", 3)
        if len(parts) < 3:
            continue
        content = parts[3] if len(parts) == 4 else b""
        out.append(content + (b"\n" if parts[2] == b"F" else b""))
    return b"".join(out).decode(errors="replace")


def set_aside(pod_logs: Path) -> Path:
    """Take a removed pod's logs out of the kubelet's logs directory, as a kubelet removes
    a deleted pod's from ``/var/log/pods`` (so a reader never takes an old pod's files for a
    new pod of the same name); kept in ``removed/`` beside it for the tests that read what a
    pod wrote after it is gone. Where they are now."""
    aside = pod_logs.parent.parent / "removed" / pod_logs.name
    if pod_logs.exists():
        aside.parent.mkdir(parents=True, exist_ok=True)
        pod_logs.rename(aside)
    return aside
