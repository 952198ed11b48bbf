"""Laws of the scheduling core on fleets of big gangs (hypothesis).

The worlds of ``test_plan_properties`` are small and mixed; these are what a training fleet
looks like: 1-2 clusters x 1-2 zones of 8-GPU nodes, 4-32 nodes a zone, mostly one GPU
type; a team whose borrow limit caps its projects (their guarantees sum to no more than the
team's own), lend limits on some projects, an opportunistic group without quota; sessions
of 1-8 GPUs and gangs of 16-256 GPUs (pods of 8), more asked for than the fleet holds. The
fleet starts full of work of every kind (gangs on whole nodes, nodes shared by small
workloads, idle sessions, workloads preempted before and protected for it).

``GangWorld`` is ``test_plan_properties.World`` with one addition: a preempted workload,
back in the queue and admitted again, runs with ``preemptions`` (how often it was preempted
so far) and, for a job, its ``checkpoint_interval_s``. Every plan is checked by
``test_plan_properties.check_plan`` and then by the laws here (``check_gang_laws``):

- L1 guarantee precedence through the tree (``check_guarantee_precedence``): a request
  within its project's guarantee that waits on an enclosing node's cap (cause ``quota``)
  is not passed by a borrower of that node's subtree admitted in the same plan. And
  (``test_a_guarantee_under_a_full_team_cap_is_reclaimed_within_the_bound``) such a
  request, its team's cap full of its siblings' borrowers, is admitted within the bound
  of ``test_a_guarantee_is_reclaimed_within_the_bound``;
- L2 head of line (``check_head_of_line``): a request within its guarantee never waits
  ``behind`` an earlier request of its queue that borrows;
- L3 right-sized eviction (``check_right_sized``): a preemptor's victims are a feasible set
  with the fewest GPUs, then the least lost work, checked by brute force over zones of at
  most ``BRUTE_FORCE`` eligible candidates, and against simple feasible sets (one victim,
  whole nodes) in larger zones;
- L4 no needless preemption (``check_no_needless_preemption``): nothing is preempted for a
  request whose gang fits the free GPUs of a zone it may use;
- L5 no thrashing (``check_protection``): no victim is within its protection
  (``protected_until``), which doubles with every preemption it suffered (for a job
  that checkpoints, from its third);
- L6 reservations (``check_reservations``): a zone kept for a request is backfilled only by
  work that request could evict at once; a zone is kept for one request at most;
- L7 lend limits (``check_lend_reserve``): on worlds where one project alone has a lend
  limit and holds nothing, no plan takes free GPUs its reserve keeps back.

Soundness. The core decides one request after another and the plan does not say in which
order; free GPUs only shrink and usage only grows during a cycle. Each law is therefore
asserted only where it is violated whatever the order was: free GPUs are those of the
snapshot less everything the plan gives or keeps for other workloads (fewer than the
search saw), lend-limit reserves those at the snapshot's usage (more than it saw), a
request counts as within its guarantee only if it is by the usage after the plan, as
borrowing only if it is by the usage before it, and a request counts as decided after
another only if the order (class, then within/borrowing, then arrival) says so for sure.

Every law has a literal test that feeds its checker a plan that breaks it.

More examples: GPUFLEET_HYPOTHESIS_EXAMPLES=500 pytest tests/unit/test_plan_gangs.py; shrunk
counterexamples of the fleet tests (slow): GPUFLEET_HYPOTHESIS_SHRINK=1.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpufleet.scheduler.eviction import EXACT_LIMIT
from gpufleet.scheduler.model import project_tree
from gpufleet.scheduler.plan import plan
from gpufleet.scheduler.quota import QuotaBook
from gpufleet.scheduler.snapshot import (
    Admission,
    Kept,
    Mode,
    Pending,
    Plan,
    Pod,
    Policy,
    Preemption,
    PreemptionCause,
    Running,
    SchedulingSnapshot,
    WaitCause,
    Waiting,
)

from .test_eviction import feasible_below
from .test_plan_properties import (
    CLASSES,
    MAX_STEP,
    PREEMPTIBLE,
    RANKS,
    START,
    TYPES,
    Arrival,
    Cycle,
    Scenario,
    Tree,
    World,
    _node,
    _running,
    cap_kept_for_a_guarantee,
    check_plan,
    fits,
    reclaim_within_the_bound,
    sometimes,
    within_guarantee,
)

H100, A100 = TYPES
# The most eligible candidates in a zone for which the law demands the optimum: where the
# core's own search is exhaustive (docs/scheduler.md, "Right-sized eviction").
BRUTE_FORCE = EXACT_LIMIT
KEEPER = "keeper"  # L7 worlds: the one project with a lend limit; it never asks for GPUs


def checkpoint_interval(workload_id: int) -> float:
    """A job's checkpoint interval in the world: 600-1800 s, fixed per workload."""
    return 600.0 + (workload_id * 397) % 1201


def protected_until(workload: Running, min_run_time_s: float) -> float:
    """Until when a workload may not be a victim (idle sessions aside): the minimum run time
    for one never preempted; after ``n`` preemptions, ``max(min_run, checkpoint interval)
    x 2^max(0, n-2)`` for a job that checkpoints, else ``min_run x 2^n`` (exponent at most
    10)."""
    n = workload.preemptions
    if n <= 0:
        return workload.started_at + min_run_time_s
    if workload.checkpoint_interval_s is not None:
        base = max(min_run_time_s, workload.checkpoint_interval_s)
        return workload.started_at + base * 2 ** max(0, min(n, 10) - 2)
    return workload.started_at + min_run_time_s * 2 ** min(n, 10)


def lost_work(workload: Running, now: float) -> float:
    """GPU-seconds a stop loses: since the last checkpoint or snapshot; none for an idle
    session (it is snapshotted and comes back whole)."""
    if workload.idle_reclaimable:
        return 0.0
    since = max(workload.started_at, workload.last_progress_at or workload.started_at)
    return workload.gpus * (now - since)


def queue_order(request: Pending) -> tuple[int, float, int]:
    return (-RANKS.get(request.priority, 0), request.created_at, request.id)


_KEPT_FOR = re.compile(r"(\S+) is kept for you")


# ------------------------------------------------------------------------- the facts


class Facts:
    """What the laws read off one snapshot and its plan, computed once."""

    def __init__(self, snapshot: SchedulingSnapshot, result: Plan, tree: Tree, now: float) -> None:
        self.snapshot, self.result, self.tree, self.now = snapshot, result, tree, now
        self.min_run = snapshot.policy.min_run_time_s
        self.queue = {p.id: p for p in snapshot.queue}
        self.running = {r.id: r for r in snapshot.running}
        self.nodes = {n.name: n for n in snapshot.nodes}
        self.waits: dict[int, Waiting] = {w.workload_id: w for w in result.waiting}
        self.inside = within_guarantee(snapshot, tree)
        self.book = QuotaBook(
            snapshot.projects,
            ((r.project, r.gpu_type, r.gpus) for r in snapshot.running),
            {
                t: sum(n.total for n in snapshot.nodes if n.schedulable and n.gpu_type == t)
                for t in TYPES
            },
        )
        # Usage per tree node and type: before the plan (stopping workloads count, they
        # hold their GPUs), and with everything the plan admits or keeps.
        self.before: dict[tuple[str, str], int] = defaultdict(int)
        for r in snapshot.running:
            for name in tree.path(r.project):
                self.before[(name, r.gpu_type)] += r.gpus
        self.claimed = defaultdict(int, self.before)
        self.kept_gpus: dict[int, int] = {}
        for wid in [a.workload_id for a in result.admissions] + [
            k.workload_id for k in result.kept
        ]:
            request = self.queue[wid]
            for name in tree.path(request.project):
                self.claimed[(name, request.gpu_type)] += request.gpus
        for k in result.kept:
            self.kept_gpus[k.workload_id] = self.queue[k.workload_id].gpus
        # Kept projects' usage (for bounds on a project's usage at any point of the plan).
        self.kept_by_project: dict[tuple[str, str], int] = defaultdict(int)
        for k in result.kept:
            request = self.queue[k.workload_id]
            self.kept_by_project[(request.project, request.gpu_type)] += request.gpus
        # Free GPUs of the snapshot that the plan gives to (admissions) or keeps for
        # (preemptors) each workload; GPUs of victims a placement keeps are not free.
        self.victims_of: dict[int, list[Running]] = defaultdict(list)
        self.victim_of: dict[int, int] = {}
        for p in result.preemptions:
            self.victims_of[p.for_workload_id].append(self.running[p.victim_id])
            self.victim_of[p.victim_id] = p.for_workload_id
        free_gpus = {g for n in snapshot.nodes for g in n.free}
        self.taken: dict[int, Counter[str]] = defaultdict(Counter)
        placements = [(a.workload_id, a.pods) for a in result.admissions]
        placements += [(k.workload_id, k.pods) for k in result.kept]
        self.taken_all: dict[int, int] = defaultdict(int)  # every GPU, free or a victim's
        for wid, pods in placements:
            for pod in pods:
                self.taken_all[wid] += len(pod.gpus)
                self.taken[wid][pod.node] += sum(1 for g in pod.gpus if g in free_gpus)
        # Requests that hold a promise from an earlier plan, or have victims stopping for
        # them: earlier decisions, which the laws about this plan's choices leave alone.
        self.promised = {p.id for p in snapshot.queue if p.promised}
        self.promised |= {r.stopping_for for r in snapshot.running if r.stopping_for is not None}
        # Zones kept: (GPU type, zone name) -> the requests it is kept for.
        self.holds: dict[tuple[str, str], list[int]] = defaultdict(list)
        for w in result.waiting:
            if w.cause is WaitCause.RESERVED:
                found = _KEPT_FOR.search(w.reason)
                assert found is not None, f"{w.workload_id} reserved, no zone named: {w.reason}"
                self.holds[(self.queue[w.workload_id].gpu_type, found.group(1))].append(
                    w.workload_id
                )

    # ------------------------------------------------------------------ helpers
    def rank(self, priority: str) -> int:
        return RANKS.get(priority, 0)

    def guarantee(self, project: str, gpu_type: str) -> int:
        return self.tree.guarantee(project, gpu_type)

    def surely_within(self, request: Pending, exclude_own: bool = False) -> bool:
        """Within its project's guarantee whenever it was decided: by the usage after the
        plan (less its own kept placement)."""
        key = (request.project, request.gpu_type)
        used = self.claimed[key] - (self.kept_gpus.get(request.id, 0) if exclude_own else 0)
        return used + request.gpus <= self.guarantee(*key)

    def surely_borrowing(self, request: Pending) -> bool:
        """Beyond its project's guarantee whenever it was decided: by the usage before."""
        key = (request.project, request.gpu_type)
        return self.before[key] + request.gpus > self.guarantee(*key)

    def within_caps(self, request: Pending) -> bool:
        """No cap on the request's path stopped it whenever it was decided. A request
        within its guarantee that an enclosing cap refused, and that waits for it, may
        have kept the rest under that cap for itself (``_claim_caps``)."""
        own = self.kept_gpus.get(request.id, 0)
        causes = {w.workload_id: w.cause for w in self.result.waiting}
        return all(
            self.claimed[(name, request.gpu_type)] - own + request.gpus
            <= self.tree.cap(name, request.gpu_type)
            and not cap_kept_for_a_guarantee(
                name, request, self.snapshot.queue, causes, self.tree, self.before
            )
            for name in self.tree.path(request.project)
        )

    def free_for(self, wid: int) -> dict[str, int]:
        """Free GPUs per node that the plan does not give or keep for another workload."""
        free = {name: len(n.free) if n.schedulable else 0 for name, n in self.nodes.items()}
        for other, taken in self.taken.items():
            if other != wid:
                for node, gpus in taken.items():
                    free[node] -= gpus
        return free

    def zones(self, gpu_type: str) -> list[tuple[str, str]]:
        return sorted(
            {
                (n.cluster, n.zone)
                for n in self.snapshot.nodes
                if n.schedulable and n.gpu_type == gpu_type
            }
        )

    def zone_nodes(self, cluster: str, zone: str, gpu_type: str) -> set[str]:
        return {
            n.name
            for n in self.snapshot.nodes
            if n.schedulable and (n.cluster, n.zone, n.gpu_type) == (cluster, zone, gpu_type)
        }

    def held_by_others(self, request: Pending) -> set[str]:
        return {
            zone
            for (t, zone), holders in self.holds.items()
            if t == request.gpu_type and any(h != request.id for h in holders)
        }

    def type_free(self, free: Mapping[str, int], gpu_type: str) -> int:
        return sum(
            free[n.name] for n in self.snapshot.nodes if n.schedulable and n.gpu_type == gpu_type
        )

    def eligible(self, request: Pending, within: bool) -> list[Running]:
        """Who may be a victim for the request by the rules (L3, L5), leaving out victims
        of other preemptors of the plan."""
        rank = self.rank(request.priority)
        chosen = {v for v, w in self.victim_of.items() if w != request.id}
        out = []
        for r in self.snapshot.running:
            if r.gpu_type != request.gpu_type or r.stopping or r.id in chosen:
                continue
            if r.idle_reclaimable:
                out.append(r)
                continue
            if self.now < protected_until(r, self.min_run):
                continue
            lower = r.preemptible and self.rank(r.priority) < rank
            if r.project == request.project:
                if lower:
                    out.append(r)
            elif r.id not in self.inside and (within or lower):
                out.append(r)
        return out


def cost(victims: Iterable[Running], now: float) -> tuple[int, float]:
    victims = list(victims)
    return sum(v.gpus for v in victims), round(sum(lost_work(v, now) for v in victims), 6)


def _describe(victims: Iterable[Running]) -> str:
    return ", ".join(f"{v.id}({v.project} {v.priority} {v.gpus} GPUs)" for v in victims)


# ------------------------------------------------------------------------- the laws


def check_guarantee_precedence(f: Facts) -> None:
    """L1: a request within its guarantee waits on an enclosing cap; no borrower of that
    subtree is admitted in the same plan."""
    for w in f.result.waiting:
        if w.cause is not WaitCause.QUOTA:
            continue
        request = f.queue[w.workload_id]
        t = request.gpu_type
        if not f.surely_within(request):
            continue
        for name in f.tree.path(request.project)[1:]:
            cap = f.tree.cap(name, t)
            if cap == math.inf or f.before[(name, t)] + request.gpus <= cap:
                continue  # not surely the cap that refused it
            usage: dict[str, int] = defaultdict(int)
            for r in f.snapshot.running:
                if r.gpu_type == t:
                    usage[r.project] += r.gpus
            for a in f.result.admissions:
                other = f.queue[a.workload_id]
                if other.gpu_type != t:
                    continue
                beyond = usage[other.project] + other.gpus > f.guarantee(other.project, t)
                usage[other.project] += other.gpus
                if beyond and other.id not in f.promised and name in f.tree.path(other.project):
                    raise AssertionError(
                        f"L1: {request.id} of {request.project} ({request.gpus} GPUs, within "
                        f"its guarantee) waits on {name}'s cap {cap}, yet borrower "
                        f"{other.id} of {other.project} ({other.gpus} GPUs) was admitted "
                        f"under it: {w.reason}"
                    )


def check_head_of_line(f: Facts) -> None:
    """L2: a request within its guarantee does not wait behind a borrower of its queue
    refused by quota."""
    by_queue: dict[tuple[str, str], list[Pending]] = defaultdict(list)
    for p in f.snapshot.queue:
        by_queue[(p.project, p.gpu_type)].append(p)
    for w in f.result.waiting:
        if w.cause is not WaitCause.BEHIND:
            continue
        request = f.queue[w.workload_id]
        if not f.surely_within(request):
            continue
        earlier = [
            p
            for p in by_queue[(request.project, request.gpu_type)]
            if queue_order(p) < queue_order(request) and p.id in f.waits
        ]
        if any(
            f.waits[p.id].cause is WaitCause.USER_CAP and p.user == request.user for p in earlier
        ):
            continue
        heads = [p for p in earlier if f.waits[p.id].cause is WaitCause.QUOTA]
        if heads and all(f.surely_borrowing(p) for p in heads):
            raise AssertionError(
                f"L2: {request.id} of {request.project} ({request.gpus} GPUs, within its "
                f"guarantee) waits behind borrower(s) {[p.id for p in heads]} refused by "
                f"quota: {w.reason}"
            )


def _witnesses(
    f: Facts, free: Mapping[str, int], names: set[str], candidates: Sequence[Running]
) -> Iterable[list[Running]]:
    """Simple victim sets in a zone too large to search: each candidate alone, and whole
    nodes (all of whose busy GPUs are candidates'), cheapest first, added up."""
    for c in candidates:
        yield [c]
    on_node: dict[str, list[Running]] = defaultdict(list)
    held: Counter[str] = Counter()
    for c in candidates:
        for pod in c.pods:
            if pod.node in names:
                on_node[pod.node].append(c)
                held[pod.node] += len(pod.gpus)
    clearable = [n for n in on_node if free[n] + held[n] == f.nodes[n].total]
    clearable.sort(key=lambda n: (sum(c.gpus for c in set(on_node[n])), n))
    chosen: dict[int, Running] = {}
    for n in clearable:
        for c in on_node[n]:
            chosen[c.id] = c
        yield list(chosen.values())


# Feasibility checks the search for a set of half the chosen GPUs may make per zone.
HALF_BUDGET = 4_000


def check_right_sized(f: Facts) -> None:
    """L3: a preemptor's victims are a feasible set with the fewest GPUs, then the least
    lost work, among all it could have chosen in any zone it may use."""
    for wid, victims in f.victims_of.items():
        request = f.queue[wid]
        if not f.within_caps(request) or request.node_selector:
            continue  # freeing quota is another search; not checked here
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        within = f.surely_within(request, exclude_own=True)
        free = f.free_for(wid)
        withheld = f.book.withheld_from(request.project, t)
        type_free = f.type_free(free, t)
        chosen = cost(victims, f.now)
        eligible = f.eligible(request, within)
        held = f.held_by_others(request)

        def feasible(
            subset: Sequence[Running],
            names: set[str],
            free: Mapping[str, int] = free,
            type_free: int = type_free,
            withheld: int = withheld,
            request: Pending = request,
        ) -> bool:
            return (
                fits(free, subset, names, request.gpus_per_pod) >= request.pods
                and type_free + sum(v.gpus for v in subset) - withheld >= request.gpus
            )

        for cluster, zone in f.zones(t):
            if zone in held:
                continue
            names = f.zone_nodes(cluster, zone, t)
            candidates = [c for c in eligible if (c.cluster, c.zone) == (cluster, zone)]
            need = request.gpus - sum(free[n] for n in names)
            if len(candidates) <= BRUTE_FORCE:
                best: tuple[tuple[int, float], list[Running]] | None = None
                for size in range(len(candidates) + 1):
                    for subset in itertools.combinations(candidates, size):
                        gpus = sum(v.gpus for v in subset)
                        if gpus > chosen[0] or (best is not None and gpus > best[0][0]):
                            continue
                        if feasible(subset, names):
                            c = cost(subset, f.now)
                            if best is None or c < best[0]:
                                best = (c, list(subset))
                if best is not None and best[0] < chosen:
                    raise AssertionError(
                        f"L3: {wid} ({pods} x {k} {t}) evicts {_describe(victims)}, cost "
                        f"{chosen}; {_describe(best[1])} in {zone} costs {best[0]} "
                        f"(needs {need} GPUs there)"
                    )
            else:
                half, _ = feasible_below(
                    candidates,
                    (chosen[0] + 1) // 2,
                    lambda subset, names=names: feasible(subset, names),
                    HALF_BUDGET,
                )
                if half is not None:
                    raise AssertionError(
                        f"L3: {wid} ({pods} x {k} {t}) evicts {chosen[0]} GPUs "
                        f"({_describe(victims)}), more than twice {sum(v.gpus for v in half)} "
                        f"({_describe(half)} in {zone}; needs {need} GPUs there)"
                    )
                for subset in _witnesses(f, free, names, candidates):
                    gpus = sum(v.gpus for v in subset)
                    if gpus < chosen[0] and feasible(subset, names):
                        raise AssertionError(
                            f"L3: {wid} ({pods} x {k} {t}) evicts {chosen[0]} GPUs "
                            f"({_describe(victims)}); {gpus} GPUs would do in {zone} "
                            f"({_describe(subset)}; needs {need} GPUs there)"
                        )


def check_no_needless_preemption(f: Facts) -> None:
    """L4: nothing is preempted for a request whose gang fits free GPUs it may use."""
    for wid in f.victims_of:
        request = f.queue[wid]
        if not f.within_caps(request) or request.node_selector:
            continue
        t, k = request.gpu_type, request.gpus_per_pod
        free = f.free_for(wid)
        if f.type_free(free, t) - f.book.withheld_from(request.project, t) < request.gpus:
            continue
        held = f.held_by_others(request)
        for cluster, zone in f.zones(t):
            if (
                zone not in held
                and fits(free, (), f.zone_nodes(cluster, zone, t), k) >= request.pods
            ):
                raise AssertionError(
                    f"L4: {wid} ({request.pods} x {k} {t}) preempts "
                    f"{_describe(f.victims_of[wid])} though it fits the free GPUs of {zone}"
                )


def check_protection(f: Facts) -> None:
    """L5: no victim is protected (idle sessions aside)."""
    for p in f.result.preemptions:
        victim = f.running[p.victim_id]
        if victim.idle_reclaimable:
            continue
        until = protected_until(victim, f.min_run)
        assert f.now >= until, (
            f"L5: {victim.id} (preempted {victim.preemptions} time(s) before, started "
            f"{victim.started_at}, checkpoints every {victim.checkpoint_interval_s}) is "
            f"protected until {until}, preempted at {f.now} for {p.for_workload_id}"
        )


def check_reservations(f: Facts) -> None:
    """L6: a zone kept for a request is backfilled only by work it could evict at once
    (or, when it borrows, by requests within their guarantee); kept for one at most."""
    for (t, zone), holders in f.holds.items():
        assert len(holders) == 1, f"L6: {zone} ({t}) kept for several requests: {holders}"
    usage: dict[tuple[str, str], int] = defaultdict(int)
    for r in f.snapshot.running:
        usage[(r.project, r.gpu_type)] += r.gpus
    for a in f.result.admissions:
        other = f.queue[a.workload_id]
        key = (other.project, other.gpu_type)
        lower_usage = usage[key]
        usage[key] += other.gpus
        if other.id in f.promised:
            continue
        for holder_id in f.holds.get((other.gpu_type, a.zone), ()):
            holder = f.queue[holder_id]
            if holder.id == other.id or not _surely_after(f, other, holder, lower_usage):
                continue
            g = f.guarantee(*key)
            a_within = {
                lower_usage + other.gpus <= g,
                lower_usage + f.kept_by_project[key] + other.gpus <= g,
            }
            h_within = {
                f.before[(holder.project, t)] + holder.gpus <= f.guarantee(holder.project, t),
                f.surely_within(holder),
            }
            lower = PREEMPTIBLE.get(other.priority, False) and f.rank(other.priority) < f.rank(
                holder.priority
            )
            if not any(
                _backfill_allowed(other.project == holder.project, aw, hw, lower)
                for aw in a_within
                for hw in h_within
            ):
                raise AssertionError(
                    f"L6: {zone} is kept for {holder.id} ({holder.project} {holder.priority}, "
                    f"{holder.pods} x {holder.gpus_per_pod}), yet {other.id} ({other.project} "
                    f"{other.priority}, {other.gpus} GPUs) was admitted there, which it "
                    "could not evict"
                )


def _backfill_allowed(same_project: bool, a_within: bool, h_within: bool, lower: bool) -> bool:
    if a_within and not h_within:
        return True
    if same_project:
        return lower
    return not a_within and (h_within or lower)


def _surely_after(f: Facts, other: Pending, holder: Pending, other_usage: int) -> bool:
    """Whether ``other`` was decided after ``holder`` whatever happened in the plan: later
    in the same queue, or later in the global order (within before borrowing by class,
    then arrival; borrowers by class, then fair share, which only ties here)."""
    if (other.project, other.gpu_type) == (holder.project, holder.gpu_type):
        return queue_order(other) > queue_order(holder)
    other_class = 0 if other_usage + other.gpus <= f.guarantee(other.project, other.gpu_type) else 1
    holder_class = 0 if f.surely_within(holder) else 1
    a = (other_class, -f.rank(other.priority))
    h = (holder_class, -f.rank(holder.priority))
    if a != h:
        return a > h
    return other_class == 0 and (other.created_at, other.id) > (holder.created_at, holder.id)


def check_lend_reserve(f: Facts, keeper: str) -> None:
    """L7 on a world where ``keeper`` alone has a lend limit and holds nothing: its reserve
    stays free. Counting victims' GPUs as free (they will be) and every GPU the plan
    admits or keeps as taken, a plan that takes anything leaves at least the reserve."""
    project = f.snapshot.projects.projects[keeper]
    for t, quota in project.quotas.items():
        if quota.lend_limit is None:
            continue
        assert f.before[(keeper, t)] == 0, "world bug: the keeper holds GPUs"
        reserve = max(0, quota.guaranteed - quota.lend_limit)
        taken = sum(gpus for wid, gpus in f.taken_all.items() if f.queue[wid].gpu_type == t)
        if not taken:
            continue
        free = sum(len(n.free) for n in f.snapshot.nodes if n.schedulable and n.gpu_type == t)
        coming = sum(
            r.gpus
            for r in f.snapshot.running
            if r.gpu_type == t and (r.stopping or r.id in f.victim_of)
        )
        assert free + coming - taken >= reserve, (
            f"L7: the plan takes {taken} {t}: {free} free, {coming} being freed, {keeper} "
            f"keeps {reserve} back"
        )


def check_gang_laws(f: Facts, keeper: str | None = None) -> None:
    check_guarantee_precedence(f)
    check_head_of_line(f)
    check_protection(f)
    check_no_needless_preemption(f)
    check_right_sized(f)
    check_reservations(f)
    if keeper is not None:
        check_lend_reserve(f, keeper)


# ------------------------------------------------------------------------- the world


def describe(snapshot: SchedulingSnapshot, result: Plan, now: float) -> str:
    """A compact account of a snapshot and its plan (the full reprs run to megabytes)."""
    lines = [f"now={now} min_run={snapshot.policy.min_run_time_s}"]
    zones: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for n in snapshot.nodes:
        zones[(n.cluster, n.zone, n.gpu_type)].append(
            f"{n.name}:{len(n.free)}" + ("" if n.schedulable else "x")
        )
    for key, free in sorted(zones.items()):
        lines.append(f"zone {key} free {' '.join(free)}")
    for p in snapshot.projects:
        quotas = {t: (q.guaranteed, q.borrow_limit, q.lend_limit) for t, q in p.quotas.items()}
        lines.append(f"project {p.name} parent={p.parent} quotas(g,borrow,lend)={quotas}")
    for r in snapshot.running:
        nodes = ",".join(f"{pod.node}:{len(pod.gpus)}" for pod in r.pods)
        flags = " idle" if r.idle_reclaimable else ""
        flags += f" stopping_for={r.stopping_for}" if r.stopping else ""
        lines.append(
            f"run {r.id} {r.project} {r.priority} {r.kind} {r.gpus}{r.gpu_type} {r.zone} "
            f"[{nodes}] start={r.started_at} progress={r.last_progress_at} "
            f"pre={r.preemptions} ckpt={r.checkpoint_interval_s}{flags}"
        )
    for q in snapshot.queue:
        lines.append(
            f"ask {q.id} {q.project} {q.priority} {q.pods}x{q.gpus_per_pod}{q.gpu_type} "
            f"created={q.created_at}" + (" promised" if q.promised else "")
        )
    for a in result.admissions:
        lines.append(f"admit {a.workload_id} {a.zone} {[(p.node, len(p.gpus)) for p in a.pods]}")
    for k in result.kept:
        lines.append(f"keep {k.workload_id} {[(p.node, len(p.gpus)) for p in k.pods]}")
    for p in result.preemptions:
        lines.append(f"preempt {p.victim_id} for {p.for_workload_id} ({p.cause})")
    for w in result.waiting:
        lines.append(f"wait {w.workload_id} {w.cause}: {w.reason}")
    return "\n".join(lines)


class GangWorld(World):
    """``World``, where a workload readmitted after preemptions carries their count and a
    job its checkpoint interval, with the laws here checked on every plan too."""

    def __init__(self, scenario: Scenario, keeper: str | None = None):
        super().__init__(scenario)
        self.keeper = keeper
        self.preempted: dict[int, int] = defaultdict(int)
        for workload in scenario.initial:
            self.preempted[workload.id] = workload.preemptions
        self.last: tuple[SchedulingSnapshot, Plan, float] | None = None
        if keeper is not None:  # it never asks
            self.leaves = [name for name in self.leaves if name != keeper]

    def apply(self, result: Plan, delays: Sequence[int]) -> None:
        super().apply(result, delays)
        for a in result.admissions:
            w = self.running[a.workload_id]
            self.running[w.id] = replace(
                w,
                preemptions=self.preempted[w.id],
                checkpoint_interval_s=checkpoint_interval(w.id) if w.kind == "job" else None,
            )
        for p in result.preemptions:
            self.preempted[p.victim_id] += 1

    def run_cycle(self, cycle: Cycle) -> tuple[SchedulingSnapshot, Plan]:
        self.begin(cycle)
        snapshot = self.snapshot()
        result = plan(snapshot, self.now)
        try:
            check_plan(self, snapshot, result)
            check_gang_laws(Facts(snapshot, result, self.oracle, self.now), self.keeper)
        except AssertionError as e:
            raise AssertionError(
                f"cycle {self.cycle} at now={self.now}: {e}\n{describe(snapshot, result, self.now)}"
            ) from None
        self.last = (snapshot, result, self.now)
        self.apply(result, cycle.delays)
        self.check_world()
        self.cycle += 1
        self.now += cycle.step
        return snapshot, result


# ------------------------------------------------------------------------ strategies

PROFILE = st.tuples(
    st.sampled_from(CLASSES),
    st.integers(0, 4000),  # started this long before START
    st.sampled_from((0, 0, 0, 1, 2, 3)),  # preemptions before
    st.booleans(),  # a job checkpoints
    st.sampled_from((None, 0.3, 0.9)),  # last progress, as a fraction of its run so far
)


@functools.cache
def gang_arrivals(leaves: int, types: int) -> st.SearchStrategy[Arrival]:
    gpu_type = st.sampled_from((0, 0, 0, 0, 1)) if types == 2 else st.just(0)
    session = st.builds(
        Arrival,
        kind=st.just("session"),
        project=st.integers(0, leaves - 1),
        user=st.integers(0, 2),
        gpu_type=gpu_type,
        per_pod=st.integers(1, 8),
        pods=st.just(1),
        priority=st.sampled_from(CLASSES),
    )
    gang = st.builds(  # pods of 8 (the World makes a job's pod ``per_pod`` half-nodes)
        Arrival,
        kind=st.just("job"),
        project=st.integers(0, leaves - 1),
        user=st.integers(0, 2),
        gpu_type=gpu_type,
        per_pod=st.just(2),
        pods=st.sampled_from((2, 2, 3, 4, 6, 8, 16, 32)),
        priority=st.sampled_from(CLASSES),
    )
    return session | gang


@st.composite
def gang_worlds(draw: st.DrawFn, keeper: bool = False) -> Scenario:
    types = 1 if keeper else draw(st.sampled_from((1, 1, 2)))
    zones: list[tuple[str, str, str]] = []
    for c in range(draw(st.integers(1, 2))):
        for z in range(draw(st.integers(1, 2))):
            zones.append((f"c{c}", f"c{c}z{z}", H100))
    if types == 2:
        zones.append((zones[-1][0], f"{zones[-1][0]}za", A100))
    sizes = [draw(st.integers(4, 32)) if t == H100 else draw(st.integers(1, 4)) for *_, t in zones]
    total = 8 * sum(s for s, (*_, t) in zip(sizes, zones, strict=True) if t == H100)

    # The tree: a team capping its projects, a project outside it, an opportunistic group.
    def share(most: float) -> int:
        return draw(st.integers(0, max(1, int(total * most))))

    children: list[dict[str, Any]] = []
    for name in ("ta", "tb", "tc")[: draw(st.integers(2, 3))]:
        quota: dict[str, int | None] = {"guaranteed": share(0.25)}
        if not keeper and draw(st.integers(0, 3)) == 0:
            quota["lend_limit"] = draw(st.integers(0, 16))
        if draw(st.integers(0, 3)) == 0:
            quota["borrow_limit"] = draw(st.integers(0, 64))
        children.append({"name": name, "parent": "team", "quotas": {H100: quota}})
    team_guarantee = sum(c["quotas"][H100]["guaranteed"] for c in children) + share(0.05)
    team = {
        "name": "team",
        "kind": "team",
        "quotas": {H100: {"guaranteed": team_guarantee, "borrow_limit": share(0.25)}},
    }
    x_quota: dict[str, int | None] = {"guaranteed": share(0.3)}
    if not keeper and draw(st.booleans()):
        x_quota["lend_limit"] = draw(st.integers(0, 32))
    x: dict[str, Any] = {"name": "x", "quotas": {H100: x_quota}}
    if types == 2:
        x["quotas"][A100] = {"guaranteed": draw(st.integers(0, 8))}
    specs: list[dict[str, Any]] = [
        team,
        *children,
        x,
        {"name": "opp", "default_priority": "opportunistic"},
    ]
    if keeper:
        specs.append(
            {
                "name": KEEPER,
                "quotas": {H100: {"guaranteed": share(0.3), "lend_limit": share(0.1)}},
            }
        )
    leaves = [
        s["name"] for s in specs if s.get("kind", "project") == "project" and s["name"] != KEEPER
    ]

    # The fleet, full of work.
    hosts: list[tuple[str, str, str, str, int]] = []
    initial: list[Running] = []
    wid = 1000

    def workload(
        project: str, kind: str, cluster: str, zone: str, t: str, pods: tuple[Pod, ...]
    ) -> None:
        nonlocal wid
        priority, age, preemptions, checkpoints, progress = draw(PROFILE)
        if project == "opp":
            priority = "opportunistic"
        started = START - age
        idle = kind == "session" and draw(st.integers(0, 5)) == 0
        initial.append(
            Running(
                wid,
                project,
                f"u{wid % 3}",
                kind,
                t,
                cluster,
                zone,
                pods,
                priority,
                PREEMPTIBLE[priority],
                started,
                last_progress_at=None if progress is None else started + progress * age,
                idle_reclaimable=idle,
                preemptions=preemptions,
                checkpoint_interval_s=checkpoint_interval(wid)
                if kind == "job" and checkpoints
                else None,
            )
        )
        wid += 1

    def whole(name: str) -> Pod:
        return Pod(name, tuple(f"{name}/{g}" for g in range(8)))

    for (cluster, zone, t), size in zip(zones, sizes, strict=True):
        names = [f"{zone}n{i:02d}" for i in range(size)]
        hosts.extend((name, cluster, zone, t, 8) for name in names)
        i = 0
        while i < size:
            pattern = draw(st.sampled_from(("free", "whole", "split", "gang", "gang", "gang")))
            project = draw(st.sampled_from(leaves))
            if pattern == "gang" and i + 1 < size:
                m = draw(st.integers(2, min(8, size - i)))
                workload(
                    project, "job", cluster, zone, t, tuple(whole(n) for n in names[i : i + m])
                )
                i += m
                continue
            if pattern == "whole":
                workload(project, "job", cluster, zone, t, (whole(names[i]),))
            elif pattern == "split":
                first = 0
                while first < 8 and draw(st.integers(0, 4)):
                    gpus = draw(st.integers(1, 8 - first))
                    pod = Pod(
                        names[i], tuple(f"{names[i]}/{g}" for g in range(first, first + gpus))
                    )
                    kind = draw(st.sampled_from(("session", "job")))
                    workload(draw(st.sampled_from(leaves)), kind, cluster, zone, t, (pod,))
                    first += gpus
            i += 1

    arrival = gang_arrivals(len(leaves), types)
    failures = st.just(None) if keeper else sometimes(st.integers(0, 200), 15)
    cycle = st.builds(
        Cycle,
        step=st.integers(1, 400),
        arrivals=st.lists(arrival, max_size=3).map(tuple),
        ends=sometimes(st.integers(0, 200), 4).map(lambda i: () if i is None else (i,)),
        cancels=sometimes(st.integers(0, 200), 8).map(lambda i: () if i is None else (i,)),
        idle=sometimes(st.integers(0, 200), 5).map(lambda i: () if i is None else (i,)),
        wake=sometimes(st.integers(0, 200), 8).map(lambda i: () if i is None else (i,)),
        fail=failures,
        recover=sometimes(st.integers(0, 200), 5),
        delays=st.lists(st.integers(1, 2), min_size=1, max_size=3).map(tuple),
    )
    quiet = st.builds(
        Cycle,
        step=st.integers(1, 400),
        delays=st.lists(st.integers(1, 2), min_size=1, max_size=3).map(tuple),
    )
    # Demand above supply from the start: a queue of sessions and gangs.
    queue: list[Pending] = []
    for a in draw(st.lists(arrival, min_size=2, max_size=8)):
        per_pod = 8 if a.kind == "job" else a.per_pod
        queue.append(
            Pending(
                wid,
                leaves[a.project],
                f"u{a.user}",
                a.kind,
                TYPES[a.gpu_type],
                per_pod,
                a.pods,
                a.priority,
                START - draw(st.integers(0, 600)),
            )
        )
        wid += 1
    return Scenario(
        tuple(hosts),
        tuple(specs),
        Mode.GPUFLEET,
        float(draw(st.sampled_from((0, 60, 300, 600)))),
        tuple(draw(st.lists(cycle, min_size=3, max_size=10))),
        tuple(draw(st.lists(quiet, max_size=5))),
        initial=tuple(initial),
        initial_queue=tuple(queue),
    )


@st.composite
def capped_reclaims(draw: st.DrawFn, others: bool = False) -> Scenario:
    """Project ``ta`` asks for one pod within its guarantee (workload 1); its team's cap is
    full of sibling ``tb``'s workloads (single pods, old enough, never preempted before),
    those beyond ``tb``'s guarantee borrowers. The fleet has a free node, and nodes held
    whole by ``x`` within its guarantee. With ``others``, ``tb`` and ``x`` ask for more
    and victims take one or two cycles to stop."""
    nodes = draw(st.integers(2, 6))
    hosts = [(f"z0n{i}", "c0", "z0", H100, 8) for i in range(nodes)]
    k = draw(st.integers(1, 8))
    ga = draw(st.integers(k, k + 8))
    used_a = draw(st.integers(0, ga - k))
    gb = draw(st.integers(0, 8))
    borrow = draw(st.integers(0, 8))
    cap = ga + gb + borrow
    tb_gpus = cap - used_a  # the team's cap is full
    initial: list[Running] = []
    wid = 100
    free_node = draw(st.integers(0, nodes - 1))
    # Pack a's and b's single-pod workloads into the nodes other than the free one; x holds
    # every node left whole.
    chunks = [("ta", g) for g in _split(draw, used_a)] + [("tb", g) for g in _split(draw, tb_gpus)]
    slots = [i for i in range(nodes) if i != free_node]
    left = {i: 8 for i in slots}
    for project, gpus in chunks:
        node = next((i for i in slots if left[i] >= gpus), None)
        if node is None:  # the fleet is too small for this draw: add a node
            node = len(hosts)
            hosts.append((f"z0n{node}", "c0", "z0", H100, 8))
            slots.append(node)
            left[node] = 8
        first = 8 - left[node]
        name = hosts[node][0]
        pod = Pod(name, tuple(f"{name}/{g}" for g in range(first, first + gpus)))
        priority = draw(st.sampled_from(CLASSES))
        initial.append(
            Running(
                wid,
                project,
                "u0",
                "job",
                H100,
                "c0",
                "z0",
                (pod,),
                priority,
                PREEMPTIBLE[priority],
                START - draw(st.integers(0, 1000)),
            )
        )
        wid += 1
        left[node] -= gpus
    x_gpus = 0
    for i in slots:
        if left[i] == 8:
            name = hosts[i][0]
            pod = Pod(name, tuple(f"{name}/{g}" for g in range(8)))
            initial.append(
                Running(wid, "x", "u2", "job", H100, "c0", "z0", (pod,), "standard", False, START)
            )
            wid += 1
            x_gpus += 8
            left[i] = 0
    specs = (
        {
            "name": "team",
            "kind": "team",
            "quotas": {H100: {"guaranteed": ga + gb, "borrow_limit": borrow}},
        },
        {"name": "ta", "parent": "team", "quotas": {H100: {"guaranteed": ga}}},
        {"name": "tb", "parent": "team", "quotas": {H100: {"guaranteed": gb}}},
        {"name": "x", "quotas": {H100: {"guaranteed": x_gpus}}},
    )
    queue = [Pending(1, "ta", "u0", "session", H100, k, 1, draw(st.sampled_from(CLASSES)), START)]
    for i in range(draw(st.integers(0, 3)) if others else 0):
        queue.append(
            Pending(
                2 + i,
                draw(st.sampled_from(("tb", "x"))),
                "u1",
                "session",
                H100,
                draw(st.integers(1, 8)),
                1,
                draw(st.sampled_from(CLASSES)),
                START - draw(st.integers(0, 1000)),
            )
        )
    min_run = float(draw(st.sampled_from((0, 120, 300, 600))))
    if others:
        delays = st.lists(st.integers(1, 2), min_size=1, max_size=3).map(tuple)
    else:
        delays = st.just((draw(st.integers(1, 2)),))
    cycle = st.builds(Cycle, step=st.integers(1, MAX_STEP), delays=delays)
    return Scenario(
        tuple(hosts),
        specs,
        Mode.GPUFLEET,
        min_run,
        tuple(draw(st.lists(cycle, min_size=1, max_size=12))),
        initial=tuple(initial),
        initial_queue=tuple(queue),
    )


def _split(draw: st.DrawFn, gpus: int) -> list[int]:
    """``gpus`` as single pods of 1-8."""
    chunks = []
    while gpus > 0:
        chunk = draw(st.integers(1, min(8, gpus)))
        chunks.append(chunk)
        gpus -= chunk
    return chunks


# ------------------------------------------------------------------------------ tests

EXAMPLES = int(os.environ.get("GPUFLEET_HYPOTHESIS_EXAMPLES", "0"))
RANDOM = EXAMPLES > 0


def gang_settings(examples: int, shrink: bool = True) -> settings:
    """The same examples on every run (derandomize), as in test_plan_properties. Shrinking
    a fleet of a hundred nodes over a dozen cycles takes many minutes, so the fleet tests
    report the first failing world as found (its failing cycle is printed compactly by
    ``describe``) unless GPUFLEET_HYPOTHESIS_SHRINK=1."""
    phases = tuple(Phase)
    if not shrink and not os.environ.get("GPUFLEET_HYPOTHESIS_SHRINK"):
        phases = tuple(p for p in Phase if p is not Phase.shrink)
    return settings(
        max_examples=EXAMPLES or examples,
        derandomize=not RANDOM,
        deadline=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@gang_settings(60, shrink=False)
@given(gang_worlds())
def test_gang_fleets_keep_the_laws(scenario: Scenario) -> None:
    world = GangWorld(scenario)
    for cycle in scenario.cycles + scenario.quiet:
        world.run_cycle(cycle)


@gang_settings(40, shrink=False)
@given(gang_worlds(keeper=True))
def test_a_lend_limit_reserve_stays_free(scenario: Scenario) -> None:
    world = GangWorld(scenario, keeper=KEEPER)
    for cycle in scenario.cycles + scenario.quiet:
        world.run_cycle(cycle)


def reclaimed_within_the_bound(scenario: Scenario) -> None:
    """``test_plan_properties.reclaim_within_the_bound`` on a ``GangWorld``."""

    def last_cycle(world: World) -> str:
        last = getattr(world, "last", None)
        return "" if last is None else "\nthe last cycle:\n" + describe(*last)

    reclaim_within_the_bound(scenario, GangWorld(scenario), last_cycle)


@gang_settings(40)
@given(capped_reclaims())
def test_a_guarantee_under_a_full_team_cap_is_reclaimed_within_the_bound(
    scenario: Scenario,
) -> None:
    reclaimed_within_the_bound(scenario)


@gang_settings(40)
@given(capped_reclaims(others=True))
def test_a_guarantee_under_a_full_team_cap_is_reclaimed_while_others_ask(
    scenario: Scenario,
) -> None:
    reclaimed_within_the_bound(scenario)


# ------------------------------------------------- every checker can fail: literal plans


def _facts(
    specs: Sequence[Mapping[str, Any]],
    nodes: Sequence[Any],
    running: Sequence[Running],
    queue: Sequence[Pending],
    result: Plan,
    now: float = 10_000.0,
    min_run: float = 300.0,
) -> Facts:
    snapshot = SchedulingSnapshot(
        tuple(nodes),
        tuple(running),
        tuple(queue),
        project_tree(specs),
        RANKS,
        PREEMPTIBLE,
        Policy(min_run_time_s=min_run),
    )
    return Facts(snapshot, result, Tree(specs), now)


def _ask(
    wid: int,
    project: str,
    per_pod: int,
    pods: int = 1,
    priority: str = "standard",
    created: float = 0.0,
) -> Pending:
    return Pending(wid, project, "u", "job", H100, per_pod, pods, priority, created)


def _pods(node: str, gpus: Iterable[int]) -> tuple[Pod, ...]:
    return (Pod(node, tuple(f"{node}/{i}" for i in gpus)),)


def _wait(wid: int, cause: WaitCause, reason: str = "waits", position: int = 1) -> Waiting:
    return Waiting(wid, position, cause, reason)


TEAM = [
    {"name": "team", "kind": "team", "quotas": {H100: {"guaranteed": 8, "borrow_limit": 0}}},
    {"name": "ta", "parent": "team", "quotas": {H100: {"guaranteed": 4}}},
    {"name": "tb", "parent": "team", "quotas": {H100: {"guaranteed": 4}}},
]


def test_l1_checker_catches_a_borrower_passing_a_guarantee_on_the_cap() -> None:
    running = [_running(10, "tb", "n1", "z1", range(6))]  # tb borrows 2 of the team's 8
    within, borrower = _ask(1, "ta", 4), _ask(2, "tb", 2)
    nodes = [_node("n1", "z1", [6, 7]), _node("n2", "z2", range(8))]
    waits = (_wait(1, WaitCause.QUOTA, "Waiting for the GPUs of team team to free up"),)
    bad = Plan((Admission(2, "c1", "z2", _pods("n2", [0, 1]), borrowed=2),), (), waits)
    with pytest.raises(AssertionError, match="L1"):
        check_guarantee_precedence(_facts(TEAM, nodes, running, [within, borrower], bad))
    fine = Plan((), (), (*waits, _wait(2, WaitCause.QUOTA)))
    check_guarantee_precedence(_facts(TEAM, nodes, running, [within, borrower], fine))


def test_l2_checker_catches_a_guarantee_behind_a_borrower() -> None:
    specs = [{"name": "p", "quotas": {H100: {"guaranteed": 8, "borrow_limit": 0}}}]
    running = [_running(10, "p", "n1", "z1", range(4))]
    big, small = _ask(1, "p", 6, created=1.0), _ask(2, "p", 2, created=2.0)  # 4+6 > 8, 4+2 <= 8
    result = Plan((), (), (_wait(1, WaitCause.QUOTA), _wait(2, WaitCause.BEHIND, position=2)))
    nodes = [_node("n1", "z1", range(4, 8))]
    with pytest.raises(AssertionError, match="L2"):
        check_head_of_line(_facts(specs, nodes, running, [big, small], result))
    # Behind a request within the guarantee that an enclosing cap refused: not this law.
    within = _ask(1, "p", 4, created=1.0)
    check_head_of_line(_facts(specs, nodes, running, [within, small], result))


OTHERS = [
    {"name": "a", "quotas": {H100: {"guaranteed": 8}}},
    {"name": "b"},  # no guarantee: everything it runs borrows
]


def test_l3_checker_catches_a_victim_set_larger_than_needed() -> None:
    v1 = _running(10, "b", "n1", "z1", range(4))
    v2 = _running(11, "b", "n1", "z1", range(4, 6))
    v3 = _running(12, "b", "n1", "z1", range(6, 8))
    request = _ask(1, "a", 2)
    waits = (_wait(1, WaitCause.PREEMPTING),)
    cause = PreemptionCause.GUARANTEE
    bad = Plan((), (Preemption(10, 1, cause, "r"),), waits, (Kept(1, _pods("n1", [0, 1])),))
    with pytest.raises(AssertionError, match="L3"):
        check_right_sized(_facts(OTHERS, [_node("n1", "z1", [])], [v1, v2, v3], [request], bad))
    # Ties on GPUs go to the least lost work: 11 checkpointed just now.
    v2 = replace(v2, last_progress_at=9_990.0)
    tied = Plan((), (Preemption(12, 1, cause, "r"),), waits, (Kept(1, _pods("n1", [6, 7])),))
    with pytest.raises(AssertionError, match="L3"):
        check_right_sized(_facts(OTHERS, [_node("n1", "z1", [])], [v1, v2, v3], [request], tied))
    best = Plan((), (Preemption(11, 1, cause, "r"),), waits, (Kept(1, _pods("n1", [4, 5])),))
    check_right_sized(_facts(OTHERS, [_node("n1", "z1", [])], [v1, v2, v3], [request], best))


def test_l3_checker_catches_a_gang_evicting_twice_its_need_in_a_large_zone() -> None:
    # 16 nodes, each held whole by one of b's borrowers: more candidates than brute force
    # takes. An 8-GPU pod needs one node; two were emptied.
    nodes = [_node(f"n{i:02d}", "z1", []) for i in range(16)]
    running = [_running(100 + i, "b", f"n{i:02d}", "z1", range(8)) for i in range(16)]
    request = _ask(1, "a", 8)
    cause = PreemptionCause.GUARANTEE
    bad = Plan(
        (),
        (Preemption(100, 1, cause, "r"), Preemption(101, 1, cause, "r")),
        (_wait(1, WaitCause.PREEMPTING),),
        (Kept(1, _pods("n00", range(8))),),
    )
    with pytest.raises(AssertionError, match=r"L3.*8 GPUs would do"):
        check_right_sized(_facts(OTHERS, nodes, running, [request], bad))


def test_l4_checker_catches_a_preemption_for_a_request_that_fits() -> None:
    victim = _running(10, "b", "n1", "z1", range(8))
    request = _ask(1, "a", 8)
    nodes = [_node("n1", "z1", []), _node("n2", "z1", range(8))]
    bad = Plan(
        (),
        (Preemption(10, 1, PreemptionCause.GUARANTEE, "r"),),
        (_wait(1, WaitCause.PREEMPTING),),
        (Kept(1, _pods("n1", range(8))),),
    )
    with pytest.raises(AssertionError, match="L4"):
        check_no_needless_preemption(_facts(OTHERS, nodes, [victim], [request], bad))
    # The free node is someone else's in the same plan: then preempting is right.
    other = _ask(2, "a", 8, created=-1.0)
    taken = Plan(
        (Admission(2, "c1", "z1", _pods("n2", range(8))),),
        bad.preemptions,
        bad.waiting,
        bad.kept,
    )
    check_no_needless_preemption(_facts(OTHERS, nodes, [victim], [request, other], taken))


def test_l5_checker_catches_a_victim_still_protected() -> None:
    # Preempted three times before, checkpoints every 1000 s: protected 2000 s after its
    # start.
    victim = _running(
        10, "b", "n1", "z1", range(8), started=8_500.0, preemptions=3, checkpoint_interval_s=1000.0
    )
    request = _ask(1, "a", 8)
    bad = Plan(
        (),
        (Preemption(10, 1, PreemptionCause.GUARANTEE, "r"),),
        (_wait(1, WaitCause.PREEMPTING),),
        (Kept(1, _pods("n1", range(8))),),
    )
    nodes = [_node("n1", "z1", [])]
    with pytest.raises(AssertionError, match="L5"):
        check_protection(_facts(OTHERS, nodes, [victim], [request], bad))
    check_protection(_facts(OTHERS, nodes, [replace(victim, started_at=7_000.0)], [request], bad))
    # Without a checkpoint interval: min_run x 2^n = 2400 s.
    session = replace(victim, checkpoint_interval_s=None, started_at=8_900.0)
    with pytest.raises(AssertionError, match="L5"):
        check_protection(_facts(OTHERS, nodes, [session], [request], bad))
    check_protection(_facts(OTHERS, nodes, [replace(session, started_at=7_500.0)], [request], bad))


def test_l6_checker_catches_a_kept_zone_backfilled_by_work_it_cannot_evict() -> None:
    specs = [
        {"name": "a", "quotas": {H100: {"guaranteed": 16}}},
        {"name": "c", "quotas": {H100: {"guaranteed": 8}}},
    ]
    holder = _ask(1, "a", 8, pods=2, created=1.0)  # within a's guarantee
    small = _ask(2, "c", 2, created=2.0)  # within c's guarantee: not evictable
    nodes = [_node("n1", "z1", range(4)), _node("n2", "z1", [])]
    reason = (
        "Waiting for 16 GPUs in one zone; you are next for H100, z1 is kept for you as GPUs free up"
    )
    bad = Plan(
        (Admission(2, "c1", "z1", _pods("n1", [0, 1])),),
        (),
        (_wait(1, WaitCause.RESERVED, reason),),
    )
    with pytest.raises(AssertionError, match="L6"):
        check_reservations(_facts(specs, nodes, [], [holder, small], bad))
    # A preemptible borrower of c may backfill.
    specs[1] = {"name": "c"}
    lent = replace(small, priority="opportunistic")
    check_reservations(_facts(specs, nodes, [], [holder, lent], bad))
    # A zone kept for two.
    two = Plan((), (), (_wait(1, WaitCause.RESERVED, reason), _wait(2, WaitCause.RESERVED, reason)))
    with pytest.raises(AssertionError, match=r"L6.*several"):
        check_reservations(_facts(specs, nodes, [], [holder, small], two))


def test_l7_checker_catches_a_plan_that_takes_a_reserve() -> None:
    specs = [
        {"name": "a"},
        {"name": KEEPER, "quotas": {H100: {"guaranteed": 8, "lend_limit": 0}}},
    ]
    nodes = [_node("n1", "z1", range(8)), _node("n2", "z1", range(8))]
    one, two = _ask(1, "a", 8), _ask(2, "a", 4)
    bad = Plan(
        (
            Admission(1, "c1", "z1", _pods("n1", range(8))),
            Admission(2, "c1", "z1", _pods("n2", range(4))),
        ),
    )
    with pytest.raises(AssertionError, match="L7"):
        check_lend_reserve(_facts(specs, nodes, [], [one, two], bad), KEEPER)
    fine = Plan(
        (Admission(1, "c1", "z1", _pods("n1", range(8))),), (), (_wait(2, WaitCause.CAPACITY),)
    )
    check_lend_reserve(_facts(specs, nodes, [], [one, two], fine), KEEPER)
