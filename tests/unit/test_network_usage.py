"""A workload's network bytes: its pods' namespaces, or on one machine its ranks' own TCP
sockets, read from the real kernel (sock_diag) for the sockets of this test process."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from gpufleet.agent.network_usage import NetworkUsage, Traffic, interface_bytes, tcp_sockets
from gpufleet.recovery.processes import MarkedProcess

NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9000000     100    0    0    0     0          0         0  9000000     100    0    0    0     0       0          0
  eth0: 1500        10    0    0    0     0          0         0     2500      20    0    0    0     0       0          0
  net1:  500         5    0    0    0     0          0         0      700       7    0    0    0     0       0          0
"""  # noqa: E501 (the kernel's own layout)


def test_a_pod_s_namespace_counts_every_interface_but_loopback() -> None:
    assert interface_bytes(NET_DEV) == Traffic(received=2000, sent=3200)


@contextmanager
def connected_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        try:
            yield client, accepted
        finally:
            client.close()
            accepted.close()


def send(sender: socket.socket, receiver: socket.socket, size: int) -> None:
    sender.sendall(b"x" * size)
    got = 0
    while got < size:
        got += len(receiver.recv(1 << 16))


def test_the_kernel_says_what_each_socket_carried() -> None:
    with connected_pair() as (client, accepted):
        send(client, accepted, 300_000)
        sockets = tcp_sockets()
        # The kernel counts the connection's SYN and FIN as a byte each.
        assert 300_000 <= sockets[os.fstat(client.fileno()).st_ino].sent <= 300_002
        assert 300_000 <= sockets[os.fstat(accepted.fileno()).st_ino].received <= 300_002


def test_a_workload_s_sockets_are_counted_and_stay_counted_once_closed() -> None:
    usage = NetworkUsage()
    me = [MarkedProcess(os.getpid(), "m1.0", 0, {})]
    before = usage.read(me)["m1"]
    with connected_pair() as (client, accepted):
        send(client, accepted, 200_000)
        send(accepted, client, 50_000)
        during = usage.read(me)["m1"]
    after = usage.read(me)["m1"]
    # Both ends are this process's: it sent and received each byte once.
    assert during.sent - before.sent >= 250_000
    assert during.received - before.received >= 250_000
    assert after.sent >= during.sent and after.received >= during.received
    # A workload whose processes are gone is forgotten.
    assert usage.read([]) == {}
