"""Who is at the other end of a loopback connection, as the kernel says: a report counts
for a pod only from a socket one of that pod's processes holds, owned by its account."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

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
