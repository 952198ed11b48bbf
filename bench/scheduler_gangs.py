"""fifo vs static vs gpufleet on gang workloads: allocation against what the quotas
permit, waits within guarantee, and what preemption costs.

Workloads: the seeded synthetic traces of ``gang_traces.py`` (1,024 H100, 2 clusters × 2
zones, a bursting critical project, a capped research team, scavengers; 2 days), and
with ``--philly`` the Philly window of ``scheduler_policies.py`` (its fleet and projects).
For each workload, each policy replayed in the same run:

- allocation while waiting (``allocation_while_waiting``) against the ceiling the quota
  tree permits (``allocation_ceiling_while_waiting``) and the gap; target gap <= 0.03 for
  gpufleet; beside it the ceiling less what lend limits keep idle ("lend-aware"), and the
  ceiling with each project's waiting requests counted whole under its own limit
  ("whole") and the gap to it, and both at once ("both", the quotas' tightest bound:
  lend limits counted with waiting requests whole) and the gap to it;
- evicted GPUs beyond need, preemptors that evicted more than twice their need,
  preemptions while the preemptor's gang already fitted, the most preemptions of one
  job, lost GPU-hours, and the replay's wall time;
- gpufleet's idle GPUs while work waits, by why (``idle_while_waiting_by_cause``,
  docs/simulator.md): ``scheduler`` is its own shortfall, the rest the rules' and the
  quotas' (held zones, lend limits, caps, gang shapes that fit no free block);
- an audit of the eviction searches that are budget-bound (more candidates in a zone than
  ``eviction.EXACT_LIMIT``; smaller ones are exhaustive): each is searched again with
  ``AUDIT_BUDGET`` steps instead of 64, and the line says how often that found a set
  evicting fewer GPUs (and how many fewer) or as few losing less work — the replay keeps
  the controller's answer;
- per project: waits of the jobs that asked within their guarantee (p99 / max; target
  max <= 330 s = minimum run time 300 s + job grace 30 s), leaving out those that other
  projects' within-guarantee work blocked (``simulator_report.within_guarantee_waits``),
  counted apart with their longest wait; and the mean JCT;
- with ``--relax``, what the rules the ceiling does not count cost: gpufleet replayed
  again with each relaxed — no lend limits, every GPU type's nodes in one zone (gangs
  place anywhere), no held zones (a gang waits for room to come free by itself) — and
  with all three, each against its own ceiling. The scheduler's own shortfall is what is
  left with all three relaxed.

    .venv/bin/python bench/scheduler_gangs.py                  # 3 seeds, 2 days each
    .venv/bin/python bench/scheduler_gangs.py --hours 6        # quick: 6 h of submissions
    .venv/bin/python bench/scheduler_gangs.py --seeds 1 2 --philly
    .venv/bin/python bench/scheduler_gangs.py --seeds 1 --relax
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from gang_traces import gang_fleet, gang_projects, gang_trace, offered_load
from scheduler_policies import TRACE
from scheduler_policies import fleet as philly_fleet
from scheduler_policies import projects as philly_projects

from gpufleet.scheduler import eviction, holds, preemption
from gpufleet.scheduler.inputs import TraceJob, read_trace
from gpufleet.scheduler.model import FleetNode, ProjectTree
from gpufleet.scheduler.simulator import PRIORITY_RANKS, SimulationOptions, simulate
from gpufleet.scheduler.simulator_report import (
    GuaranteedWait,
    SimulationResult,
    Summary,
    percentile,
    within_guarantee_waits,
)
from gpufleet.scheduler.snapshot import Running

POLICIES = ("fifo", "static", "gpufleet")


# Steps of the audit's deeper eviction search (the controller's: eviction.IMPROVE_BUDGET).
AUDIT_BUDGET = 20_000


class EvictionAudit:
    """Within ``with``: every budget-bound eviction search of the planner is run again
    with ``AUDIT_BUDGET`` steps and compared; the planner keeps its own answer."""

    def __init__(self) -> None:
        self.searches = 0
        self.fewer_gpus = 0
        self.gpus_saved = 0
        self.less_lost_work = 0
        self.seconds = 0.0  # spent in the deeper searches

    def __enter__(self) -> EvictionAudit:
        self._searched = preemption.cheapest_victims
        preemption.cheapest_victims = self._search  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        preemption.cheapest_victims = self._searched

    def _search(self, candidates: Sequence[Running], *args: Any, **kwargs: Any) -> Any:
        found = eviction.cheapest_victims(candidates, *args, **kwargs)
        if found is None or len(candidates) <= eviction.EXACT_LIMIT:
            return found
        self.searches += 1
        started = time.perf_counter()
        deeper = eviction.cheapest_victims(
            candidates, *args, **{**kwargs, "improve_budget": AUDIT_BUDGET}
        )
        self.seconds += time.perf_counter() - started
        assert deeper is not None  # the same candidates make room
        if deeper[0][0] < found[0][0]:
            self.fewer_gpus += 1
            self.gpus_saved += found[0][0] - deeper[0][0]
        elif deeper[0] < found[0]:
            self.less_lost_work += 1
        return found

    def __str__(self) -> str:
        return (
            f"eviction audit: {self.searches} budget-bound searches; {AUDIT_BUDGET:,} steps "
            f"found fewer GPUs in {self.fewer_gpus} ({self.gpus_saved} GPUs fewer), "
            f"as few losing less work in {self.less_lost_work}"
        )


def run_workload(
    title: str,
    jobs: Sequence[TraceJob],
    nodes: Sequence[FleetNode],
    tree: ProjectTree,
    options: SimulationOptions,
) -> None:
    kinds = Counter(j.kind for j in jobs)
    gpus = sum(n.gpus for n in nodes)
    print(
        f"== {title}: {len(jobs)} jobs ({kinds['session']} sessions, {kinds['job']} jobs) "
        f"on {gpus} GPUs"
    )
    print(
        f"{'policy':<9} {'alloc':>6} {'ceiling':>7} {'gap':>6} {'lend-aware':>10} "
        f"{'whole':>6} {'gap':>6} {'both':>6} {'gap':>6} {'beyond need':>11} "
        f"{'preemptors':>10} {'>2x need':>8} {'fitted':>6} {'max/job':>7} {'lost GPU-h':>10} "
        f"{'replay s':>8}"
    )
    results: dict[str, SimulationResult] = {}
    audit = EvictionAudit()
    for policy in POLICIES:
        started = time.perf_counter()
        if policy == "gpufleet":
            with audit:
                result = simulate(jobs, nodes, tree, policy, options)
            elapsed = time.perf_counter() - started - audit.seconds  # the replay's own
        else:
            result = simulate(jobs, nodes, tree, policy, options)
            elapsed = time.perf_counter() - started
        results[policy] = result
        s = result.summary
        whole = s.allocation_ceiling_whole_requests_while_waiting
        both = s.allocation_ceiling_whole_within_lend_limits_while_waiting
        gap, whole_gap, both_gap = (
            _gap(s.allocation_while_waiting, figure)
            for figure in (s.allocation_ceiling_while_waiting, whole, both)
        )
        print(
            f"{policy:<9} {_f(s.allocation_while_waiting):>6} "
            f"{_f(s.allocation_ceiling_while_waiting):>7} {_f(gap):>6} "
            f"{_f(s.allocation_ceiling_within_lend_limits_while_waiting):>10} "
            f"{_f(whole):>6} {_f(whole_gap):>6} {_f(both):>6} {_f(both_gap):>6} "
            f"{s.evicted_beyond_need_gpus:>11} {s.preemptors:>10} "
            f"{s.preemptors_over_twice_need:>8} {s.preempted_while_fitting:>6} "
            f"{s.max_preemptions_per_job:>7} {s.lost_gpu_hours:>10.1f} {elapsed:>8.1f}"
        )
    print(audit)
    print(f"gpufleet idle while waiting, by why: {_idle_split(results['gpufleet'].summary)}")
    bound = options.min_run_time_s + options.job_checkpoint_grace_s
    groups = sorted({r.project for r in results["fifo"].records} | set(tree.projects))
    groups = [g for g in groups if not tree.children(g) or g not in tree.projects]
    print(
        f"within-guarantee waits, s: p99 / max of the unblocked [blocked: count, max] "
        f"(target max <= {bound:.0f})"
    )
    print(f"{'policy':<9} " + " ".join(f"{g:>24}" for g in groups))
    for policy, result in results.items():
        by_project: dict[str, list[GuaranteedWait]] = defaultdict(list)
        for wait in within_guarantee_waits(result, tree, nodes, PRIORITY_RANKS):
            by_project[wait.project].append(wait)
        print(f"{policy:<9} " + " ".join(f"{_waits(by_project.get(g, [])):>24}" for g in groups))
    print("mean JCT, h")
    print(f"{'policy':<9} " + " ".join(f"{g:>10}" for g in groups))
    for policy, result in results.items():
        jct = result.summary.mean_jct_by_project
        print(f"{policy:<9} " + " ".join(f"{_h(jct.get(g)):>10}" for g in groups))
    print()


def _gap(achieved: float | None, bound: float | None) -> float | None:
    return None if achieved is None or bound is None else bound - achieved


def _idle_split(summary: Summary, at_least: float = 0.0) -> str:
    """The idle-while-waiting shares by cause, those of at least ``at_least``."""
    shares = sorted(summary.idle_while_waiting_by_cause.items())
    return ", ".join(f"{cause} {share:.3f}" for cause, share in shares if share >= at_least)


def _without_lend_limits(tree: ProjectTree) -> ProjectTree:
    return ProjectTree(
        {
            name: dataclasses.replace(
                project,
                quotas={
                    t: dataclasses.replace(quota, lend_limit=None)
                    for t, quota in project.quotas.items()
                },
            )
            for name, project in tree.projects.items()
        }
    )


def _one_zone(nodes: Sequence[FleetNode]) -> list[FleetNode]:
    return [dataclasses.replace(n, cluster="all", zone="all") for n in nodes]


@contextlib.contextmanager
def _no_held_zones() -> Iterator[None]:
    """Within ``with``: the planner holds no zone for a request that found no room."""
    zone_to_hold = holds.HeldZones._zone_to_hold
    holds.HeldZones._zone_to_hold = lambda *_: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        holds.HeldZones._zone_to_hold = zone_to_hold  # type: ignore[method-assign]


RELAXED = ("lend limits", "zones", "held zones")


def relax_rules(
    jobs: Sequence[TraceJob],
    nodes: Sequence[FleetNode],
    tree: ProjectTree,
    options: SimulationOptions,
) -> None:
    """gpufleet with each rule the ceiling does not count relaxed, then all three."""
    print("gpufleet with the rules the ceiling does not count relaxed")
    print(
        f"{'relaxed':<36} {'alloc':>6} {'ceiling':>7} {'gap':>6} {'whole':>6} {'gap':>6}  "
        "idle while waiting, by why"
    )
    for relaxed in [(), *((rule,) for rule in RELAXED), RELAXED]:
        held = _no_held_zones() if "held zones" in relaxed else contextlib.nullcontext()
        with held:
            result = simulate(
                jobs,
                _one_zone(nodes) if "zones" in relaxed else nodes,
                _without_lend_limits(tree) if "lend limits" in relaxed else tree,
                "gpufleet",
                options,
            )
        s = result.summary
        alloc = s.allocation_while_waiting
        ceiling, whole = (
            s.allocation_ceiling_while_waiting,
            s.allocation_ceiling_whole_requests_while_waiting,
        )
        gap, whole_gap = (_gap(alloc, figure) for figure in (ceiling, whole))
        idle = _idle_split(s, at_least=0.0005)
        name = " + ".join(relaxed) if relaxed else "none (as configured)"
        print(
            f"{name:<36} {_f(alloc):>6} {_f(ceiling):>7} {_f(gap):>6} {_f(whole):>6} "
            f"{_f(whole_gap):>6}  {idle}"
        )
    print()


def _waits(waits: Sequence[GuaranteedWait]) -> str:
    if not waits:
        return "-"
    free = sorted(w.wait_s for w in waits if not w.blocked)
    blocked = [w.wait_s for w in waits if w.blocked]
    p99 = percentile(free, 0.99)
    head = "-" if p99 is None else f"{p99:.0f}/{free[-1]:.0f}"
    return f"{head} [{len(blocked)}, {max(blocked, default=0):.0f}]"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _h(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument(
        "--hours",
        type=float,
        help="submission window in hours (default: 48 for the synthetic traces, all of Philly)",
    )
    parser.add_argument("--philly", action="store_true", help="also the Philly window")
    parser.add_argument("--philly-nodes", type=int, default=24, help="nodes per zone (2 zones)")
    parser.add_argument(
        "--relax",
        action="store_true",
        help="also replay gpufleet with lend limits, zones and held zones relaxed",
    )
    args = parser.parse_args(argv)
    options = SimulationOptions()
    nodes, tree = gang_fleet(), gang_projects()
    hours = 48.0 if args.hours is None else args.hours
    for seed in args.seeds:
        jobs = gang_trace(seed, hours)
        title = f"seed {seed}, {hours:g} h, offered load {offered_load(jobs, hours):.2f}"
        run_workload(title, jobs, nodes, tree, options)
        if args.relax:
            relax_rules(jobs, nodes, tree, options)
    if args.philly:
        jobs = read_trace(TRACE)
        title = "Philly window"
        if args.hours is not None:
            first = min(j.submit_s for j in jobs)
            jobs = [j for j in jobs if j.submit_s < first + args.hours * 3600]
            title += f", first {args.hours:g} h"
        nodes = philly_fleet(args.philly_nodes)
        tree = philly_projects(jobs, sum(n.gpus for n in nodes))
        run_workload(title, jobs, nodes, tree, options)
        if args.relax:
            relax_rules(jobs, nodes, tree, options)


if __name__ == "__main__":
    main()
