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
from collections.abc import Iterable, Mapping
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


def socket_inodes(pid: int, proc: Path) -> set[int]:
    """The inodes of the sockets a process holds open (empty once it is gone)."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _namespace(pid: int | str, proc: Path) -> int | None:
    try:
        return os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


@dataclass
class NetworkUsage:
    """Each workload's traffic on this node, counted as the module says."""

    proc: Path = Path("/proc")
    # Per workload marker: its sockets' last readings, and what its closed sockets carried.
    _open: dict[str, dict[int, Traffic]] = field(default_factory=dict)
    _closed: dict[str, Traffic] = field(default_factory=dict)

    def read(self, processes: Iterable[MarkedProcess]) -> dict[str, Traffic]:
        """Traffic so far by workload marker, for the workloads whose processes run now."""
        host = _namespace("self", self.proc)
        by_workload: dict[str, list[MarkedProcess]] = {}
        for process in processes:
            by_workload.setdefault(workload_marker(process.marker), []).append(process)
        sockets: Mapping[int, Traffic] | None = None
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
            total = sum((self._namespace_bytes(pid) for pid in namespaces.values()), Traffic())
            if shared:
                sockets = tcp_sockets() if sockets is None else sockets
                total += self._socket_bytes(marker, shared, sockets)
            usage[marker] = total
        for gone in set(self._open) - set(by_workload):
            del self._open[gone]
            self._closed.pop(gone, None)
        return usage

    def _namespace_bytes(self, pid: int) -> Traffic:
        try:
            return interface_bytes((self.proc / str(pid) / "net" / "dev").read_text())
        except OSError:
            return Traffic()

    def _socket_bytes(
        self, marker: str, pids: Iterable[int], sockets: Mapping[int, Traffic]
    ) -> Traffic:
        held = set().union(*(socket_inodes(pid, self.proc) for pid in pids))
        now = {inode: sockets[inode] for inode in held if inode in sockets}
        before = self._open.get(marker, {})
        closed = self._closed.get(marker, Traffic())
        for inode, last in before.items():
            if inode not in now:
                closed += last
        self._open[marker], self._closed[marker] = now, closed
        return sum(now.values(), closed)
