"""The dashboard on a real Prometheus (Debian's ``prometheus``): it scrapes a hub's
controller and node agent on loopback, evaluates the recording rules of docs/monitoring/,
and every panel of the dashboard answers with data while a session and a training job run
(one test per panel; the workload panels answer for both).

The rules are the shipped file with its groups evaluated every second instead of every
30 s, so the test waits seconds, not minutes, for the first recorded points."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from gpufleet.client import Client

from ..ports import free_port
from .harness import REPO, Hub, running_hub, wait_for
from .test_recovery import submit_training, training

pytestmark = pytest.mark.integration

RULES = REPO / "docs" / "monitoring" / "gpufleet-rules.yml"
DASHBOARD = REPO / "docs" / "monitoring" / "gpufleet-dashboard.json"
PANELS = json.loads(DASHBOARD.read_text())["panels"]


@dataclass(frozen=True)
class Running:
    hub: Hub
    prometheus: str  # its URL
    session: int
    job: int


def prometheus_config(hub: Hub, rules: Path) -> dict[str, Any]:
    hub_url = urlsplit(hub.url)
    agent_url = urlsplit(hub.metrics_url)
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "gpufleet-controller",
                "metrics_path": f"{hub_url.path.rstrip('/')}/services/gpufleet/metrics",
                "static_configs": [{"targets": [hub_url.netloc]}],
            },
            {
                "job_name": "gpufleet-agent",
                "metrics_path": agent_url.path,
                "static_configs": [{"targets": [agent_url.netloc]}],
            },
        ],
    }


@pytest.fixture(scope="module")
def prometheus_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    yield from running_hub(tmp_path_factory.mktemp("prometheus-hub"))


@pytest.fixture(scope="module")
def running(prometheus_hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    server = shutil.which("prometheus")
    assert server, "no prometheus server: scripts/install --test installs Debian's prometheus"
    hub = prometheus_hub
    root = tmp_path_factory.mktemp("prometheus")
    rules = root / "gpufleet-rules.yml"
    fast, groups = re.subn(r"interval: 30s", "interval: 1s", RULES.read_text())
    assert groups == len(yaml.safe_load(RULES.read_text())["groups"]), "every group, faster"
    rules.write_text(fast)
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(hub, rules)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                server,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    job = None
    try:
        wait_for(lambda: ready(url), 60, "Prometheus to be ready")
        session = hub.start_session("alice", project="vision", gpu_type="A100-80GB", gpus=1)
        with Client(hub.controller_api, hub.user_token("bob")) as client:
            job = submit_training(client, training(steps=10**9), "metrics")
            wait_for(
                lambda: (p := client.job(job).progress) and (p.last_step or 0) >= 3,
                180,
                "the job's first steps",
            )
        yield Running(hub, url, session["id"], job)
    finally:
        try:
            if job is not None:
                hub.controller("POST", f"/jobs/{job}/cancel", token=hub.user_token("bob"))
            hub.stop_all_servers()
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_prometheus_scrapes_the_controller_and_the_agent(running: Running) -> None:
    def targets() -> dict[str, str] | None:
        found = httpx.get(f"{running.prometheus}/api/v1/targets", timeout=10).json()
        health = {t["labels"]["job"]: t["health"] for t in found["data"]["activeTargets"]}
        return health if set(health.values()) == {"up"} else None

    health = wait_for(targets, 30, "both targets up")
    assert set(health) == {"gpufleet-controller", "gpufleet-agent"}


@pytest.mark.parametrize("panel", PANELS, ids=[p["title"] for p in PANELS])
def test_the_panel_shows_data(running: Running, panel: dict[str, Any]) -> None:
    workloads = {str(running.session), str(running.job)}
    for target in panel["targets"]:
        expr = target["expr"].replace("$job", "|".join(sorted(workloads)))
        per_workload = "hpc_job" in target["expr"]

        def answered(expr: str = expr, per_workload: bool = per_workload) -> Any:
            result = query(running.prometheus, expr)
            if not per_workload:
                return result
            # A workload panel shows both the session and the job.
            shown = {r["metric"].get("hpc_job") for r in result}
            return result if workloads <= shown else None

        result = wait_for(answered, 60, f"data for {expr!r}", interval=1)
        assert all(len(r["value"]) == 2 for r in result)
