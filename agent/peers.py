"""Who is at the other end of a loopback connection to the node agent.

A job's ranks report their progress to the agent on loopback and hold no platform token.
What a rank says of itself (its process marker) is not proof enough: any process may put
any marker in its own environment. The kernel knows better. For a connection from this
machine, ``/proc/net/tcp`` names the socket that opened it (its inode) and the account
that owns it; ``/proc/<pid>/fd`` names the processes holding that socket. A report counts
for a pod only when it comes from a socket a process of that pod holds, owned by the
account its ranks run as (:func:`check_caller`).

The local backend's ranks share the host's network namespace (the loopback guard matches
their uids), so the agent sees their sockets as they are; a Kubernetes pod's are found in
its processes' own network namespace.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..recovery import processes

ESTABLISHED = "01"

Address = tuple[str, int]


class ReportRefused(Exception):
    """A progress report refused: its caller is not a process of the pod it names, as
    that pod's account; the message says which."""


@dataclass(frozen=True)
class Caller:
    """The socket that opened a connection to the agent: its owner and its inode."""

    uid: int
    inode: int


def _address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of ``/proc/net/tcp{,6}``: the IP as 32-bit words in the host's (little
    endian) order, then the port in hex."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(ordered)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, int(port, 16)
    return ip, int(port, 16)


def caller_of(
    client: Address, server: Address, proc: Path = Path("/proc"), marker: str = ""
) -> Caller | None:
    """The socket of this machine that connected from ``client`` to ``server`` (as the
    agent's side sees them: its peer and its own address); None when none did.

    The machine's own network namespace is searched first, then (with ``marker``) those of
    the processes carrying it: a Kubernetes pod has a network of its own, whose sockets only
    its processes' ``/proc/<pid>/net`` shows. Whoever holds the socket found is still to be
    checked (:func:`check_caller`): a marker names where to look, it proves nothing."""
    want = (
        (ipaddress.ip_address(client[0]), int(client[1])),
        (ipaddress.ip_address(server[0]), int(server[1])),
    )
    found = _in_tables(proc / "net", want)
    if found is not None or not marker:
        return found
    seen: set[int] = set()
    for pid in processes.marked_pids(marker, proc):
        try:
            namespace = os.stat(proc / str(pid) / "ns" / "net").st_ino
        except OSError:
            continue
        if namespace in seen:
            continue
        seen.add(namespace)
        found = _in_tables(proc / str(pid) / "net", want)
        if found is not None:
            return found
    return None


def _in_tables(net: Path, want: tuple[tuple[Any, int], tuple[Any, int]]) -> Caller | None:
    for table in ("tcp", "tcp6"):
        try:
            lines = (net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != ESTABLISHED:
                continue
            try:
                local, remote = _address(fields[1]), _address(fields[2])
            except ValueError:
                continue
            if (local, remote) == want:
                return Caller(int(fields[7]), int(fields[9]))
    return None


def holds_socket(pid: int, inode: int, proc: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` has socket ``inode`` open."""
    wanted = f"socket:[{inode}]"
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fd_dir / name) == wanted:
                return True
        except OSError:
            continue
    return False


def check_caller(
    caller: Caller | None, marker: str, uid: int | None, proc: Path = Path("/proc")
) -> None:
    """Raise ``ReportRefused`` unless ``caller`` is a socket owned by ``uid`` and held by a
    live process carrying ``marker``. Blocking (reads ``/proc``)."""
    if caller is None:
        raise ReportRefused("the report does not come from a process of this machine")
    if uid is None or caller.uid != uid:
        raise ReportRefused("the report does not come from the account this pod's ranks run as")
    if not any(
        holds_socket(pid, caller.inode, proc) for pid in processes.marked_pids(marker, proc)
    ):
        raise ReportRefused("the report does not come from a process of that pod")
