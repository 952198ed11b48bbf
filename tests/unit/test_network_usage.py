"""A workload's network bytes: its pods' namespaces, or on one machine its ranks' own TCP
sockets, read from the real kernel (sock_diag) for the sockets of this test process."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


class FakeProc:
    """A /proc of processes with network namespaces of their own (pods) or the host's,
    their interfaces' counters and their sockets, and the kernel's socket table."""

    def __init__(self, root: Path):
        self.root = root
        (root / "self" / "ns").mkdir(parents=True)
        (root / "self" / "ns" / "net").write_text("host")
        self.table: dict[int, Traffic] = {}

    def pod(self, pid: int, namespace: str, received: int, sent: int) -> None:
        (self.root / str(pid) / "ns").mkdir(parents=True, exist_ok=True)
        (self.root / str(pid) / "net").mkdir(exist_ok=True)
        space = self.root / "namespaces" / namespace
        space.parent.mkdir(exist_ok=True)
        space.touch()
        (self.root / str(pid) / "ns" / "net").unlink(missing_ok=True)
        os.link(space, self.root / str(pid) / "ns" / "net")  # one inode per namespace
        (self.root / str(pid) / "net" / "dev").write_text(
            NET_DEV.replace("1500", str(received)).replace("2500", str(sent))
        )

    def rank(self, pid: int, sockets: dict[int, Traffic]) -> None:
        (self.root / str(pid) / "ns").mkdir(parents=True, exist_ok=True)
        (self.root / str(pid) / "ns" / "net").unlink(missing_ok=True)
        os.link(self.root / "self" / "ns" / "net", self.root / str(pid) / "ns" / "net")
        fds = self.root / str(pid) / "fd"
        shutil.rmtree(fds, ignore_errors=True)
        fds.mkdir()
        for n, (inode, traffic) in enumerate(sockets.items()):
            (fds / str(n)).symlink_to(f"socket:[{inode}]")
            self.table[inode] = traffic

    def gone(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


def test_a_workload_s_pods_add_up_and_a_replaced_pod_takes_nothing_back(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    usage = NetworkUsage(proc=tmp_path, sockets=lambda: proc.table)
    proc.pod(10, "pod-a", received=1000, sent=100)
    proc.pod(20, "pod-b", received=2000, sent=200)
    pods = [MarkedProcess(10, "m.0", 1, {}), MarkedProcess(20, "m.1", 2, {})]
    # Loopback left out: eth0 and net1 of each pod (NET_DEV's net1 adds 500 and 700).
    assert usage.read(pods)["m"] == Traffic(received=3000 + 1000, sent=300 + 1400)
    # Pod 1 is replaced: its new namespace starts from nothing; the total does not drop.
    proc.gone(20)
    proc.pod(30, "pod-b2", received=10, sent=1)
    pods[1] = MarkedProcess(30, "m.1", 3, {})
    assert usage.read(pods)["m"] == Traffic(received=4000 + 510, sent=1700 + 701)
    # A namespace that cannot be read for a moment keeps its last reading.
    (tmp_path / "10" / "net" / "dev").unlink()
    assert usage.read(pods)["m"] == Traffic(received=4510, sent=2401)


def test_sockets_not_seen_for_a_moment_are_neither_lost_nor_counted_twice(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    usage = NetworkUsage(proc=tmp_path, sockets=lambda: proc.table)
    proc.rank(10, {7: Traffic(100, 10), 8: Traffic(200, 20)})
    rank = [MarkedProcess(10, "m.0", 1, {})]
    assert usage.read(rank)["m"] == Traffic(300, 30)
    # Its descriptors cannot be read now (not a directory: an error other than "gone"),
    # and the sockets still exist and carried more: they are counted as they are now.
    shutil.rmtree(tmp_path / "10" / "fd")
    (tmp_path / "10" / "fd").write_text("unreadable")
    proc.table.update({7: Traffic(150, 15), 8: Traffic(250, 25)})
    assert usage.read(rank)["m"] == Traffic(400, 40)
    (tmp_path / "10" / "fd").unlink()
    proc.rank(10, {7: Traffic(150, 15), 8: Traffic(250, 25)})
    assert usage.read(rank)["m"] == Traffic(400, 40)  # seen again: not counted twice
    # Socket 8 closes: what it carried stays; a workload gone is forgotten.
    del proc.table[8]
    proc.rank(10, {7: Traffic(160, 16)})
    assert usage.read(rank)["m"] == Traffic(160 + 250, 16 + 25)
    assert usage.read([]) == {} and not usage._last and not usage._closed
