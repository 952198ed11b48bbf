"""One watch of a cluster's Node objects, read in a thread of its own.

A kubelet renews its Node's status (at worst every 10 s), so a cluster of 500 nodes sends
about 50 Node events a second, nearly all of them heartbeats that change nothing gpufleet
reads. Read through the event loop, each one costs the loop's TLS layer and stream
machinery; read here, with blocking ``http.client`` reads over the ``ssl`` module, an event
costs its parse and ``observe_node``, and only a node whose reading changed reaches the
event loop (``deliver``). bench/k8s_inventory.py measures both.

The stream keeps its own copy of the nodes' last readings (``known``, seeded from the
listing the watch follows), so it can tell a heartbeat from a change without the loop.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..state.clusters import ClusterNodeState


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class WatchFailed(Exception):
    """The API server refused the watch or broke it off; ``status`` when it answered."""

    def __init__(self, message: str, status: int | None = None, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach one API server, from its client configuration."""

    host: str
    port: int
    context: ssl.SSLContext | None  # None: plain http (tests)
    headers: Mapping[str, str]

    @classmethod
    async def of(cls, configuration: Any) -> Endpoint:
        """From a ``kubernetes_asyncio`` configuration: its host, TLS settings and (fresh)
        bearer token, as its own REST client would use them. Raises ``ValueError`` for a
        configuration this reader cannot follow (a TLS server name other than the host's,
        a proxy): the caller watches through the event loop instead."""
        if configuration.tls_server_name or configuration.proxy:
            raise ValueError("a TLS server name or a proxy")
        url = urllib.parse.urlsplit(configuration.host)
        context = None
        if url.scheme == "https":
            context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
            if configuration.cert_file:
                context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
            if not configuration.verify_ssl:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
        headers = {"Accept": "application/json"}
        for setting in (await configuration.auth_settings()).values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.hostname or "", port, context, headers)


CONNECT_TIMEOUT_S = 10.0

Observe = Callable[[Mapping[str, Any]], ClusterNodeState | None]
Deliver = Callable[[str, ClusterNodeState | None], None]


class NodeStream:
    """A blocking watch of ``/api/v1/nodes`` from ``version``; ``follow`` runs it."""

    def __init__(self, endpoint: Endpoint, query: Mapping[str, str], timeout_s: int):
        self.endpoint = endpoint
        self.query = query
        self.timeout_s = timeout_s
        self._guard: socket.socket | None = None  # a copy of the socket, for ``close``
        self._closed = threading.Event()

    def follow(
        self,
        version: str,
        known: dict[str, ClusterNodeState],
        observe: Observe,
        deliver: Deliver,
    ) -> str:
        """Read events until the server ends the watch; ``deliver`` each node whose reading
        differs from ``known`` (which it updates). Returns the last version seen. Raises
        :class:`WatchExpired` (410) or :class:`WatchFailed`."""
        endpoint = self.endpoint
        connection = http.client.HTTPConnection(
            endpoint.host, endpoint.port, timeout=self.timeout_s + 30
        )
        try:
            raw = socket.create_connection(
                (endpoint.host, endpoint.port), timeout=CONNECT_TIMEOUT_S
            )
        except OSError as e:
            raise WatchFailed(f"{type(e).__name__}: {e}") from e
        # ``close`` shuts this copy down: wrapping the socket in TLS detaches its
        # descriptor from the object it came from, and a handshake the server never
        # answers must end too.
        self._guard = raw.dup()
        if self._closed.is_set():
            self._release(raw)
            return version
        raw.settimeout(self.timeout_s + 30)
        try:
            if endpoint.context is not None:
                raw = endpoint.context.wrap_socket(raw, server_hostname=endpoint.host)
        except OSError as e:
            self._release(raw)
            if self._closed.is_set():
                return version
            raise WatchFailed(f"{type(e).__name__}: {e}") from e
        connection.sock = raw
        query = {
            **self.query,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.timeout_s),
            "resourceVersion": version,
        }
        try:
            connection.request(
                "GET", f"/api/v1/nodes?{urllib.parse.urlencode(query)}", headers=endpoint.headers
            )
            response = connection.getresponse()
            if response.status != 200:
                body = response.read(4096).decode(errors="replace")
                raise WatchFailed(body or response.reason, response.status, response.reason)
            while line := response.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired(obj.get("message", "410 Gone"))
                    raise WatchFailed(f"watch error: {obj.get('message', obj)}", obj.get("code"))
                version = str(obj.get("metadata", {}).get("resourceVersion", version))
                if kind == "BOOKMARK":
                    continue
                name = str(obj["metadata"]["name"])
                state = None if kind == "DELETED" else observe(obj)
                if state is None:
                    if known.pop(name, None) is not None:
                        deliver(name, None)
                elif known.get(name) != state:
                    known[name] = state
                    deliver(name, state)
        except (OSError, http.client.HTTPException) as e:
            if self._closed.is_set():
                return version
            raise WatchFailed(f"{type(e).__name__}: {e}") from e
        finally:
            connection.close()
            self._release(None)
        return version

    def _release(self, sock: socket.socket | None) -> None:
        for held in (sock, self._guard):
            if held is not None:
                with contextlib.suppress(OSError):
                    held.close()
        self._guard = None

    def close(self) -> None:
        """End ``follow`` from another thread: its blocking handshake or read returns."""
        self._closed.set()
        guard = self._guard
        if guard is not None:
            with contextlib.suppress(OSError):
                guard.shutdown(socket.SHUT_RDWR)
