"""The Node watch read in a thread (hub/node_stream.py), against a real HTTP server that
streams watch events as an API server does (chunked, one JSON event per line): only a
node whose reading changed is delivered; 410 asks for a new listing; a refusal says its
status; ``close`` from another thread ends a blocked read."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from gpufleet.clusters.kube_config import ClusterSettings
from gpufleet.clusters.node_stream import Endpoint, NodeStream, WatchExpired, WatchFailed
from gpufleet.clusters.node_watch import observe_node
from gpufleet.state.clusters import ClusterNodeState

SETTINGS = ClusterSettings(name="c", kubeconfig="/dev/null")


def node(name: str, version: str, *, gpus: int = 4, unschedulable: bool = False) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "resourceVersion": version,
            "labels": {
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "topology.kubernetes.io/zone": "zone-a",
            },
        },
        "spec": {"unschedulable": unschedulable},
        "status": {
            "capacity": {"nvidia.com/gpu": str(gpus)},
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": version}],
        },
    }


class ApiServer:
    """Answers ``GET /api/v1/nodes?watch=1`` with ``self.events`` (or ``self.status``), then
    holds the stream open while ``self.hold`` is set."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.status = 200
        self.hold = threading.Event()
        self.queries: list[dict[str, list[str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.queries.append(parse_qs(urlsplit(self.path).query))
                if outer.status != 200:
                    body = b'{"kind":"Status","message":"nodes is forbidden"}'
                    self.send_response(outer.status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in outer.events:
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                while outer.hold.is_set():
                    time.sleep(0.05)
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = Endpoint("127.0.0.1", self.server.server_address[1], None, {})
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[ApiServer]:
    made = ApiServer()
    yield made
    made.hold.clear()
    made.server.shutdown()
    made.server.server_close()


def follow(
    api: ApiServer, known: dict[str, ClusterNodeState]
) -> tuple[str, list[tuple[str, bool]]]:
    delivered: list[tuple[str, bool]] = []
    stream = NodeStream(api.endpoint, {"labelSelector": "gpu=yes"}, timeout_s=30)
    version = stream.follow(
        "100",
        known,
        lambda obj: observe_node(obj, SETTINGS),
        lambda name, state: delivered.append((name, state is not None)),
    )
    return version, delivered


def test_only_changes_are_delivered_and_the_version_follows(api: ApiServer) -> None:
    start = observe_node(node("n1", "100"), SETTINGS)
    assert start is not None
    api.events = [
        {"type": "MODIFIED", "object": node("n1", "101")},  # a heartbeat: nothing changed
        {"type": "MODIFIED", "object": node("n1", "102", unschedulable=True)},  # cordoned
        {"type": "ADDED", "object": node("n2", "103")},
        {"type": "MODIFIED", "object": node("n2", "104")},  # heartbeat
        {"type": "DELETED", "object": node("n2", "105")},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "106"}}},
    ]
    known = {"n1": start}
    version, delivered = follow(api, known)
    assert delivered == [("n1", True), ("n2", True), ("n2", False)]
    assert version == "106"
    assert set(known) == {"n1"} and known["n1"].unschedulable
    (query,) = api.queries
    assert query["watch"] == ["1"] and query["resourceVersion"] == ["100"]
    assert query["labelSelector"] == ["gpu=yes"] and query["allowWatchBookmarks"] == ["true"]


def test_a_version_too_old_asks_for_a_new_listing(api: ApiServer) -> None:
    api.events = [{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}]
    with pytest.raises(WatchExpired, match="too old"):
        follow(api, {})


def test_a_refusal_says_its_status(api: ApiServer) -> None:
    api.status = 403
    with pytest.raises(WatchFailed) as refused:
        follow(api, {})
    assert refused.value.status == 403 and "forbidden" in str(refused.value)


def test_close_from_another_thread_ends_a_blocked_read(api: ApiServer) -> None:
    api.hold.set()
    stream = NodeStream(api.endpoint, {}, timeout_s=30)
    result: list[str] = []
    reader = threading.Thread(
        target=lambda: result.append(stream.follow("7", {}, lambda o: None, lambda n, s: None))
    )
    reader.start()
    deadline = time.monotonic() + 10
    while not api.queries and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.close()
    reader.join(10)
    assert not reader.is_alive() and result == ["7"]


def test_close_ends_a_tls_handshake_the_server_never_answers() -> None:
    # A server behind a dead link: the connection is accepted and nothing ever comes back.
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def hold() -> None:
        connection = listener.accept()[0]
        connection.recv(1, socket.MSG_PEEK)  # the client's hello: it is in the handshake
        held.append(connection)

    threading.Thread(target=hold, daemon=True).start()
    endpoint = Endpoint("127.0.0.1", listener.getsockname()[1], ssl.create_default_context(), {})
    stream = NodeStream(endpoint, {}, timeout_s=300)
    result: list[str] = []
    reader = threading.Thread(
        target=lambda: result.append(stream.follow("9", {}, lambda o: None, lambda n, s: None))
    )
    reader.start()
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.close()
    reader.join(10)
    assert not reader.is_alive() and result == ["9"]
    listener.close()
