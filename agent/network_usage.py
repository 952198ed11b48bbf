"""Bytes in and out of each workload's pods or ranks on this node, for the exporter.

Where a workload's processes have a network namespace of their own (a Kubernetes pod), its
traffic is what that namespace's interfaces counted, loopback left out: the same figure
cAdvisor gives as ``container_network_*_bytes_total``. On one machine, sessions and ranks
share the host's namespace, so their traffic is what their own TCP sockets carried
(``tcp_info``'s bytes acknowledged and received, read with the kernel's sock_diag), loopback
included: two ranks of one job on one machine talk over it. UDP is not counted there.

Neither sees RDMA (InfiniBand, RoCE): NCCL's traffic over it bypasses the kernel's
network stack. docs/monitoring.md says what to scrape for it.

Counters only grow: a socket's bytes stay counted after it closes (its last reading is
kept), so ``rate()`` over them is the workload's throughput. They start again from 0 when
the agent restarts, which Prometheus takes as a counter reset.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..recovery.processes import MarkedProcess, workload_marker

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBxI48x")  # inet_diag_req_v2, its socket id left zero: all
_MESSAGE = struct.Struct("=BBBB48xIIIII")  # inet_diag_msg: ..., uid, inode
_ATTRIBUTE = struct.Struct("=HH")  # rtattr
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, since 4.1/4.2.
_TCP_BYTES = struct.Struct("=QQ")
_TCP_BYTES_AT = 120


class NetworkUsageUnavailable(Exception):
    """The kernel's socket diagnostics cannot be read here (the message says why)."""


@dataclass(frozen=True)
class Traffic:
    received: int = 0
    sent: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.received + other.received, self.sent + other.sent)


def interface_bytes(net_dev: str) -> Traffic:
    """The bytes every interface but loopback received and sent, from ``/proc/net/dev``."""
    total = Traffic()
    for line in net_dev.splitlines()[2:]:
        name, _, counters = line.partition(":")
        fields = counters.split()
        if name.strip() == "lo" or len(fields) < 9:
            continue
        total += Traffic(int(fields[0]), int(fields[8]))
    return total


def _dump_request(family: int, sequence: int) -> bytes:
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0xFFFFFFFF)
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, flags, sequence, 0) + body


def _tcp_bytes(message: bytes) -> tuple[int, Traffic] | None:
    """(inode, traffic) of one inet_diag_msg, if it carries a tcp_info long enough."""
    *_, inode = _MESSAGE.unpack_from(message)
    at = _MESSAGE.size
    while at + _ATTRIBUTE.size <= len(message):
        length, kind = _ATTRIBUTE.unpack_from(message, at)
        if length < _ATTRIBUTE.size:
            break
        info = message[at + _ATTRIBUTE.size : at + length]
        if kind == INET_DIAG_INFO and len(info) >= _TCP_BYTES_AT + _TCP_BYTES.size:
            acked, received = _TCP_BYTES.unpack_from(info, _TCP_BYTES_AT)
            return int(inode), Traffic(received=received, sent=acked)
        at += (length + 3) & ~3
    return None


def _dump(family: int) -> dict[int, Traffic]:
    found: dict[int, Traffic] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(5)  # the kernel answers at once; a scrape never waits for ever
        diag.sendall(_dump_request(family, 1))
        while True:
            data = diag.recv(1 << 16)
            at = 0
            while at + _HEADER.size <= len(data):
                length, kind, *_ = _HEADER.unpack_from(data, at)
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, at + _HEADER.size)
                    raise NetworkUsageUnavailable(f"sock_diag refused: {os.strerror(-errno)}")
                read = _tcp_bytes(data[at + _HEADER.size : at + length])
                if read is not None:
                    found[read[0]] = read[1]
                at += (length + 3) & ~3
            if not data:
                return found


def tcp_sockets() -> dict[int, Traffic]:
    """Every TCP socket of this network namespace by inode, with the bytes it carried."""
    try:
        return {**_dump(socket.AF_INET), **_dump(socket.AF_INET6)}
    except OSError as e:
        raise NetworkUsageUnavailable(f"cannot read the kernel's socket diagnostics: {e}") from e


# The most descriptors of one process read per scrape: a process holding more (a user may
# open millions) has the rest left uncounted rather than slow every scrape of the node.
MAX_FDS = 65536


def socket_inodes(pid: int, proc: Path) -> set[int] | None:
    """The inodes of the sockets a process holds open: empty once it is gone, None where
    they could not all be read (this time: the sockets' last readings then stand)."""
    inodes = set()
    try:
        for count, fd in enumerate((proc / str(pid) / "fd").iterdir()):
            if count >= MAX_FDS:
                return None
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except (FileNotFoundError, ProcessLookupError):
        return set()
    except OSError:
        return None
    return inodes


def _namespace(pid: int | str, proc: Path) -> int | None:
    try:
        return os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


# What a reading counts: a network namespace's interfaces, or one socket, by inode.
Source = tuple[str, int]


@dataclass
class NetworkUsage:
    """Each workload's traffic on this node, counted as the module says. ``sockets`` reads
    the kernel's TCP sockets (a test gives its own)."""

    proc: Path = Path("/proc")
    sockets: Callable[[], Mapping[int, Traffic]] = field(default=lambda: tcp_sockets())
    # Per workload marker: the last reading of each source it has, and what the sources it
    # no longer has carried: together they only grow while the workload is on the node.
    _last: dict[str, dict[Source, Traffic]] = field(default_factory=dict)
    _closed: dict[str, Traffic] = field(default_factory=dict)

    def read(self, processes: Iterable[MarkedProcess]) -> dict[str, Traffic]:
        """Traffic so far by workload marker, for the workloads whose processes run now."""
        host = _namespace("self", self.proc)
        by_workload: dict[str, list[MarkedProcess]] = {}
        for process in processes:
            by_workload.setdefault(workload_marker(process.marker), []).append(process)
        table: Mapping[int, Traffic] | None = None
        usage = {}
        for marker, members in by_workload.items():
            namespaces: dict[int, int] = {}  # namespace → the oldest member in it
            shared = []
            for member in sorted(members, key=lambda m: m.started):
                space = _namespace(member.pid, self.proc)
                if space is None or space == host:
                    shared.append(member.pid)
                else:
                    namespaces.setdefault(space, member.pid)
            before = self._last.get(marker, {})
            now = self._namespaces(namespaces, before)
            if shared:
                table = self.sockets() if table is None else table
                now |= self._sockets(shared, before, table)
            closed = self._closed.get(marker, Traffic())
            closed = sum((last for key, last in before.items() if key not in now), closed)
            self._last[marker], self._closed[marker] = now, closed
            usage[marker] = sum(now.values(), closed)
        for gone in set(self._last) - set(by_workload):
            del self._last[gone]
            self._closed.pop(gone, None)
        return usage

    def _namespaces(
        self, namespaces: Mapping[int, int], before: Mapping[Source, Traffic]
    ) -> dict[Source, Traffic]:
        """Each namespace's interfaces; one that cannot be read now keeps its last reading."""
        now = {}
        for space, pid in namespaces.items():
            try:
                dev = (self.proc / str(pid) / "net" / "dev").read_text()
                now["ns", space] = interface_bytes(dev)
            except OSError:
                if ("ns", space) in before:
                    now["ns", space] = before["ns", space]
        return now

    def _sockets(
        self, pids: Iterable[int], before: Mapping[Source, Traffic], table: Mapping[int, Traffic]
    ) -> dict[Source, Traffic]:
        """The sockets the processes hold, as the kernel counts them. A socket counted
        before that is not seen among their descriptors now but still exists (they could
        not all be read, or it was handed on) stays counted: only a socket gone from the
        kernel is closed, with its last reading."""
        held: set[int] = set()
        for pid in pids:
            held |= socket_inodes(pid, self.proc) or set()
        now: dict[Source, Traffic] = {("sock", i): table[i] for i in held if i in table}
        for kind, inode in before:
            if kind == "sock" and ("sock", inode) not in now and inode in table:
                now["sock", inode] = table[inode]
        return now
