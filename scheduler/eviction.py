"""The cheapest set of victims that makes room for a gang in one zone (pure).

``cheapest_victims`` answers: of these eligible candidates, which set, once stopped, lets
``pods`` pods of ``per_pod`` GPUs fit in the zone (each pod on one node) and frees at least
what each ``Need.quotas`` entry asks of the projects it names — with the fewest evicted
GPUs, ties broken by the least lost work (GPU-seconds since the last checkpoint or
snapshot; an idle session loses nothing). Nothing here changes the cycle's state.

How:
- at most ``EXACT_LIMIT`` candidates: a branch-and-bound search over every subset, so the
  answer is the optimum (``tests/unit/test_eviction.py`` checks it against brute force);
- more: a greedy over nodes. Each node's cheapest way to hold one more pod (a small
  covering knapsack over the candidates on it) is scored by the GPUs it evicts per pod
  the whole zone gains (a gang victim spread over several nodes frees all of them), the
  best taken first, until the gang fits; then every victim the set turns out not to need
  is dropped again, the largest first. For a single pod the per-node knapsack is exact.
  The exact search then improves on that answer within a budget of steps.

Costs compare as ``(GPUs, lost work)`` tuples.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .snapshot import Running

# Up to this many candidates in a zone the search is exhaustive (with pruning).
EXACT_LIMIT = 10
# Steps the exhaustive search may take: unbounded in practice up to ``EXACT_LIMIT``
# candidates, a short improvement of the greedy answer beyond.
EXACT_BUDGET = 2_048
IMPROVE_BUDGET = 64

Cost = tuple[int, float]
NodeKey = tuple[str, str]  # node name, GPU type


@dataclass(frozen=True)
class Need:
    per_pod: int
    pods: int
    # (projects, GPUs): the victims of those projects (None: of any) must free this many,
    # for a request over a cap on its path, or one that free GPUs kept back by lend limits
    # would otherwise have to serve.
    quotas: tuple[tuple[frozenset[str] | None, int], ...] = ()


def lost_work(victim: Running, now: float) -> float:
    """GPU-seconds a stop now would lose: since its last checkpoint or snapshot, or its
    start. An idle session loses nothing (its snapshot keeps what it holds)."""
    if victim.idle_reclaimable:
        return 0.0
    since = max(victim.started_at, victim.last_progress_at or victim.started_at)
    return victim.gpus * max(0.0, now - since)


class _Room:
    """The zone's free GPUs per node with a set of victims gone, kept incrementally.
    What each victim frees where (its pods on schedulable nodes, and the quotas it
    counts for) is worked out once per search and shared by its rooms (``parts``)."""

    def __init__(
        self,
        free: Mapping[NodeKey, int],
        gpu_type: str,
        need: Need,
        fitting: int,
        parts: dict[int, tuple[list[tuple[NodeKey, int]], list[int]]] | None = None,
        zone: tuple[str, str, str] | None = None,
    ):
        self.base = free
        self.zone = zone
        self.gpu_type = gpu_type
        self.need = need
        self.free: dict[NodeKey, int] = {}
        self.fitting = fitting
        self.freed = [0] * len(need.quotas)
        self.parts_of = {} if parts is None else parts

    def count(self, key: NodeKey) -> int:
        value = self.free.get(key)
        return self.base[key] if value is None else value

    def parts(self, victim: Running) -> tuple[list[tuple[NodeKey, int]], list[int]]:
        """Where the victim frees GPUs the gang could use (its pods on schedulable nodes
        of the zone: elsewhere it frees only quota), and the quotas it counts for."""
        found = self.parts_of.get(victim.id)
        if found is None:
            t, zone = self.gpu_type, self.zone
            if zone is not None and (victim.cluster, victim.zone) != (zone[0], zone[1]):
                nodes = []
            else:
                nodes = [
                    ((pod.node, t), len(pod.gpus))
                    for pod in victim.pods
                    if (pod.node, t) in self.base
                ]  # on an unschedulable node, freeing it gives nothing usable
            quotas = [
                i
                for i, (projects, _) in enumerate(self.need.quotas)
                if projects is None or victim.project in projects
            ]
            found = self.parts_of[victim.id] = (nodes, quotas)
        return found

    def change(self, victim: Running, sign: int) -> None:
        k, free, base = self.need.per_pod, self.free, self.base
        nodes, quotas = self.parts(victim)
        for key, gpus in nodes:
            before = free.get(key)
            if before is None:
                before = base[key]
            after = before + sign * gpus
            free[key] = after
            self.fitting += after // k - before // k
        for i in quotas:
            self.freed[i] += sign * victim.gpus

    def fits(self) -> bool:
        return self.fitting >= self.need.pods and self.quotas_met()

    def quotas_met(self) -> bool:
        return all(
            freed >= gpus for freed, (_, gpus) in zip(self.freed, self.need.quotas, strict=True)
        )


def cheapest_victims(
    candidates: Sequence[Running],
    free: Mapping[NodeKey, int],
    gpu_type: str,
    need: Need,
    fitting: int,
    now: float,
    at_least: int = 0,
    zone: tuple[str, str, str] | None = None,
    improve_budget: int = IMPROVE_BUDGET,
) -> tuple[Cost, list[Running]] | None:
    """The cheapest feasible victim set among ``candidates`` (all eligible; schedulable
    nodes' free counts are ``free``; ``fitting`` pods fit now in the zone), with its cost;
    None if even all of them do not make room. ``zone``: where the gang lands, when some
    candidates run elsewhere (they free only quota; without it every candidate runs
    there). ``at_least``: GPUs any feasible set frees for certain (what the gang lacks in
    the zone), a bound that prunes the search. ``improve_budget``: the steps the exact
    search may spend improving the greedy answer beyond ``EXACT_LIMIT`` candidates (the
    gang benchmark's audit searches deeper to check the answer)."""
    lost = {v.id: lost_work(v, now) for v in candidates}
    ordered = sorted(candidates, key=lambda v: (v.gpus, lost[v.id], v.id))
    # Every candidate gone: if the gang does not fit even then, nothing here makes room.
    potential = _Room(free, gpu_type, need, fitting, zone=zone)
    for victim in ordered:
        potential.change(victim, +1)
    if not potential.fits():
        return None
    room = _Room(free, gpu_type, need, fitting, potential.parts_of, zone)
    best: tuple[Cost, list[Running]] | None = None
    if len(ordered) > EXACT_LIMIT:
        chosen = _greedy(ordered, room, lost)
        best = (_cost(chosen, lost), chosen)
        if need.quotas:
            chosen = _greedy(ordered, room, lost, quota_first=True)
            best = min(best, (_cost(chosen, lost), chosen), key=lambda found: found[0])
        # A gang victim that alone frees whole nodes can beat the node-by-node greedy.
        for victim in ordered:
            cost = (victim.gpus, lost[victim.id])
            if cost >= best[0]:
                break  # sorted by cost: no later one is cheaper
            room.change(victim, +1)
            if room.fits():
                best = (cost, [victim])
            room.change(victim, -1)
    budget = EXACT_BUDGET if len(ordered) <= EXACT_LIMIT else improve_budget
    found = _Exact(ordered, room, potential, lost, best, budget, at_least).run()
    if found is None or len(ordered) <= EXACT_LIMIT:
        return found  # the optimum: nothing in it is unneeded
    # A budget-bound search may stop at a set with a victim it does not need.
    needed = {v.id: v for v in found[1]}
    for victim in found[1]:
        room.change(victim, +1)
    _drop_unneeded(needed, room, lost)
    for victim in needed.values():
        room.change(victim, -1)
    kept = list(needed.values())
    return _cost(kept, lost), kept


def _cost(victims: Sequence[Running], lost: Mapping[int, float]) -> Cost:
    return (sum(v.gpus for v in victims), sum(lost[v.id] for v in victims))


def _greedy(
    ordered: Sequence[Running],
    room: _Room,
    lost: Mapping[int, float],
    quota_first: bool = False,
) -> list[Running]:
    """Node by node, the cheapest GPUs per pod gained, until the gang fits; then without
    every victim it does not need, the largest first. ``quota_first``: the smallest
    victims that count for what the caps ask are taken before the nodes (where a cap
    asks more than room does, they may well make the room too). ``room`` starts and
    ends empty."""
    k = room.need.per_pod
    on_node: dict[NodeKey, list[Running]] = {}
    for victim in ordered:
        for key, _ in room.parts(victim)[0]:
            on_node.setdefault(key, []).append(victim)
    chosen: dict[int, Running] = {}
    if quota_first:
        _fill_quotas(ordered, room, chosen, room.quotas_met)

    def option(key: NodeKey) -> tuple[tuple[float, float, str], list[Running]] | None:
        """The node's cheapest way to one more pod, scored by GPUs per pod gained."""
        free = room.count(key)
        short = k - free % k
        present = [v for v in on_node[key] if v.id not in chosen]
        picked = _cover(present, key[0], short, lost)
        if picked is None:
            return None
        before = room.fitting
        for v in picked:
            room.change(v, +1)
        gained = room.fitting - before
        for v in picked:
            room.change(v, -1)
        if gained <= 0:
            return None
        gpus, work = _cost(picked, lost)
        return (gpus / gained, work / gained, key[0]), picked

    heap: list[tuple[tuple[float, float, str], NodeKey]] = []
    for key in on_node:
        scored = option(key)
        if scored is not None:
            heap.append((scored[0], key))
    heapq.heapify(heap)
    while room.fitting < room.need.pods and heap:
        _, key = heapq.heappop(heap)
        fresh = option(key)  # earlier picks may have changed it
        if fresh is None:
            continue
        if heap and fresh[0] > heap[0][0]:
            heapq.heappush(heap, (fresh[0], key))
            continue
        for v in fresh[1]:
            chosen[v.id] = v
            room.change(v, +1)
    # What a cap or a lend limit still asks for: the smallest victims that count for it.
    _fill_quotas(ordered, room, chosen, room.fits)
    _drop_unneeded(chosen, room, lost)
    result = list(chosen.values())
    for victim in result:
        room.change(victim, -1)
    return result


def _fill_quotas(
    ordered: Sequence[Running],
    room: _Room,
    chosen: dict[int, Running],
    done: Callable[[], bool],
) -> None:
    """Add the smallest victims that count for what a cap or a lend limit still asks,
    until ``done``."""
    for victim in ordered:
        if done():
            break
        if victim.id not in chosen and _counts(room, victim):
            chosen[victim.id] = victim
            room.change(victim, +1)


def _drop_unneeded(chosen: dict[int, Running], room: _Room, lost: Mapping[int, float]) -> None:
    """Without every chosen victim the room does not need (all of them in it), the
    largest first."""
    for victim in sorted(chosen.values(), key=lambda v: (-v.gpus, -lost[v.id], v.id)):
        room.change(victim, -1)
        if room.fits():
            del chosen[victim.id]
        else:
            room.change(victim, +1)


def _counts(room: _Room, victim: Running) -> bool:
    return any(
        projects is None or victim.project in projects
        for (projects, gpus), freed in zip(room.need.quotas, room.freed, strict=True)
        if freed < gpus
    )


def _cover(
    present: Sequence[Running], node: str, short: int, lost: Mapping[int, float]
) -> list[Running] | None:
    """The cheapest of ``present`` that free at least ``short`` GPUs on ``node`` (a
    covering knapsack: a node holds a handful of workloads)."""
    # best[j]: the cheapest set freeing at least j GPUs here (j capped at ``short``).
    best: list[tuple[Cost, tuple[Running, ...]] | None] = [((0, 0.0), ())] + [None] * short
    for victim in present:
        here = sum(len(p.gpus) for p in victim.pods if p.node == node)
        cost = (victim.gpus, lost[victim.id])
        for j in range(short, 0, -1):
            source = best[max(0, j - here)]
            if source is None:
                continue
            total = (source[0][0] + cost[0], source[0][1] + cost[1])
            current = best[j]
            if current is None or total < current[0]:
                best[j] = (total, (*source[1], victim))
    found = best[short]
    return None if found is None else list(found[1])


class _Exact:
    """Branch and bound over subsets, cheapest first: candidates sorted by cost, each
    either taken or not; a branch ends when it costs no less than the best set found, or
    when taking every remaining candidate would still not make room."""

    def __init__(
        self,
        ordered: Sequence[Running],
        room: _Room,
        potential: _Room,
        lost: Mapping[int, float],
        best: tuple[Cost, list[Running]] | None,
        budget: int,
        at_least: int,
    ):
        self.ordered = ordered
        self.room = room
        self.lost = lost
        self.best = best
        self.budget = budget
        self.at_least = at_least
        # The taken candidates and every one not decided yet, all gone: if the gang does
        # not fit even then, no branch from here makes room (kept as the search goes).
        self.potential = potential
        self.taken: list[Running] = []

    def run(self) -> tuple[Cost, list[Running]] | None:
        self._visit(0, (0, 0.0))
        return self.best

    def _visit(self, i: int, cost: Cost) -> None:
        if self.budget <= 0:
            return
        self.budget -= 1
        lacking = max(0, self.at_least - cost[0])  # every victim frees its GPUs in the zone
        if self.best is not None and (cost[0] + lacking, cost[1]) >= self.best[0]:
            return
        room = self.room
        if room.fits():
            self.best = (cost, list(self.taken))
            return
        if i == len(self.ordered) or not self.potential.fits():
            return
        victim = self.ordered[i]
        room.change(victim, +1)
        self.taken.append(victim)
        self._visit(i + 1, (cost[0] + victim.gpus, cost[1] + self.lost[victim.id]))
        self.taken.pop()
        room.change(victim, -1)
        self.potential.change(victim, -1)
        self._visit(i + 1, cost)
        self.potential.change(victim, +1)
