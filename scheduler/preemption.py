"""Finding victims: who may be stopped to make room for a waiting workload, and the fewest.

Simulate first: nothing here changes the cycle's state. ``VictimIndex.find`` returns the
victims that would let the gang fit in one zone, or None; the planner commits them.

The candidates — running workloads that could ever be victims — are kept per zone from one
cycle to the next (``Candidates``, in the plan memo) and brought up to date from what
changed; workloads within the minimum run time are left out (idle ones aside), and so are
workloads already stopping. Per zone the candidates' GPUs are summed by kind, so a zone
that could not make room even by evicting every candidate is skipped without looking at
its workloads. On the cycle's first search ``VictimIndex`` takes the fair shares as they
stand, and puts each zone it looks at in victim order — idle sessions first, then the
lowest class, then the highest fair share, then the least lost work (GPU-seconds since
the last checkpoint or snapshot).

Who may be a victim for a request of project ``p`` and class rank ``r``:
- an idle session (the culler's mark) whose project lets anyone reclaim it;
- in ``p``: a preemptible workload of a lower class;
- in another project: a borrower (beyond its project's guarantee, counting the project's
  workloads by class, then work in held zones last, then arrival), if the request is
  within ``p``'s guarantee; or, for a borrowing request, a preemptible borrower of a lower
  class.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from .eviction import Need, cheapest_victims
from .placement import Capacity, ZoneKey
from .quota import QuotaBook
from .snapshot import Pending, PreemptionCause, Running

Victims = list[tuple[Running, PreemptionCause]]
_GPUS = itemgetter(4)  # of a ``Candidates._counts_as`` tuple


@dataclass
class Zone:
    # The candidates here, by id (the index's order is made per cycle: it depends on the
    # clock and on fair shares).
    members: dict[int, Running] = field(default_factory=dict)
    idle_gpus: int = 0
    borrowed_gpus: int = 0
    gpus_by_project: dict[str, int] = field(default_factory=dict)
    # Projects with preemptible workloads here (their own higher classes may evict them),
    # with how many.
    preemptible_projects: dict[str, int] = field(default_factory=dict)
    # Node -> GPUs of idle sessions, of borrowers, and of preemptible borrowers by class
    # rank: what a request could free on that node at most, whoever asks.
    idle_on: dict[str, int] = field(default_factory=dict)
    borrowed_on: dict[str, int] = field(default_factory=dict)
    preemptible_on: dict[str, dict[int, int]] = field(default_factory=dict)


class Candidates:
    """Who could ever be a victim, per zone, kept from one cycle to the next (in
    ``memo.PlanMemo``) and brought up to date from what changed.

    A running workload that is not stopping is a candidate when it is idle-reclaimable,
    or preemptible, or a borrower, and has run ``min_run_time_s`` (idle ones aside).
    Whether a workload borrows depends only on its project's other non-stopping workloads
    of the type and the project's guarantee, so it is recomputed for the projects whose
    workloads changed; a workload becomes old enough at a known time, kept in a heap.
    ``refresh`` brings the zones up to date; it needs the cycle's quota book (for
    guarantees) and runs on the cycle's first preemption search."""

    def __init__(self, ranks: Mapping[str, int], min_run_time_s: float):
        self.ranks = ranks
        self.min_run_time_s = min_run_time_s
        self.now = float("-inf")
        self.by_project: dict[tuple[str, str], dict[int, Running]] = defaultdict(dict)
        # Each project's workloads in the order they count against its guarantee (class,
        # then held zones last, then arrival, see ``_counts_as``): who borrows is a suffix
        # of it.
        self._order: dict[tuple[str, str], list[tuple[int, bool, float, int, int]]] = defaultdict(
            list
        )
        # Per project, GPUs counted from each place in ``_order`` on (``counted_after``).
        self._suffix: dict[tuple[str, str], list[int]] = {}
        # The zones held for a waiting request at the end of the last cycle
        # (``Pending.held_zone``): work there counts last in its class.
        self.held_zones: frozenset[ZoneKey] = frozenset()
        # Zone -> the (project, GPU type) keys with workloads there, and how many: the
        # orders ``hold`` must sort again when a zone is held or let go.
        self._keys_in: dict[ZoneKey, Counter[tuple[str, str]]] = defaultdict(Counter)
        self.borrowing: set[int] = set()
        self._borrowing_in: dict[tuple[str, str], set[int]] = {}
        self.zones: dict[ZoneKey, Zone] = {}
        self._member: dict[int, tuple[Running, bool]] = {}  # id -> (it, borrowing when in)
        self._dirty: set[tuple[str, str]] = set()
        self._new: set[int] = set()
        self._later: list[tuple[float, int]] = []  # (old enough at, id)
        self._where: dict[int, tuple[str, str]] = {}  # id -> its key in by_project

    def add(self, workload: Running) -> None:
        if workload.stopping:
            return
        key = (workload.project, workload.gpu_type)
        self.by_project[key][workload.id] = workload
        bisect.insort(self._order[key], self._counts_as(workload))
        self._suffix.pop(key, None)
        self._keys_in[(workload.cluster, workload.zone, workload.gpu_type)][key] += 1
        self._where[workload.id] = key
        self._dirty.add(key)
        self._new.add(workload.id)

    def _counts_as(self, workload: Running) -> tuple[int, bool, float, int, int]:
        """Where the workload counts against its project's guarantee (higher classes
        first; within a class, work in a zone held for a waiting request last; then the
        earliest queued — its request's first arrival, so that work which started while
        an earlier request of its project waited for room counts after that one — or,
        when that is unknown, started), its id and its GPUs.

        Held zones last: work enters a held zone as backfill the holder may evict, a
        borrower, and must stay one while the holder waits. Counted by start time alone,
        it would turn into its project's guaranteed work as the project's older work ends
        elsewhere, and the held zone would never drain."""
        queued = workload.created_at if workload.created_at is not None else workload.started_at
        return (
            -self.ranks.get(workload.priority, 0),
            (workload.cluster, workload.zone, workload.gpu_type) in self.held_zones,
            queued,
            workload.id,
            workload.gpus,
        )

    def counted_after(self, key: tuple[str, str], rank: int, queued_at: float, wid: int) -> int:
        """GPUs of the project's workloads (not stopping) that count against its guarantee
        after a request of class ``rank`` queued at ``queued_at`` would (``_counts_as``)."""
        order = self._order.get(key)
        if not order:
            return 0
        suffix = self._suffix.get(key)
        if suffix is None:
            counted = itertools.accumulate(reversed([_GPUS(c) for c in order]))
            suffix = self._suffix[key] = [*reversed(list(counted)), 0]
        return suffix[bisect.bisect_right(order, (-rank, False, queued_at, wid, float("inf")))]

    def hold(self, zones: frozenset[ZoneKey]) -> None:
        """Count work in ``zones`` last in its class from now on (``_counts_as``)."""
        if zones == self.held_zones:
            return
        moved = zones ^ self.held_zones
        self.held_zones = zones
        for key in {key for zone in moved for key in self._keys_in.get(zone, ())}:
            self._order[key] = sorted(map(self._counts_as, self.by_project[key].values()))
            self._suffix.pop(key, None)
            self._dirty.add(key)

    def swap(self, old: Running, new: Running) -> None:
        """``new`` in ``old``'s place where only its last checkpoint or snapshot moved
        (``memo._only_progress``): who borrows and what each zone counts stay the same."""
        workloads = self.by_project.get((new.project, new.gpu_type))
        if workloads is None or workloads.get(new.id) is not old:
            self.drop(old)
            self.add(new)
            return
        workloads[new.id] = new
        member = self._member.get(new.id)
        if member is not None:
            self._member[new.id] = (new, member[1])
            self.zones[(new.cluster, new.zone, new.gpu_type)].members[new.id] = new

    def drop(self, workload: Running) -> None:
        key = (workload.project, workload.gpu_type)
        workloads = self.by_project.get(key)
        if workloads is None or workloads.get(workload.id) is not workload:
            return
        del workloads[workload.id]
        del self._where[workload.id]
        order = self._order[key]
        del order[bisect.bisect_left(order, self._counts_as(workload))]
        self._suffix.pop(key, None)
        keys = self._keys_in[(workload.cluster, workload.zone, workload.gpu_type)]
        keys[key] -= 1
        if not keys[key]:
            del keys[key]
        if not workloads:
            del self.by_project[key]
            del self._order[key]
        self._dirty.add(key)
        self._new.discard(workload.id)
        self._leave(workload.id)  # ``borrowing`` follows on ``refresh``

    def refresh(self, book: QuotaBook) -> None:
        borrowing = self.borrowing
        for key in self._dirty:
            before = self._borrowing_in.pop(key, set())
            workloads = self.by_project.get(key)
            if workloads is None:
                borrowing -= before
                continue
            now = self._borrowers(key, book.guarantee(*key))
            if now:
                self._borrowing_in[key] = now
            for wid in now - before:
                borrowing.add(wid)
                self._review(workloads[wid])
            for wid in before - now:
                borrowing.discard(wid)
                if wid in workloads:  # else it was dropped, and left already
                    self._review(workloads[wid])
        self._dirty.clear()
        for wid in self._new:
            tracked = self._tracked(wid)
            if tracked is not None:
                self._review(tracked)
        self._new.clear()
        later = self._later
        while later and later[0][0] <= self.now:
            _, wid = heapq.heappop(later)
            tracked = self._tracked(wid)
            if tracked is not None:
                self._review(tracked)

    def young_freeable(
        self, within: bool, rank: int, ranks: Mapping[str, int]
    ) -> dict[ZoneKey, dict[str, int]]:
        """Per zone and node, the GPUs of would-be candidates still within their
        protection that a request of this kind could evict once it ends (see
        ``VictimIndex.pods_at_most``): what a zone held for it will give back in time."""
        found: dict[ZoneKey, dict[str, int]] = {}
        seen: set[int] = set()
        for _, wid in self._later:
            if wid in seen or wid in self._member:
                continue
            seen.add(wid)
            workload = self._tracked(wid)
            if workload is None or wid not in self.borrowing:
                continue
            if not within and not (workload.preemptible and ranks.get(workload.priority, 0) < rank):
                continue
            on = found.setdefault((workload.cluster, workload.zone, workload.gpu_type), {})
            for pod in workload.pods:
                on[pod.node] = on.get(pod.node, 0) + len(pod.gpus)
        return found

    def _tracked(self, wid: int) -> Running | None:
        key = self._where.get(wid)
        return None if key is None else self.by_project[key].get(wid)

    def _borrowers(self, key: tuple[str, str], guaranteed: int) -> set[int]:
        """Those beyond the guarantee, counting by class (higher first), then start time:
        the suffix of the project's order from the first whose running total exceeds it."""
        order = self._order[key]
        counted = list(itertools.accumulate(map(_GPUS, order)))
        if not counted or counted[-1] <= guaranteed:
            return set()
        cut = bisect.bisect_right(counted, guaranteed)
        return {wid for _, _, _, wid, _ in order[cut:]}

    def _review(self, workload: Running) -> None:
        """Make the workload a member if and only if it is a candidate now."""
        borrowing = workload.id in self.borrowing
        may = workload.idle_reclaimable or workload.preemptible or borrowing
        until = protected_until(workload, self.min_run_time_s)
        old_enough = workload.idle_reclaimable or until <= self.now
        member = self._member.get(workload.id)
        if member is not None and (member[0] is not workload or member[1] != borrowing):
            self._leave(workload.id)
            member = None
        if may and not old_enough:
            heapq.heappush(self._later, (until, workload.id))
        if member is None and may and old_enough:
            self._enter(workload, borrowing)
        elif member is not None and not (may and old_enough):
            self._leave(workload.id)

    def _enter(self, workload: Running, borrowing: bool) -> None:
        self._member[workload.id] = (workload, borrowing)
        zone_key = (workload.cluster, workload.zone, workload.gpu_type)
        zone = self.zones.get(zone_key)
        if zone is None:
            zone = self.zones[zone_key] = Zone()
        self._count(zone, workload, borrowing, +1)
        zone.members[workload.id] = workload

    def _leave(self, wid: int) -> None:
        member = self._member.pop(wid, None)
        if member is None:
            return
        workload, borrowing = member
        zone_key = (workload.cluster, workload.zone, workload.gpu_type)
        zone = self.zones[zone_key]
        self._count(zone, workload, borrowing, -1)
        del zone.members[wid]
        if not zone.members:
            del self.zones[zone_key]

    def _count(self, zone: Zone, workload: Running, borrowing: bool, sign: int) -> None:
        idle, project = workload.idle_reclaimable, workload.project
        if workload.preemptible:
            _bump(zone.preemptible_projects, project, sign)
        rank = self.ranks.get(workload.priority, 0)
        for pod in workload.pods:
            held = sign * len(pod.gpus)
            if idle:
                _bump(zone.idle_on, pod.node, held)
            elif borrowing:
                _bump(zone.borrowed_on, pod.node, held)
                if workload.preemptible:
                    by_rank = zone.preemptible_on.setdefault(pod.node, {})
                    _bump(by_rank, rank, held)
                    if not by_rank:
                        del zone.preemptible_on[pod.node]
        gpus = sign * workload.gpus
        if idle:
            zone.idle_gpus += gpus
        elif borrowing:
            zone.borrowed_gpus += gpus
        _bump(zone.gpus_by_project, project, gpus)


def ran_ahead(victim: Running, request: Pending, victim_rank: int, rank: int) -> bool:
    """Whether the running ``victim`` (of the request's project) started while the
    request waited and stands behind it in the project's queue (class, then arrival):
    it ran as the request's backfill, on quota the request was waiting for."""
    if victim.created_at is None or victim.started_at < request.created_at:
        return False
    if victim_rank != rank:
        return victim_rank < rank
    return (victim.created_at, victim.id) > (request.created_at, request.id)


# Protection doubles with each earlier preemption, up to this many times.
MAX_DOUBLINGS = 10


def protected_until(workload: Running, min_run_time_s: float) -> float:
    """Until when the workload may not be a victim (idle sessions aside): the minimum
    run time after its start; after an earlier preemption, until it has run its next
    checkpoint interval (at least the minimum run time) — twice that from its third
    preemption on, doubled again for each further one; a workload without an interval
    (a session), the minimum run time doubled for each preemption. So one that
    checkpoints always reaches its next checkpoint before it can be stopped again, and
    a workload preempted over and over keeps more of its work each time. (Doubling a
    job's protection from its first preemption idled GPUs on the benchmarks' traces
    without lowering the most preemptions of a job below what this gives.)"""
    n = min(workload.preemptions, MAX_DOUBLINGS)
    if n <= 0:
        return workload.started_at + min_run_time_s
    interval = workload.checkpoint_interval_s
    if interval:
        return workload.started_at + max(min_run_time_s, interval) * 2 ** max(0, n - 2)
    return workload.started_at + min_run_time_s * 2**n


def _bump(sums: dict[Any, int], key: Any, value: int) -> None:
    total = sums.get(key, 0) + value
    if total:
        sums[key] = total
    else:
        sums.pop(key, None)


class VictimIndex:
    """The cycle's view of the candidates, brought up to date on the cycle's first search."""

    def __init__(
        self,
        candidates: Candidates,
        book: QuotaBook,
        ranks: Mapping[str, int],
        now: float,
    ):
        candidates.refresh(book)
        self.ranks = ranks
        self.now = now
        self.borrowing = candidates.borrowing
        self.zones = candidates.zones
        self._bounds: dict[tuple[Any, ...], int] = {}

    def pods_at_most(
        self,
        zone_key: ZoneKey,
        zone: Zone,
        capacity: Capacity,
        per_pod: int,
        within: bool,
        rank: int,
        young: Mapping[str, int] | None = None,
    ) -> int:
        """How many pods the zone could hold if every candidate a request of this kind may
        evict (its own project's aside) were gone; with ``young`` (per node, GPUs of
        would-be candidates still protected: ``Candidates.young_freeable``), once those
        are too. Free GPUs only shrink in a cycle, so a bound computed earlier in the
        cycle stays a bound."""
        memo = (zone_key, per_pod, within, rank, young is not None)
        bound = self._bounds.get(memo)
        if bound is None:
            bound = capacity.pods_fitting(zone_key, per_pod)
            # Within its guarantee a request may evict any borrower; beyond it, only the
            # preemptible ones of a lower class: on other nodes it could free nothing.
            evictable = zone.borrowed_on if within else zone.preemptible_on
            later = young or {}
            for node in zone.idle_on.keys() | evictable.keys() | later.keys():
                freeable = zone.idle_on.get(node, 0) + later.get(node, 0)
                if within:
                    freeable += zone.borrowed_on.get(node, 0)
                else:
                    lower = zone.preemptible_on.get(node)
                    if lower:
                        freeable += sum(g for r, g in lower.items() if r < rank)
                key = (node, zone_key[2])
                if freeable and key in capacity.nodes:
                    free = capacity.free_count(key)
                    bound += (free + freeable) // per_pod - free // per_pod
            self._bounds[memo] = bound
        return bound

    def cause(
        self, victim: Running, request: Pending, rank: int, within: bool, backfill: bool = False
    ) -> PreemptionCause | None:
        """Why the victim may be stopped for the request, or None. ``backfill``: the
        request is refused by a cap on its path, so its project's borrowers that started
        while it waited, behind it in the queue, ran as its backfill."""
        if victim.idle_reclaimable:
            return PreemptionCause.IDLE
        if victim.id in request.preempted_by and not within:
            return None  # it stopped the request: only a guarantee takes it back
        victim_rank = self.ranks.get(victim.priority, 0)
        if victim.project == request.project:
            if victim.preemptible and victim_rank < rank:
                return PreemptionCause.PRIORITY
            if (
                backfill
                and victim.id in self.borrowing
                and ran_ahead(victim, request, victim_rank, rank)
            ):
                return PreemptionCause.BACKFILL
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
        quotas: tuple[tuple[frozenset[str] | None, int], ...] = (),
        own_project: bool = False,
        excluded: ZoneKey | None = None,
        chosen: set[int],
    ) -> tuple[ZoneKey, Victims] | None:
        """The zone and the victims with the fewest evicted GPUs (ties: the least lost
        work) with which the gang fits in that zone and every ``quotas`` entry is freed,
        or None.

        ``own_project``: the request is refused by a cap on its path and makes room among
        its own project's work: its lower preemptible classes and its backfill
        (``ran_ahead``). Those free its project's quota wherever they run, so victims
        elsewhere may join the ones in the zone where the gang lands; every other search
        stops victims in that zone only.

        Zones are looked at from the one needing the fewest GPUs freed; the search stops
        once a set costs no more than the next zone could need at least."""
        k, pods, t = request.gpus_per_pod, request.pods, request.gpu_type
        own_needed = max((gpus for projects, gpus in quotas if projects is not None), default=0)
        least = max((gpus for _, gpus in quotas), default=0)
        causes: dict[int, PreemptionCause] = {}
        own: list[Running] = []  # own_project: the project's eligible work, every zone
        if own_project:
            own = self._own_work(request, rank, within, chosen, causes)
            if sum(v.gpus for v in own) < own_needed:
                return None
            searched = [
                (zone_key, self.zones.get(zone_key) or Zone())
                for zone_key in capacity.zones_by_type.get(t, ())
            ]
        else:
            searched = list(self.zones.items())
        zones = self._zones_in_order(
            searched, request, rank, within, capacity, own_project, excluded, least
        )
        best: tuple[tuple[Any, ...], Victims] | None = None
        need = Need(k, pods, quotas)
        free = _FreeCounts(capacity)
        for at_least, zone_key, zone in zones:
            if best is not None and (best[0][0], best[0][1]) <= (at_least, 0.0):
                break  # no zone further on evicts fewer GPUs, nor as few losing less
            if own_project:
                eligible = own
            else:
                eligible = self._eligible(
                    zone.members.values(), request, rank, within, chosen, causes
                )
            found = cheapest_victims(
                eligible,
                free,
                t,
                need,
                capacity.pods_fitting(zone_key, k),
                self.now,
                at_least,
                zone=zone_key,
            )
            if found is None:
                continue
            cost, victims = found
            key = (cost[0], cost[1], zone_key)
            if best is None or key < best[0]:
                best = (key, [(v, causes[v.id]) for v in victims])
        return None if best is None else (best[0][2], best[1])

    def _eligible(
        self,
        members: Iterable[Running],
        request: Pending,
        rank: int,
        within: bool,
        chosen: set[int],
        causes: dict[int, PreemptionCause],
        backfill: bool = False,
    ) -> list[Running]:
        """The ``members`` not ``chosen`` already that may be stopped for the request,
        their causes recorded in ``causes``."""
        eligible = []
        for victim in members:
            if victim.id in chosen:
                continue
            cause = self.cause(victim, request, rank, within, backfill=backfill)
            if cause is not None:
                causes[victim.id] = cause
                eligible.append(victim)
        return eligible

    def _own_work(
        self,
        request: Pending,
        rank: int,
        within: bool,
        chosen: set[int],
        causes: dict[int, PreemptionCause],
    ) -> list[Running]:
        """The request's own project's work, in every zone of its GPU type, that its
        request may stop: its lower preemptible classes and its backfill."""
        own: list[Running] = []
        for zone_key, zone in self.zones.items():
            if zone_key[2] != request.gpu_type or request.project not in zone.gpus_by_project:
                continue
            mine = (v for v in zone.members.values() if v.project == request.project)
            own += self._eligible(mine, request, rank, within, chosen, causes, backfill=True)
        return own

    def _zones_in_order(
        self,
        searched: list[tuple[ZoneKey, Zone]],
        request: Pending,
        rank: int,
        within: bool,
        capacity: Capacity,
        own_project: bool,
        excluded: ZoneKey | None,
        least: int,
    ) -> list[tuple[int, ZoneKey, Zone]]:
        """The zones where evicting could make room for the gang, each with the fewest
        GPUs it would need freed at least, from the fewest; those that could not make room
        even by evicting every candidate a request of this kind may are left out."""
        k, pods, t = request.gpus_per_pod, request.pods, request.gpu_type
        zones: list[tuple[int, ZoneKey, Zone]] = []
        for zone_key, zone in searched:
            if zone_key[2] != t or zone_key == excluded or zone_key not in capacity.buckets:
                continue
            here = zone.gpus_by_project.get(request.project, 0)
            ceiling = zone.idle_gpus + here + (0 if own_project else zone.borrowed_gpus)
            if capacity.zone_free[zone_key] + ceiling < request.gpus:
                continue  # even evicting every candidate here would not make room
            if (
                not own_project
                and request.project not in zone.preemptible_projects
                and self.pods_at_most(zone_key, zone, capacity, k, within, rank) < pods
            ):
                continue  # no node mix of candidates here could hold the gang
            if pods == 1:
                short = k - capacity.most_free(zone_key)
            else:
                short = request.gpus - capacity.zone_free[zone_key]
            zones.append((max(1, short, least), zone_key, zone))
        zones.sort(key=lambda z: (z[0], z[1]))
        return zones


class _FreeCounts(Mapping[tuple[str, str], int]):
    """The cycle's free GPUs per schedulable node, read from its capacity as needed."""

    def __init__(self, capacity: Capacity):
        self.capacity = capacity

    def __getitem__(self, key: tuple[str, str]) -> int:
        return self.capacity.free_count(key)

    def __contains__(self, key: object) -> bool:
        return key in self.capacity.nodes

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.capacity.nodes)

    def __len__(self) -> int:
        return len(self.capacity.nodes)
