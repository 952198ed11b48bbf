"""Finding victims: who may be stopped to make room for a waiting workload, and the fewest.

Simulate first: nothing here changes the cycle's state. ``VictimIndex.find`` returns the
victims that would let the gang fit in one zone, or None; the planner commits them.

The index is built once per cycle, on the first search: per zone, the running workloads
that could ever be victims, in victim order — idle sessions first, then the lowest class,
then the highest fair share, then the least lost work (GPU-seconds since the last
checkpoint or snapshot). Workloads within the minimum run time are left out (idle ones
aside), and so are workloads already stopping. Per zone it also sums the GPUs each kind
of candidate holds, so a zone that could not make room even by evicting every candidate
is skipped without looking at its workloads.

Who may be a victim for a request of project ``p`` and class rank ``r``:
- an idle session (the culler's mark) whose project lets anyone reclaim it;
- in ``p``: a preemptible workload of a lower class;
- in another project: a borrower (beyond its project's guarantee, counting the project's
  workloads by class, then start time), if the request is within ``p``'s guarantee; or,
  for a borrowing request, a preemptible borrower of a lower class.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from .placement import Capacity, ZoneKey
from .quota import QuotaBook
from .snapshot import Pending, PreemptionCause, Running

Victims = list[tuple[Running, PreemptionCause]]
_started = attrgetter("started_at", "id")


@dataclass
class _Zone:
    ordered: list[Running] = field(default_factory=list)
    idle_gpus: int = 0
    borrowed_gpus: int = 0
    gpus_by_project: dict[str, int] = field(default_factory=dict)
    # Projects with preemptible workloads here (their own higher classes may evict them).
    preemptible_projects: set[str] = field(default_factory=set)
    # Node -> GPUs of idle sessions, of borrowers, and of preemptible borrowers by class
    # rank: what a request could free on that node at most, whoever asks.
    idle_on: dict[str, int] = field(default_factory=dict)
    borrowed_on: dict[str, int] = field(default_factory=dict)
    preemptible_on: dict[str, dict[int, int]] = field(default_factory=dict)


class VictimIndex:
    def __init__(
        self,
        running: tuple[Running, ...],
        book: QuotaBook,
        ranks: Mapping[str, int],
        min_run_time_s: float,
        now: float,
    ):
        self.ranks = ranks
        self.borrowing: set[int] = set()
        by_project: dict[tuple[str, str], list[Running]] = defaultdict(list)
        for workload in running:
            if not workload.stopping:
                by_project[(workload.project, workload.gpu_type)].append(workload)
        for (project, gpu_type), workloads in by_project.items():
            guaranteed = book.guarantee(project, gpu_type)
            if book.usage(project, gpu_type) <= guaranteed:
                continue  # within its guarantee: none of its workloads borrows
            workloads.sort(key=_started)  # by start, then (stable) by class, higher first
            if len({w.priority for w in workloads}) > 1:
                workloads.sort(key=lambda r: -ranks.get(r.priority, 0))
            counted = 0
            for workload in workloads:
                counted += workload.gpus
                if counted > guaranteed:
                    self.borrowing.add(workload.id)
        self.zones: dict[ZoneKey, _Zone] = defaultdict(_Zone)
        keys: dict[int, tuple[Any, ...]] = {}
        reclaim_first = {  # the highest share first
            project: tuple(-s for s in book.share_key(project)) for project, _ in by_project
        }
        for workloads in by_project.values():
            for workload in workloads:
                if not (
                    workload.idle_reclaimable
                    or workload.preemptible
                    or workload.id in self.borrowing
                ):
                    continue  # within its guarantee and not preemptible: nobody's victim
                if not workload.idle_reclaimable and workload.started_at + min_run_time_s > now:
                    continue
                zone = self.zones[(workload.cluster, workload.zone, workload.gpu_type)]
                zone.ordered.append(workload)
                if workload.preemptible:
                    zone.preemptible_projects.add(workload.project)
                for pod in workload.pods:
                    held = len(pod.gpus)
                    if workload.idle_reclaimable:
                        zone.idle_on[pod.node] = zone.idle_on.get(pod.node, 0) + held
                    elif workload.id in self.borrowing:
                        zone.borrowed_on[pod.node] = zone.borrowed_on.get(pod.node, 0) + held
                        if workload.preemptible:
                            rank = ranks.get(workload.priority, 0)
                            by_rank = zone.preemptible_on.setdefault(pod.node, {})
                            by_rank[rank] = by_rank.get(rank, 0) + held
                if workload.idle_reclaimable:
                    zone.idle_gpus += workload.gpus
                elif workload.id in self.borrowing:
                    zone.borrowed_gpus += workload.gpus
                zone.gpus_by_project[workload.project] = (
                    zone.gpus_by_project.get(workload.project, 0) + workload.gpus
                )
                lost = workload.gpus * (
                    now - max(workload.started_at, workload.last_progress_at or 0)
                )
                keys[workload.id] = (
                    not workload.idle_reclaimable,
                    ranks.get(workload.priority, 0),
                    reclaim_first[workload.project],
                    lost,
                    workload.id,
                )
        for zone in self.zones.values():
            zone.ordered.sort(key=lambda w: keys[w.id])
        self._bounds: dict[tuple[Any, ...], int] = {}

    def _pods_at_most(
        self,
        zone_key: ZoneKey,
        zone: _Zone,
        capacity: Capacity,
        per_pod: int,
        within: bool,
        rank: int,
    ) -> int:
        """How many pods the zone could hold if every candidate a request of this kind may
        evict (its own project's aside) were gone. Free GPUs only shrink in a cycle, so a
        bound computed earlier in the cycle stays a bound."""
        memo = (zone_key, per_pod, within, rank)
        bound = self._bounds.get(memo)
        if bound is None:
            bound = capacity.pods_fitting(zone_key, per_pod)
            for node in zone.idle_on.keys() | zone.borrowed_on.keys():
                if within:
                    freeable = zone.idle_on.get(node, 0) + zone.borrowed_on.get(node, 0)
                else:
                    lower = zone.preemptible_on.get(node, {})
                    freeable = zone.idle_on.get(node, 0) + sum(
                        g for r, g in lower.items() if r < rank
                    )
                key = (node, zone_key[2])
                if freeable and key in capacity.nodes:
                    free = capacity.free_count(key)
                    bound += (free + freeable) // per_pod - free // per_pod
            self._bounds[memo] = bound
        return bound

    def cause(
        self, victim: Running, request: Pending, rank: int, within: bool
    ) -> PreemptionCause | None:
        if victim.idle_reclaimable:
            return PreemptionCause.IDLE
        victim_rank = self.ranks.get(victim.priority, 0)
        if victim.project == request.project:
            if victim.preemptible and victim_rank < rank:
                return PreemptionCause.PRIORITY
            return None
        if victim.id not in self.borrowing:
            return None
        if within:
            return PreemptionCause.GUARANTEE
        if victim.preemptible and victim_rank < rank:
            return PreemptionCause.BORROWER_PRIORITY
        return None

    def find(
        self,
        request: Pending,
        rank: int,
        within: bool,
        capacity: Capacity,
        *,
        must_free: int = 0,
        own_project: bool = False,
        excluded: ZoneKey | None = None,
        chosen: set[int],
    ) -> Victims | None:
        """The cheapest zone's fewest victims: fewest non-idle victims, then fewest GPUs."""
        k, pods = request.gpus_per_pod, request.pods
        best: tuple[tuple[Any, ...], Victims] | None = None
        for zone_key, zone in self.zones.items():
            if zone_key[2] != request.gpu_type or zone_key == excluded:
                continue
            if zone_key not in capacity.buckets:
                continue
            own = zone.gpus_by_project.get(request.project, 0)
            ceiling = zone.idle_gpus + own + (0 if own_project else zone.borrowed_gpus)
            if capacity.zone_free[zone_key] + ceiling < request.gpus or own < must_free:
                continue  # even evicting every candidate here would not make room
            if request.project not in zone.preemptible_projects and (
                self._pods_at_most(zone_key, zone, capacity, k, within, rank) < pods
            ):
                continue  # no node mix of candidates here could hold the gang
            candidates = (
                (victim, cause)
                for victim in zone.ordered
                if victim.id not in chosen
                and (not own_project or victim.project == request.project)
                and (cause := self.cause(victim, request, rank, within)) is not None
            )
            victims = fewest_victims(capacity, zone_key, candidates, k, pods, must_free)
            if victims is None:
                continue
            cost = (
                sum(1 for _, c in victims if c is not PreemptionCause.IDLE),
                sum(v.gpus for v, _ in victims),
                zone_key,
            )
            if best is None or cost < best[0]:
                best = (cost, victims)
        return None if best is None else best[1]


def fewest_victims(
    capacity: Capacity,
    zone: ZoneKey,
    candidates: Iterable[tuple[Running, PreemptionCause]],
    per_pod: int,
    pods: int,
    must_free: int,
) -> Victims | None:
    """Victims in order until the gang fits (and, for a request over its project's cap,
    until ``must_free`` of the project's GPUs come back), then without every one of them
    the gang turns out not to need, latest first."""
    free: dict[tuple[str, str], int] = {}
    fitting = capacity.pods_fitting(zone, per_pod)
    chosen: Victims = []

    def release(victim: Running, sign: int) -> int:
        change = 0
        for pod in victim.pods:
            key = (pod.node, zone[2])
            if key not in capacity.nodes:
                continue  # on an unschedulable node: freeing it gives nothing usable
            before = free.get(key, capacity.free_count(key))
            after = before + sign * len(pod.gpus)
            free[key] = after
            change += after // per_pod - before // per_pod
        return change

    freed = 0
    for victim, cause in candidates:
        fitting += release(victim, +1)
        freed += victim.gpus
        chosen.append((victim, cause))
        if fitting >= pods and freed >= must_free:
            break
    else:
        return None
    for item in reversed(chosen[:-1]):
        lost = release(item[0], -1)
        if fitting + lost >= pods and freed - item[0].gpus >= must_free:
            fitting += lost
            freed -= item[0].gpus
            chosen.remove(item)
        else:
            release(item[0], +1)
    return chosen
