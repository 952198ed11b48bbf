"""API latency under 50 concurrent clients: listing 10,000 workloads and submitting a job,
against the hub's own ``GET /hub/api/users`` measured in the same run on the same hub.

A real hub with its proxy, controller and agent; 10,000 ended workloads written into the
controller's database beforehand (sessions and jobs of 200 users), so every list query
counts and pages over them. Both nodes are cordoned while jobs are submitted, so the
submitted jobs wait in the queue (each is one more waiting workload for the scheduler)
instead of starting torchrun. Every request goes through the proxy, as a client's would.

    .venv/bin/python bench/api_latency.py [--clients 50] [--requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' hub harness
from gpufleet.state.models import (
    Project,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from tests.integration.harness import Hub

SEEDED = 10_000


def seed(hub: Hub, count: int) -> None:
    """``count`` ended workloads, as months of use would leave them."""
    engine = create_engine(f"sqlite:///{hub.data_dir / 'gpufleet.sqlite'}")
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        project = session.scalar(select(Project).where(Project.name == "vision"))
        assert project is not None, "the hub has not applied its projects yet"
        for i in range(count):
            started = now - timedelta(hours=count - i)
            session.add(
                Workload(
                    kind=WorkloadKind.job if i % 3 == 0 else WorkloadKind.session,
                    project=project,
                    username=f"user{i % 200}",
                    name=f"w{i}",
                    gpu_type="A100-80GB",
                    pods=1,
                    gpus_per_pod=1 + i % 4,
                    state=WorkloadState.ended,
                    outcome="stopped",
                    reason="seeded for the benchmark",
                    created_at=started,
                    admitted_at=started,
                    started_at=started,
                    ended_at=started + timedelta(minutes=30),
                )
            )
    engine.dispose()


async def load(
    clients: int, requests: int, make: Callable[[httpx.AsyncClient, int], Any]
) -> list[float]:
    """``clients`` concurrent clients, each sending ``requests`` requests one after the other;
    the latency of every request."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def client(number: int) -> None:
            for i in range(requests):
                began = time.perf_counter()
                response = await make(http, number * requests + i)
                latencies.append(time.perf_counter() - began)
                assert response.status_code < 300, (response.status_code, response.text[:300])

        await asyncio.gather(*(client(n) for n in range(clients)))
    return latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=20, help="per client and operation")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        hub = Hub.create(Path(tmp) / "hub")
        try:
            hub.start()
            seed(hub, SEEDED)
            admin = {"Authorization": f"token {hub.token}"}
            alice = {"Authorization": f"token {hub.user_token('alice')}"}
            for node in ("gpu-node-a", "gpu-node-b"):
                hub.controller("POST", f"/nodes/{node}/cordon").raise_for_status()
            total = hub.controller("GET", "/workloads", params={"limit": 1}).json()["total"]
            assert total >= SEEDED, total
            script = "print('never runs: the nodes are cordoned')\n"
            job = {
                "project": "vision",
                "gpu_type": "A100-80GB",
                "gpus": 1,
                "script": script,
                "python": sys.executable,
            }
            operations: dict[str, Callable[[httpx.AsyncClient, int], Any]] = {
                "hub GET /hub/api/users (baseline)": lambda http, i: http.get(
                    f"{hub.api}/users", headers=admin
                ),
                f"GET /workloads (100 of {total})": lambda http, i: http.get(
                    f"{hub.controller_api}/workloads", headers=admin
                ),
                f"GET /workloads?limit=1000 (of {total})": lambda http, i: http.get(
                    f"{hub.controller_api}/workloads", params={"limit": 1000}, headers=admin
                ),
                "POST /jobs (a submit)": lambda http, i: http.post(
                    f"{hub.controller_api}/jobs", json={**job, "name": f"bench-{i}"}, headers=alice
                ),
            }
            results = {}
            for name, make in operations.items():
                asyncio.run(load(args.clients, 2, make))  # warm: connections, caches
                results[name] = asyncio.run(load(args.clients, args.requests, make))
        finally:
            hub.kill_everything()
    baseline = results["hub GET /hub/api/users (baseline)"]
    base50, base99 = percentile(baseline, 50), percentile(baseline, 99)
    print(f"API latency, {args.clients} concurrent clients × {args.requests} requests each")
    print(f"{'operation':42} {'p50':>9} {'p99':>9} {'p50/base':>9} {'p99/base':>9}")
    for name, values in results.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        print(
            f"{name:42} {1000 * p50:7.1f}ms {1000 * p99:7.1f}ms "
            f"{p50 / base50:9.2f} {p99 / base99:9.2f}"
        )


if __name__ == "__main__":
    main()
