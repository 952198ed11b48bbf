"""The node agent: scrape time for 8 GPUs, the agent's CPU, and XID-to-controller latency.

Runs a real hub (controller and agent) whose agent serves the demo's two declared nodes of
4 GPUs through the fake NVML library and the real nvidia-ml-py bindings.

- scrape: GET /metrics of the agent's exporter, 8 GPUs read from NVML at scrape time;
  baseline in the same run: a prometheus_client exporter with an empty registry on the
  same machine (the cost of the HTTP exchange alone). Target: under 50 ms a scrape.
- CPU: the agent process's CPU time over 60 s while Prometheus scrapes every 15 s (and the
  agent samples every 5 s and heartbeats every 5 s, its defaults). Target: under 1 % of a core.
- XID: from writing an XID into the fake library's control file to the event being in the
  controller's database (polled every 5 ms). Target: under 1 s.

    .venv/bin/python bench/agent.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, start_http_server

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' hub harness
from gpufleet.agent.gpus import declared_fake_gpus
from gpufleet.recovery.fake_nvml import write_control
from tests.integration.harness import Hub, wait_for
from tests.ports import free_port

DECLARED = [
    {"name": "gpu-node-a", "zone": "zone-a", "gpu_type": "A100-80GB", "gpus": 4},
    {"name": "gpu-node-b", "zone": "zone-b", "gpu_type": "A100-80GB", "gpus": 4},
]
DEFAULT_INTERVALS = """
c.NodeAgent.heartbeat_interval = 5
c.NodeAgent.sample_interval = 5
"""


def timed_gets(url: str, rounds: int) -> list[float]:
    times = []
    with httpx.Client(timeout=10) as client:
        client.get(url)  # warm the connection
        for _ in range(rounds):
            started = time.perf_counter()
            response = client.get(url)
            times.append(time.perf_counter() - started)
            assert response.status_code == 200
    return times


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        hub = Hub.create(Path(tmp) / "hub", extra_config=DEFAULT_INTERVALS)
        try:
            hub.start()
            text = httpx.get(hub.metrics_url, timeout=10).text
            gpus_seen = {
                line.split('UUID="')[1].split('"')[0]
                for line in text.splitlines()
                if line.startswith("DCGM_FI_DEV_GPU_UTIL")
            }
            assert len(gpus_seen) == 8, gpus_seen

            port = free_port()
            start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())
            baseline = timed_gets(f"http://127.0.0.1:{port}/metrics", 200)
            ours = timed_gets(hub.metrics_url, 200)

            agent = hub.service_pid("gpufleet-agent")
            assert agent is not None
            before, began = cpu_seconds(agent), time.monotonic()
            while time.monotonic() - began < 60:
                httpx.get(hub.metrics_url, timeout=10)
                time.sleep(15 - (time.monotonic() - began) % 15)
            cpu_share = (cpu_seconds(agent) - before) / (time.monotonic() - began)

            devices = declared_fake_gpus(DECLARED)
            latencies = []
            for i in range(10):
                seen = len(xid_events(hub))
                changed = [
                    replace(g, xid_events=[43 + i]) if g.index == i % 8 else g for g in devices
                ]
                started = time.perf_counter()
                write_control(hub.fake_nvml_control, changed)
                wait_for(
                    lambda seen=seen: len(xid_events(hub)) > seen, 10, "the XID", interval=0.005
                )
                latencies.append(time.perf_counter() - started)
            write_control(hub.fake_nvml_control, devices)
        finally:
            hub.kill_everything()

    def ms(values: list[float], q: float) -> float:
        return (
            1000 * statistics.quantiles(values, n=100)[int(q) - 1]
            if q < 100
            else 1000 * max(values)
        )

    print("agent exporter, 8 GPUs through nvidia-ml-py + fake NVML, 200 scrapes")
    print(
        f"  scrape p50 {1000 * statistics.median(ours):6.2f} ms  p99 {ms(ours, 99):6.2f} ms"
        "  (target < 50 ms)"
    )
    print(
        f"  empty exporter baseline p50 {1000 * statistics.median(baseline):6.2f} ms  "
        f"p99 {ms(baseline, 99):6.2f} ms"
    )
    print(f"  ratio (p50) {statistics.median(ours) / statistics.median(baseline):6.2f}")
    print(f"agent CPU at a 15 s scrape interval: {100 * cpu_share:.3f} % of a core (target < 1 %)")
    print(
        f"XID to controller, 10 events: p50 {1000 * statistics.median(latencies):.0f} ms, "
        f"max {1000 * max(latencies):.0f} ms (target < 1000 ms)"
    )


def xid_events(hub: Hub) -> list[dict[str, object]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e["kind"] == "gpu-xid"]


if __name__ == "__main__":
    main()
