"""Ports for the servers the tests start, chosen where nothing else takes them.

A port found free by binding port 0 comes from the kernel's ephemeral range, and until the
server meant for it binds it, any outgoing connection or another server started with port 0
may take it: with several test workers starting hubs, API servers and databases at once,
that happened. The tests choose instead from below the ephemeral range, each xdist worker
from a slice of its own, going round its slice in turn; only this process could then take a
port it chose, and only after going round the whole slice.

A slice's twin, ``TWIN_OFFSET`` above it, is kept free for servers that derive a second
port from the first (SeaweedFS listens for gRPC at its HTTP port + 10000)."""

from __future__ import annotations

import os
import random
import re
import socket
import threading
from pathlib import Path

LOWEST = 10000
SLICE = 1000
WORKER_SLICES = 10
TWIN_OFFSET = WORKER_SLICES * SLICE


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_index() -> int:
    found = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(found.group(1)) % WORKER_SLICES if found else 0


class _Slice:
    """The ports this process chooses from, handed out in turn from a random start."""

    def __init__(self, index: int) -> None:
        self.first = LOWEST + index * SLICE
        self._next = random.randrange(SLICE)
        self._lock = threading.Lock()
        if self.first + SLICE + TWIN_OFFSET > _ephemeral_floor():
            raise RuntimeError(
                f"the test ports {LOWEST}-{LOWEST + 2 * TWIN_OFFSET} reach into the kernel's "
                "ephemeral range (/proc/sys/net/ipv4/ip_local_port_range); raise its floor"
            )

    def block(self, size: int, twins: bool) -> int:
        """The first of ``size`` consecutive ports free now (with their twins, if asked)."""
        with self._lock:
            for _ in range(SLICE):
                offset = self._next
                self._next = (self._next + size) % SLICE
                if offset + size > SLICE:
                    continue
                base = self.first + offset
                wanted = range(base, base + size)
                if all(_is_free(p) and (not twins or _is_free(p + TWIN_OFFSET)) for p in wanted):
                    return base
        raise RuntimeError(f"no {size} free ports left in {self.first}-{self.first + SLICE}")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_slice: _Slice | None = None
_slice_lock = threading.Lock()


def _own_slice() -> _Slice:
    global _slice
    with _slice_lock:
        if _slice is None:
            _slice = _Slice(_worker_index())
        return _slice


def free_port_block(size: int) -> int:
    """The first of ``size`` consecutive ports on 127.0.0.1 for this process's servers."""
    return _own_slice().block(size, twins=False)


def free_ports(count: int, *, twins: bool = False) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 for this process's servers; with ``twins``,
    each port + ``TWIN_OFFSET`` is free as well."""
    return [_own_slice().block(1, twins) for _ in range(count)]


def free_port() -> int:
    return free_ports(1)[0]
