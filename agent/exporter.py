"""The agent's live GPU state and its Prometheus exporter (one process, read at scrape time)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..recovery.nvml import GpuInfo, GpuSample, Nvml, NvmlError
from ..recovery.processes import (
    POD_VARIABLES,
    MarkedProcess,
    marked_process_details,
    workload_marker,
)
from .gpus import NodePlace, whole_gpus
from .metrics import Assignment, Family, exposition, families, network_families
from .network_usage import NetworkUsage, NetworkUsageUnavailable
from .placements import VISIBLE_DEVICES, pod_identities

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class GpuState:
    nvml: Nvml
    inventory: list[GpuInfo]
    places: dict[str, NodePlace]
    driver_version: str
    assignments: dict[str, Assignment] = field(default_factory=dict)
    last_xid: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    whole: dict[str, GpuInfo] = field(init=False)
    _uuid_of_index: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        # Samples and metrics are per whole GPU, MIG or not; the inventory does not change.
        self.whole = whole_gpus(self.inventory)
        self._uuid_of_index = {g.index: g.uuid for g in self.whole.values()}

    def sample(self) -> list[GpuSample]:
        # NVML calls come from the sampling loop and from scrapes: one at a time.
        with self._lock:
            return self.nvml.sample(self._uuid_of_index)


def _handler(scrape: Callable[[], str]) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        timeout = 30  # an idle or stalled client gives its thread back

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404, "the metrics are at /metrics")
                return
            try:
                body = scrape().encode()
            except NvmlError as e:  # the scraper's "down", not the agent's end
                self.send_error(500, f"could not read the GPUs: {e}")
                return
            except Exception:  # a thread's edge: log it, answer, go on
                log.exception("a scrape failed")
                self.send_error(500, "the scrape failed; the node agent's log says why")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape would drown the agent's log

    return MetricsHandler


def serve_metrics(scrape: Callable[[], str], ip: str, port: int) -> ThreadingHTTPServer:
    """Serve ``scrape()`` at ``http://ip:port/metrics`` from a daemon thread."""
    family = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
    server = server_class((ip, port), _handler(scrape))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


@dataclass
class NetworkReader:
    """Each scrape's network families; says once why they are missing where the kernel's
    socket diagnostics cannot be read (the GPU series are served regardless)."""

    hostname: str
    usage: NetworkUsage = field(default_factory=NetworkUsage)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _failed: bool = False

    def families(
        self, processes: list[MarkedProcess], assignments: dict[str, Assignment]
    ) -> list[Family]:
        # Only the workloads holding GPUs here: a process carrying any other marker (a
        # user can set one) costs the scrape nothing.
        held = {a.marker for a in assignments.values() if a.marker}
        theirs = [p for p in processes if workload_marker(p.marker) in held]
        with self._lock:  # scrapes may overlap; the counters' memory is one
            try:
                traffic = self.usage.read(theirs)
            except NetworkUsageUnavailable as e:
                if not self._failed:
                    log.warning("no network metrics: %s", e)
                self._failed = True
                return []
        return network_families(traffic, assignments, self.hostname)


def start_exporter(gpus: GpuState, hostname: str, ip: str, port: int) -> ThreadingHTTPServer:
    """Serve /metrics on ``ip:port``; each scrape reads NVML and the workloads' traffic."""
    hosts = {
        uuid: gpus.places[uuid].name if uuid in gpus.places else hostname for uuid in gpus.whole
    }
    network = NetworkReader(hostname)

    def scrape() -> str:
        assignments = gpus.assignments
        processes = marked_process_details((VISIBLE_DEVICES, *POD_VARIABLES))
        holders = {uuid: a.marker for uuid, a in assignments.items() if a.marker}
        pods = pod_identities(processes, gpus.whole, holders)
        gpu_families = families(
            gpus.sample(),
            gpus.whole,
            hosts,
            gpus.driver_version,
            assignments,
            gpus.last_xid,
            pods,
        )
        return exposition([*gpu_families, *network.families(processes, assignments)])

    return serve_metrics(scrape, ip, port)
