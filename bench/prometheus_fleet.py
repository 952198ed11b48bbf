"""The dashboard's job panels over a day of a 2,048-GPU job, recorded against raw.

24 hours of the node agents' series for one job of 2,048 GPUs (256 nodes × 8 GPUs, one
point every 30 s), with the labels the agent really exports (its own ``families`` names
them), are written as OpenMetrics and turned into a Prometheus TSDB with
``promtool tsdb create-blocks-from openmetrics``; the job rules of
docs/monitoring/gpufleet-rules.yml are backfilled over the same day with
``promtool tsdb create-blocks-from rules`` against a real Prometheus (Debian's) serving
the raw blocks. Then, on that one server, each job panel of the dashboard (utilisation,
memory, power, network in and out) is queried over the 24 hours as Grafana asks it
(``query_range``, a point a minute) in its recorded form and in its raw form: the same
aggregation written on the per-GPU (or per-node) series. Target: every recorded panel
answers in ≤ 1 s and ≥ 20 × faster than its raw form. Both times are printed: the answer
as a client gets it (one kept connection, HTTP and JSON included: a floor of a few ms on
this machine, whatever the query) and the server's own evaluation time, whose ratio is the
work the recording saves; the target is checked on the latter.

The TSDB holds the series the job panels read (3 per GPU, 2 per node): the agent's other
fields add index entries, not work to these queries.

    .venv/bin/python bench/prometheus_fleet.py            # --nodes 256 --hours 24
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' helpers
from gpufleet.agent.metrics import Assignment, exposition, families, network_families
from gpufleet.agent.network_usage import Traffic
from gpufleet.recovery.nvml import GpuInfo, GpuSample
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "docs" / "monitoring" / "gpufleet-rules.yml"
DASHBOARD = REPO / "docs" / "monitoring" / "gpufleet-dashboard.json"
JOB = Assignment(4242, "alice", "llm-pretrain", project="nlp", marker="m4242")
INTERVAL_S = 30
GPUS_PER_NODE = 8
JOB_PANELS = ("utilisation", "memory", "power", "network in", "network out")
PANEL_OF = {  # a job panel's recorded series → which of the four it is
    "hpc_job:DCGM_FI_DEV_GPU_UTIL:avg": "utilisation",
    "hpc_job:DCGM_FI_DEV_FB_USED:sum": "memory",
    "hpc_job:DCGM_FI_DEV_POWER_USAGE:sum": "power",
    "hpc_job:gpufleet_workload_network_receive_bytes:rate2m": "network in",
    "hpc_job:gpufleet_workload_network_transmit_bytes:rate2m": "network out",
}


def series_labels(nodes: int) -> dict[str, list[str]]:
    """Each family's label sets (``{...}``), as the agents of ``nodes`` nodes write them."""
    inventory, samples, hosts = {}, [], {}
    for n in range(nodes):
        for i in range(GPUS_PER_NODE):
            uuid = f"GPU-{n:05d}{i:03d}-0000-0000-0000-000000000000"
            inventory[uuid] = GpuInfo(uuid, i, "NVIDIA H100 80GB HBM3", f"0000:{i:02X}:00.0", 0)
            samples.append(GpuSample(uuid, i, 0.0, utilization_gpu_pct=0))
            hosts[uuid] = f"gpu-node-{n:04d}"
    held = dict.fromkeys(inventory, JOB)
    text = exposition(families(samples, inventory, hosts, "550.54.15", held, {}))
    text += "".join(
        exposition(network_families({JOB.marker: Traffic()}, {"any": JOB}, f"gpu-node-{n:04d}"))
        for n in range(nodes)
    )
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{.*\}) ", line)
        if match:
            found.setdefault(match.group(1), []).append(match.group(2))
    gpus = found["DCGM_FI_DEV_GPU_UTIL"]  # every GPU series has the same labels
    return {**found, "DCGM_FI_DEV_FB_USED": gpus, "DCGM_FI_DEV_POWER_USAGE": gpus}


def write_openmetrics(path: Path, nodes: int, start: int, points: int) -> int:
    """The day's raw points, family by family and series by series (OpenMetrics's order);
    returns how many samples it wrote."""
    labels = series_labels(nodes)
    rng = random.Random(7)
    written = 0
    gauges = {
        "DCGM_FI_DEV_GPU_UTIL": lambda t, phase: max(0, min(100, 85 + 12 * math.sin(t + phase))),
        "DCGM_FI_DEV_FB_USED": lambda t, phase: 61_000 + int(4_000 * math.sin(t / 7 + phase)),
        "DCGM_FI_DEV_POWER_USAGE": lambda t, phase: 540 + 130 * math.sin(t / 3 + phase),
    }
    with path.open("w") as out:
        for name, shape in gauges.items():
            out.write(f"# TYPE {name} gauge\n")
            for series in labels[name]:
                phase = rng.random() * 6.28
                out.writelines(
                    f"{name}{series} {shape(k / 40, phase) + rng.random():.2f} "
                    f"{start + k * INTERVAL_S}\n"
                    for k in range(points)
                )
                written += points
        for name in (
            "gpufleet_workload_network_receive_bytes_total",
            "gpufleet_workload_network_transmit_bytes_total",
        ):
            out.write(f"# TYPE {name.removesuffix('_total')} counter\n")
            for series in labels[name]:
                total = 0
                lines = []
                for k in range(points):
                    total += int(12e9 * INTERVAL_S * (0.8 + 0.4 * rng.random()))
                    lines.append(f"{name}{series} {total} {start + k * INTERVAL_S}\n")
                out.writelines(lines)
                written += points
        out.write("# EOF\n")
    return written


def job_rules(path: Path) -> list[dict[str, str]]:
    """The job rules group of the shipped rules, alone (what the job panels read)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (jobs,) = [g for g in groups if g["name"] == "gpufleet-jobs"]
    path.write_text(yaml.safe_dump({"groups": [jobs]}))
    rules: list[dict[str, str]] = jobs["rules"]
    return rules


def panels(rules: list[dict[str, str]], job: str) -> list[tuple[str, str, str]]:
    """(panel, recorded query, raw query) for each target of the dashboard's job panels."""
    exprs = {r["record"]: r["expr"] for r in rules}
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            record = target["expr"].split("{", 1)[0]
            if record not in PANEL_OF:
                continue
            recorded = target["expr"].replace("$job", job)
            raw = exprs[record].replace('hpc_job!=""', f'hpc_job=~"{job}"')
            found.append((PANEL_OF[record], recorded, raw))
    assert {p for p, _, _ in found} == set(JOB_PANELS), found
    return found


class Prometheus:
    def __init__(self, data: Path, rules: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = data.parent / "prometheus.yml"
        config.write_text(yaml.safe_dump({"global": {}, "rule_files": [str(rules)]}))
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=30d",
                    "--query.timeout=10m",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        # One connection for every query, as Grafana keeps its own.
        self.client = httpx.Client(timeout=600)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise SystemExit(f"prometheus exited; see {log}")
            time.sleep(0.5)
        raise SystemExit(f"prometheus did not become ready; see {log}")

    def query_range(self, expr: str, start: int, end: int) -> tuple[float, float, int]:
        """Seconds to the answer (here, HTTP and JSON included), seconds the server says
        it spent, and the points answered."""
        began = time.perf_counter()
        answer = self.client.get(
            f"{self.url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": 60, "stats": "all"},
        ).json()
        took = time.perf_counter() - began
        assert answer["status"] == "success", answer
        server = answer["data"]["stats"]["timings"]["execTotalTime"]
        return took, server, sum(len(r["values"]) for r in answer["data"]["result"])

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=60)


def timed(server: Prometheus, expr: str, start: int, end: int, rounds: int) -> dict[str, Any]:
    cold, _, points = server.query_range(expr, start, end)
    warm = [server.query_range(expr, start, end) for _ in range(rounds)]
    return {
        "cold": cold,
        "median": statistics.median(w[0] for w in warm),
        "server": statistics.median(w[1] for w in warm),
        "points": points,
    }


def build(root: Path, nodes: int, hours: float) -> tuple[int, int]:
    """The TSDB under ``root/data``: the raw day, then the job rules backfilled over it.
    Returns the day's first and last timestamps (also kept in ``root/window.json``)."""
    points = int(hours * 3600 / INTERVAL_S)
    end = int(time.time()) // 3600 * 3600 - 3600  # whole hours, an hour back: all in blocks
    start = end - (points - 1) * INTERVAL_S
    source, raw_blocks = root / "raw.om", root / "data"
    began = time.perf_counter()
    samples = write_openmetrics(source, nodes, start, points)
    size = source.stat().st_size / 2**30
    print(f"wrote {samples:,} samples ({size:.1f} GiB) in {time.perf_counter() - began:.0f} s")
    began = time.perf_counter()
    backfill = ["promtool", "tsdb", "create-blocks-from", "openmetrics", "-q"]
    subprocess.run([*backfill, str(source), str(raw_blocks)], check=True)
    source.unlink()
    print(f"raw blocks made in {time.perf_counter() - began:.0f} s", flush=True)
    job_rules(root / "job-rules.yml")
    server = Prometheus(raw_blocks, root / "job-rules.yml", root / "prometheus.log")
    began = time.perf_counter()
    recorded = root / "recorded"
    try:
        subprocess.run(
            [
                "promtool", "tsdb", "create-blocks-from", "rules",
                f"--start={start}", f"--end={end + 1}", f"--url={server.url}",
                f"--output-dir={recorded}", "--eval-interval=30s",
                str(root / "job-rules.yml"),
            ],
            check=True,
        )  # fmt: skip
    finally:
        server.stop()
    print(f"rules backfilled in {time.perf_counter() - began:.0f} s", flush=True)
    for block in recorded.iterdir():
        shutil.move(str(block), raw_blocks / block.name)
    (root / "window.json").write_text(json.dumps({"start": start, "end": end}))
    return start, end


def measure(root: Path, start: int, end: int, rounds: int) -> list[dict[str, Any]]:
    """Each job panel's recorded and raw forms over the day, on one server."""
    rules = job_rules(root / "job-rules.yml")
    server = Prometheus(root / "data", root / "job-rules.yml", root / "prometheus.log")
    try:
        results = []
        for panel, recorded_expr, raw_expr in panels(rules, str(JOB.workload_id)):
            fast = timed(server, recorded_expr, start, end, rounds)
            slow = timed(server, raw_expr, start, end, rounds)
            # The same panel: the recorded one may lack a point at the window's first minute
            # (the rules' first evaluation comes after it).
            assert fast["points"] > 0 and abs(fast["points"] - slow["points"]) <= 2, (fast, slow)
            results.append({"panel": panel, "recorded": fast, "raw": slow, "expr": recorded_expr})
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir)")
    parser.add_argument(
        "--reuse", action="store_true", help="query the TSDB an earlier --keep run built"
    )
    args = parser.parse_args()
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            raise SystemExit(f"no {tool}: scripts/install --test installs Debian's prometheus")
    with tempfile.TemporaryDirectory(prefix="gpufleet-prom-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        if args.reuse:
            window = json.loads((root / "window.json").read_text())
            start, end = window["start"], window["end"]
        else:
            start, end = build(root, args.nodes, args.hours)
        results = measure(root, start, end, args.rounds)
    report(results, args.nodes, args.hours, args.rounds)


def report(results: list[dict[str, Any]], nodes: int, hours: float, rounds: int) -> None:
    print(
        f"\n{nodes * GPUS_PER_NODE:,} GPUs on {nodes} nodes, {hours:g} h at {INTERVAL_S} s; "
        f"query_range over the whole window, a point a minute; median of {rounds} after a "
        "first query. 'answer' is the time to the decoded answer here (HTTP and JSON "
        "included), 'server' Prometheus's own execTotalTime; the ratios are raw / recorded\n"
    )
    print(
        f"{'panel':<12} {'recorded: answer':>16} {'server':>8}   {'raw: answer':>11} "
        f"{'server':>7}   {'ratio: server':>13} {'answer':>7}  target (≤ 1 s, ≥ 20×)"
    )
    for r in results:
        fast, slow = r["recorded"], r["raw"]
        server_ratio = slow["server"] / fast["server"]
        answer_ratio = slow["median"] / fast["median"]
        met = fast["median"] <= 1.0 and server_ratio >= 20
        print(
            f"{r['panel']:<12} {fast['median']:>16.4f} {fast['server']:>8.4f}   "
            f"{slow['median']:>11.3f} {slow['server']:>7.3f}   {server_ratio:>12.0f}× "
            f"{answer_ratio:>6.0f}×  {'met' if met else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
