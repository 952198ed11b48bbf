"""Who is at the other end of a loopback connection, as the kernel says: a report counts
for a pod only from a socket one of that pod's processes holds, owned by its account."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.agent.peers import Caller, ReportRefused, caller_of, check_caller
from gpufleet.recovery import processes

CONNECTS = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "print('connected', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextmanager
def connected(marker: str) -> Iterator[tuple[socket.socket, subprocess.Popen[str]]]:
    """A connection to a listening socket of this test from a process carrying
    ``marker``, held open while inside."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = subprocess.Popen(
            [sys.executable, "-c", CONNECTS, str(port)],
            env={**os.environ, processes.MARKER_VARIABLE: marker},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None and client.stdout.readline() == "connected\n"
            conn, _ = server.accept()
            with conn:
                yield conn, client
        finally:
            client.kill()
            client.wait()


def test_the_caller_is_the_socket_its_process_holds_as_its_account() -> None:
    pod, other = processes.new_marker(), processes.new_marker()
    with connected(pod) as (conn, client), connected(other) as (_, impostor):
        caller = caller_of(conn.getpeername(), conn.getsockname())
        assert caller is not None and caller.uid == os.getuid()
        check_caller(caller, pod, os.getuid())  # the pod's process, as its account
        with pytest.raises(ReportRefused, match="not come from the account"):
            check_caller(caller, pod, os.getuid() + 1)
        # Another process (another pod's) does not hold that socket.
        with pytest.raises(ReportRefused, match="not come from a process of that pod"):
            check_caller(caller, other, os.getuid())
        assert client.pid in processes.marked_pids(pod)
        assert impostor.pid in processes.marked_pids(other)


def test_a_connection_no_socket_of_this_machine_made_has_no_caller() -> None:
    assert caller_of(("127.0.0.1", 1), ("127.0.0.1", 2)) is None
    with pytest.raises(ReportRefused, match="not come from a process of this machine"):
        check_caller(None, processes.new_marker(), 1000)
    with pytest.raises(ReportRefused, match="not come from a process of that pod"):
        check_caller(Caller(os.getuid(), 1), processes.new_marker(), os.getuid())


def _tcp_address(ip: str, port: int) -> str:
    """An IPv4 address as ``/proc/net/tcp`` writes it: the 32-bit word in little-endian."""
    return socket.inet_aton(ip)[::-1].hex().upper() + f":{port:04X}"


def fake_pod_process(proc: Path, pid: int, marker: str, connection: str) -> None:
    """A process of a pod with a network of its own, as ``/proc`` shows it to the agent."""
    root = proc / str(pid)
    (root / "ns").mkdir(parents=True)
    (root / "ns" / "net").write_text("")
    (root / "net").mkdir()
    (root / "net" / "tcp").write_text(f"  sl  local_address rem_address   st ...\n{connection}\n")
    (root / "environ").write_bytes(f"{processes.MARKER_VARIABLE}={marker}\0".encode())
    (root / "stat").write_text(f"{pid} (python) S 1 " + " ".join(["0"] * 18) + " 4242 0\n")


def test_a_pods_socket_is_found_in_its_own_network_namespace(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text("  sl  local_address rem_address   st ...\n")
    pod, other = processes.new_marker(), processes.new_marker()
    line = (
        f"   0: {_tcp_address('10.1.0.9', 40000)} {_tcp_address('10.0.0.1', 9207)} 01 "
        "00000000:00000000 00:00000000 00000000  1500        0 777 1 0 20 4 30 10 -1"
    )
    fake_pod_process(proc, 4321, pod, line)
    fake_pod_process(proc, 4322, other, "")
    client, server = ("10.1.0.9", 40000), ("10.0.0.1", 9207)
    assert caller_of(client, server, proc, marker=pod) == Caller(1500, 777)
    # Not in the machine's own namespace, nor in another pod's.
    assert caller_of(client, server, proc) is None
    assert caller_of(client, server, proc, marker=other) is None
