"""Faults in the trace replay: the Philly window of ``scheduler_policies.py`` (5,000 jobs,
384 GPUs, demand above supply) replayed under gpufleet's policy without faults (the
baseline, in the same run) and with every training job meeting infrastructure faults —
at Llama 3 405B's rate (419 in 54 days on 16,384 GPUs), ten and a hundred times it,
without and with one recovery spare node per zone — recovered as the controller recovers
them (detected in 60 s, the faulty node out of service for ``--repair`` seconds, two hours
by default, back in the queue at once with its place, the work since its checkpoint
redone, 60 s to restart; 3 faults per 1,024 GPUs a day).

Printed for each: faults, GPU-hours they cost, jobs the budget ended, mean JCT and its
ratio to the baseline's, the training jobs' effective training time ratio (mean and
GPU-weighted: each job's work over its first start to its end, so queueing after a
fault counts against it), and how long a restart waited for GPUs (mean / longest). Then
the same with every fifth job opportunistic, the work spares are lent to.

    .venv/bin/python bench/recovery_trace.py [--nodes 24] [--jobs 5000] [--seed 0]
        [--repair 7200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scheduler_policies import TRACE, fleet, projects

from gpufleet.scheduler.inputs import read_trace
from gpufleet.scheduler.simulator import JobRecord, SimulationOptions, simulate
from gpufleet.scheduler.simulator_faults import LLAMA3_FAULTS_PER_GPU_HOUR


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--nodes", type=int, default=24, help="nodes per zone (2 zones)")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repair",
        type=float,
        default=7200.0,
        help="seconds the faulty node is out of service once found (0: at once)",
    )
    args = parser.parse_args(argv)
    jobs = read_trace(args.trace)[: args.jobs]
    nodes = fleet(args.nodes)
    tree = projects(jobs, sum(n.gpus for n in nodes))
    base = SimulationOptions(fault_seed=args.seed, fault_repair_s=args.repair)
    print(
        f"{len(jobs)} jobs on {sum(n.gpus for n in nodes)} GPUs; faults detected in "
        f"{base.fault_detect_s:.0f} s, the node out for {base.fault_repair_s:.0f} s, "
        f"{base.fault_restart_s:.0f} s to restart, "
        f"checkpoints every {base.checkpoint_interval_s:.0f} s, budget {base.fault_budget} "
        "a day per 1,024 GPUs"
    )
    header = (
        f"{'faults':>22} {'count':>6} {'GPU-h lost':>10} {'ended':>6} {'mean JCT':>9} "
        f"{'JCT ratio':>9} {'ETTR':>7} {'ETTR/GPU':>8} {'restart wait':>14} {'replay':>7}"
    )
    llama3 = LLAMA3_FAULTS_PER_GPU_HOUR
    opportunistic = [
        replace(job, priority="opportunistic") if i % 5 == 0 else job for i, job in enumerate(jobs)
    ]
    for title, trace, rows in (
        (
            "every job standard",
            jobs,
            (
                ("none (baseline)", 0.0, 0),
                ("Llama 3's rate", llama3, 0),
                ("10 × Llama 3's rate", 10 * llama3, 0),
                ("100 × Llama 3's rate", 100 * llama3, 0),
                ("10 ×, 1 spare/zone", 10 * llama3, 1),
                ("100 ×, 1 spare/zone", 100 * llama3, 1),
            ),
        ),
        (
            "every fifth job opportunistic (preemptible: the spares' borrowers)",
            opportunistic,
            (
                ("none (baseline)", 0.0, 0),
                ("100 × Llama 3's rate", 100 * llama3, 0),
                ("100 ×, 1 spare/zone", 100 * llama3, 1),
            ),
        ),
    ):
        print(f"\n{title}\n{header}")
        baseline_jct = None
        for label, rate, spares in rows:
            started = time.perf_counter()
            options = replace(base, fault_rate_per_gpu_hour=rate, spare_nodes_per_zone=spares)
            result = simulate(trace, nodes, tree, "gpufleet", options)
            took = time.perf_counter() - started
            s = result.summary
            ended = sum(1 for r in result.records if (r.waiting_reason or "").startswith("failed"))
            baseline_jct = baseline_jct or s.mean_jct_s
            ratio = s.mean_jct_s / baseline_jct if s.mean_jct_s and baseline_jct else None
            print(
                f"{label:>22} {s.faults:>6} {s.fault_lost_gpu_hours:>10.1f} {ended:>6} "
                f"{(s.mean_jct_s or 0) / 3600:>8.2f}h {ratio or 0:>9.3f} "
                f"{_pct(s.mean_effective_training_ratio):>7} "
                f"{_pct(s.gpu_weighted_effective_training_ratio):>8} "
                f"{_restart_waits(result.records):>14} {took:>6.1f}s"
            )


def _restart_waits(records: Sequence[JobRecord]) -> str:
    """Mean and longest wait from a faulted run's end to the next run's start, minutes."""
    waits = [
        after.start_s - before.end_s
        for record in records
        for before, after in zip(record.runs, record.runs[1:], strict=False)
        if before.faulted
    ]
    if not waits:
        return "-"
    return f"{statistics.mean(waits) / 60:.1f} / {max(waits) / 60:.0f} min"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


if __name__ == "__main__":
    main()
