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

    def sample(self) -> list[GpuSample]:
        # NVML calls come from the sampling loop and from scrapes: one at a time.
        with self._lock:
            return self.nvml.sample({g.index: g.uuid for g in whole_gpus(self.inventory).values()})


def start_exporter(gpus: GpuState, hostname: str, ip: str, port: int) -> CollectorRegistry:
    """Serve /metrics on ``ip:port`` from a daemon thread; each scrape reads NVML."""
    by_uuid = whole_gpus(gpus.inventory)  # metrics are per GPU, MIG or not

    hosts = {uuid: place.name for uuid, place in gpus.places.items()}

    def read() -> list[Metric]:
        samples = gpus.sample()
        return families(
            samples,
            by_uuid,
            {**dict.fromkeys(by_uuid, hostname), **hosts},
            gpus.driver_version,
            gpus.assignments,
            gpus.last_xid,
        )

    registry = CollectorRegistry()
    registry.register(GpuCollector(read))
    start_http_server(port, addr=ip, registry=registry)
    return registry
