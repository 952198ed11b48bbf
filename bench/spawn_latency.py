"""Spawn latency of a 1-GPU session against JupyterHub's stock local process spawner.

Both hubs run the same configuration on this machine in the same run; only the spawner
differs. Latency is measured from the spawn request to the new server answering through
the proxy (``GET /user/<name>/api`` returns 200), polled every 10 ms. Also prints the
start-up time of the hub with its proxy, the controller and the node agent (until the
controller answers with both declared nodes healthy).

    .venv/bin/python bench/spawn_latency.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' hub harness
from tests.integration.harness import Hub, wait_for

STOCK = """
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = c.LocalGPUSpawner.home_dir_template
c.Spawner.default_url = "/lab"
import os
if os.geteuid() == 0:
    c.Spawner.args = ["--allow-root"]
"""


def time_spawn(hub: Hub, username: str, server: str, options: dict[str, object]) -> float:
    token = hub.user_token(username)
    url = f"{hub.url}/user/{username}/{server}/api"
    started = time.perf_counter()
    response = hub.spawn(username, server, **options)
    assert response.status_code in (201, 202), response.text

    def answering() -> bool:
        try:
            return (
                httpx.get(url, headers={"Authorization": f"token {token}"}, timeout=5).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    wait_for(answering, 120, f"{username}/{server} answering", interval=0.01)
    elapsed = time.perf_counter() - started
    hub.stop_server(username, server)
    hub.wait_gone(username, server)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        gpufleet = Hub.create(Path(tmp) / "gpufleet")
        stock = Hub.create(Path(tmp) / "stock", extra_config=STOCK)
        try:
            began = time.perf_counter()
            gpufleet.start()
            startup = time.perf_counter() - began
            stock.start()
            ours, theirs = [], []
            for i in range(args.rounds):
                # Alternate so that a slow moment of the machine hits both alike.
                ours.append(
                    time_spawn(
                        gpufleet,
                        "alice",
                        f"b{i}",
                        {"project": "vision", "gpu_type": "A100-80GB", "gpus": 1},
                    )
                )
                theirs.append(time_spawn(stock, "alice", f"b{i}", {}))
        finally:
            gpufleet.kill_everything()
            stock.kill_everything()
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    print(f"spawn latency, 1-GPU session, {args.rounds} rounds (median, min-max)")
    print(f"  gpufleet LocalGPUSpawner : {ours_median:6.2f} s ({min(ours):.2f}-{max(ours):.2f})")
    print(
        f"  stock LocalProcessSpawner: {theirs_median:6.2f} s ({min(theirs):.2f}-{max(theirs):.2f})"
    )
    print(f"  ratio gpufleet / stock   : {ours_median / theirs_median:6.3f}  (target <= 1.10)")
    print(f"start-up: hub + proxy + controller + agent ready in {startup:.2f} s")


if __name__ == "__main__":
    main()
