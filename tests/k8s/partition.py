"""A network partition between gpufleet and one API server, without touching the server.

``Partition`` is a TCP forwarder on a loopback port of its own: a kubeconfig that names it
instead of the API server reaches the server through it (TLS passes through untouched, and
the server's certificate is for 127.0.0.1 whatever the port). ``cut()`` drops every
connection it carries and holds new ones open without an answer — a server that does not
answer, as behind a dead link — while the cluster's own scheduler, controller-manager and
kubelets go on talking to it directly. ``heal()`` forwards again.

A thread, not asyncio: the controller under test runs in the test's event loop, and the
partition must keep its promise whatever that loop does.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class Partition:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._listener.setblocking(False)
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._held: list[socket.socket] = []
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="partition", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """From now on nothing gets through; what was connected is dropped."""
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in [*self._pairs, *self._held, self._listener]:
            with contextlib.suppress(OSError):
                sock.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._cut.is_set() and self._pairs:
                for sock in list(self._pairs):
                    self._drop(sock)
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                elif sock in self._pairs:
                    self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._cut.is_set():
            self._held.append(client)  # open, and never answered
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for sock, peer in ((client, upstream), (upstream, client)):
            sock.setblocking(False)
            self._pairs[sock] = peer
            self._selector.register(sock, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        peer = self._pairs[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.setblocking(True)
                peer.sendall(data)
                peer.setblocking(False)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._pairs.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._pairs.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(s)
            with contextlib.suppress(OSError):
                s.close()
