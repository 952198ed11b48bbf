"""The agent's live GPU state and its Prometheus exporter (one process, read at scrape time)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

from ..recovery.nvml import GpuInfo, GpuSample, Nvml
from .gpus import NodePlace, whole_gpus
from .metrics import Assignment, GpuCollector, families


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


def start_exporter(gpus: GpuState, hostname: str, ip: str, port: int) -> CollectorRegistry:
    """Serve /metrics on ``ip:port`` from a daemon thread; each scrape reads NVML."""
    hosts = {
        uuid: gpus.places[uuid].name if uuid in gpus.places else hostname for uuid in gpus.whole
    }

    def read() -> list[Metric]:
        return families(
            gpus.sample(), gpus.whole, hosts, gpus.driver_version, gpus.assignments, gpus.last_xid
        )

    registry = CollectorRegistry()
    registry.register(GpuCollector(read))
    start_http_server(port, addr=ip, registry=registry)
    return registry
