"""gpufleet vs fifo vs static on the Philly window, and the replay's admission rate.

The 5,000-job Philly window (``../shared/traces``, 9 virtual clusters, ~47,000 GPU-hours
over 3.1 days) replayed by ``gpufleet simulate``'s engine on a fleet sized so demand
exceeds supply: 2 zones of 24 nodes × 8 GPUs = 384 GPUs against ~630 GPUs of average
demand. Each virtual cluster is a project guaranteed its share of 80% of the fleet, in
proportion to its GPU-hours in the trace (at least 8 GPUs); the rest is unguaranteed.

Printed, for each policy in the same run:
- GPU-hours allocated over GPU-hours available while work was waiting (target >= 95%),
- wait p50/p95 overall and p95 per project, mean JCT, preemptions, lost GPU-hours,
- for jobs that asked within their project's guarantee (the project's allocation plus
  the job at submission <= the guarantee): the longest wait, against the bound of the
  minimum run time plus the victims' stop time,
- replay wall time and admissions per second (baseline: fifo, which never preempts).

    .venv/bin/python bench/scheduler_policies.py [--trace PATH] [--nodes 24] [--jobs 5000]
"""

from __future__ import annotations

import argparse
import bisect
import time
from collections import defaultdict
from pathlib import Path

from gpufleet.scheduler.inputs import TraceJob, read_trace
from gpufleet.scheduler.model import FleetNode, ProjectTree, project_tree
from gpufleet.scheduler.simulator import SimulationOptions, simulate
from gpufleet.scheduler.simulator_report import SimulationResult

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly-2017-10-02-5k.csv"
GPU_TYPE = "V100"


def fleet(nodes_per_zone: int) -> list[FleetNode]:
    return [
        FleetNode(f"{zone}-{i}", "philly", zone, GPU_TYPE, 8)
        for zone in ("zone-a", "zone-b")
        for i in range(nodes_per_zone)
    ]


def projects(jobs: list[TraceJob], capacity: int) -> ProjectTree:
    demand: dict[str, float] = defaultdict(float)
    for job in jobs:
        demand[job.group] += job.num_gpus * job.duration_s
    total = sum(demand.values())
    return project_tree(
        [
            {
                "name": group,
                "quotas": {GPU_TYPE: {"guaranteed": max(8, int(0.8 * capacity * gpu_s / total))}},
            }
            for group, gpu_s in sorted(demand.items())
        ]
    )


def within_guarantee_waits(result: SimulationResult, tree: ProjectTree) -> list[float]:
    """Waits of the jobs whose project held less than its guarantee minus the job's size
    when they were submitted."""
    waits = []
    for record in result.records:
        if record.start_s is None:
            continue
        series = result.allocation.get(record.project, ())
        times = [t for t, _ in series]
        i = bisect.bisect_right(times, record.submit_s) - 1
        held = series[i][1] if i >= 0 else 0
        quota = tree.projects[record.project].quotas.get(GPU_TYPE)
        if quota is not None and held + record.num_gpus <= quota.guaranteed:
            waits.append(record.start_s - record.submit_s)
    return waits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--nodes", type=int, default=24, help="nodes per zone (2 zones)")
    parser.add_argument("--jobs", type=int, default=5000)
    args = parser.parse_args(argv)
    jobs = read_trace(args.trace)[: args.jobs]
    nodes = fleet(args.nodes)
    capacity = 8 * len(nodes)
    tree = projects(jobs, capacity)
    options = SimulationOptions()
    bound = options.min_run_time_s + max(options.session_snapshot_s, options.job_checkpoint_grace_s)
    print(
        f"{len(jobs)} Philly jobs on {capacity} GPUs ({len(nodes)} nodes × 8, 2 zones); "
        f"guarantees cover {sum(q.guaranteed for p in tree for q in p.quotas.values())} GPUs"
    )
    header = (
        f"{'policy':<9} {'alloc/avail while waiting':>26} {'wait p50 h':>10} {'wait p95 h':>10} "
        f"{'mean JCT h':>10} {'preempt':>8} {'lost GPU-h':>10} {'replay s':>9} {'adm/s':>7}"
    )
    print(header)
    results: dict[str, SimulationResult] = {}
    rates: dict[str, float] = {}
    for policy in ("fifo", "static", "gpufleet"):
        started = time.perf_counter()
        result = simulate(jobs, nodes, tree, policy, options)
        elapsed = time.perf_counter() - started
        results[policy] = result
        s = result.summary
        rates[policy] = s.admissions / elapsed
        print(
            f"{policy:<9} {_pct(s.allocation_while_waiting):>26} {_h(s.waits.p50):>10} "
            f"{_h(s.waits.p95):>10} {_h(s.mean_jct_s):>10} {s.preemptions:>8} "
            f"{s.lost_gpu_hours:>10.1f} {elapsed:>9.1f} {rates[policy]:>7.0f}"
        )
    print(f"admission rate, gpufleet over fifo: {rates['gpufleet'] / rates['fifo']:.2f}")
    print()
    print("wait p95 per project (hours)")
    groups = sorted(tree.projects)
    print(f"{'policy':<9} " + " ".join(f"{g:>8}" for g in groups))
    for policy, result in results.items():
        by = result.summary.waits_by_project
        print(f"{policy:<9} " + " ".join(f"{_h(by[g].p95) if g in by else '-':>8}" for g in groups))
    print()
    print(f"jobs asking within their project's guarantee (bound: {bound:.0f} s)")
    for policy, result in results.items():
        waits = within_guarantee_waits(result, tree)
        over = sum(1 for w in waits if w > bound)
        longest = max(waits, default=0.0)
        print(
            f"  {policy:<9} {len(waits):>5} jobs, longest wait {longest:>8.0f} s, "
            f"{over} over the bound"
        )


def _h(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    main()
