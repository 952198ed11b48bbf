"""Zones held for the first request of a GPU type that found no room (``plan._Planner``
mixes this in): which zone, and who may take its free GPUs meanwhile — backfill the
holder may evict once it can start, or a request that outranks it (docs/scheduler.md,
"Held zones")."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import replace
from typing import NamedTuple

from .memo import PlanMemo
from .placement import Capacity, ZoneKey
from .preemption import VictimIndex, Zone
from .quota import QuotaBook
from .snapshot import Mode, Pending, Plan, SchedulingSnapshot

_NO_CANDIDATES = Zone()  # a zone without candidates: only its free GPUs count
# A hold moves to another zone only when that one would fit at least this fraction of the
# holder's pods more (1/HOLD_MARGIN): borrowing moves between workloads as they come and
# go, and each move would give up what the held zone drained.
HOLD_MARGIN = 4


class Hold(NamedTuple):
    """A zone held for the first request of a GPU type that found no room."""

    zone: ZoneKey
    holder: int
    within: bool  # the holder asked within its project's guarantee
    rank: int  # its class's rank
    project: str


def admits(hold: Hold, within: bool, same_project: bool, lower: bool) -> bool:
    """``HeldZones.may_enter`` from what it depends on: whether the request is within its
    project's guarantee, of the holder's project, and preemptible of a lower class."""
    if within and not hold.within:
        return True
    if same_project:
        return lower
    return not within and (hold.within or lower)


def hand_back_holds(
    queue: MutableMapping[int, Pending], holding: Mapping[int, tuple[str, str]], plan: Plan
) -> dict[int, tuple[str, str]]:
    """The producer's part of a hold: each waiting workload in ``queue`` learns the zone
    the plan holds for it (``Pending.held_zone``), and those ``holding`` named before
    that no longer hold one forget theirs. Returns who holds what now."""
    now = {wid: (cluster, zone) for (cluster, zone, _), wid in plan.held.items()}
    for wid in holding.keys() - now.keys():
        request = queue.get(wid)
        if request is not None and request.held_zone is not None:
            queue[wid] = replace(request, held_zone=None)
    for wid, zone in now.items():
        request = queue.get(wid)
        if request is not None and request.held_zone != zone:
            queue[wid] = replace(request, held_zone=zone)
    return now


class HeldZones:
    """What the held zones read of the planner."""

    snapshot: SchedulingSnapshot
    now: float
    memo: PlanMemo
    mode: Mode
    ranks: Mapping[str, int]
    book: QuotaBook
    capacity: Capacity
    backfill_left: int
    victims: VictimIndex | None
    reserved: dict[str, Hold]  # GPU type -> the zone held this cycle, and for whom

    def _within(self, request: Pending) -> bool:
        """Whether the request is within its project's guarantee counting, for the request
        a zone was held for (``Pending.held_zone``, until another holds the type), only
        its project's work queued before it: what was queued after it (of its class or a
        lower one, or in a held zone) started while it waited for room, as its backfill.
        Read for its place in the cycle's order and for its claim on the guarantee
        (``QuotaBook.claim_guarantee``): its project's later requests then borrow beside
        it, and cannot keep it waiting by taking the guarantee it waits for. Not for what
        it may evict or where others may go: its project already runs its guarantee, and
        another project's guarantee is not kept waiting for that."""
        p, t, gpus = request.project, request.gpu_type, request.gpus
        if self.book.within_guarantee(p, t, gpus):
            return True
        if request.held_zone is None or self.mode is not Mode.GPUFLEET:
            return False
        hold = self.reserved.get(t)
        if hold is not None and hold.holder != request.id:
            return False
        behind = self.memo.candidates.counted_after(
            (p, t), self.ranks.get(request.priority, 0), request.created_at, request.id
        )
        return behind > 0 and self.book.within_guarantee(p, t, gpus - behind)

    def _outranks(self, request: Pending, hold: Hold) -> bool:
        """A request within its guarantee goes before a holder that borrows: it may use
        the held zone, for its free GPUs and its victims, rather than evict elsewhere."""
        return not hold.within and self.book.within_guarantee(
            request.project, request.gpu_type, request.gpus
        )

    def _enters(self, request: Pending, hold: Hold) -> bool:
        """``may_enter``, while the cycle's backfill decisions last (one that outranks
        the holder enters whenever)."""
        if self._outranks(request, hold):
            return True
        return self.backfill_left > 0 and self.may_enter(request.shape, hold)

    def may_enter(self, shape: tuple[str, str, int, int, str], hold: Hold) -> bool:
        """Whether a request of this shape (project, type, pod size, pods, class) may
        take free GPUs of a zone held for another: if it outranks the holder
        (``_outranks``), or as backfill — work the holder may evict once it can start (of
        another project, beyond that project's guarantee, and the holder within its own
        or the request preemptible and of a lower class; of the holder's project,
        preemptible and of a lower class). So a held zone does not idle, and nothing
        that enters it can keep the holder out."""
        project, gpu_type, per_pod, pods, priority = shape
        within = self.book.within_guarantee(project, gpu_type, per_pod * pods)
        return admits(hold, within, project == hold.project, self.lower_than(priority, hold))

    def lower_than(self, priority: str, hold: Hold) -> bool:
        """Whether work of this class is preemptible and of a lower class than the
        holder's."""
        rank = self.ranks.get(priority, 0)
        return self.snapshot.preemptible.get(priority, False) and rank < hold.rank

    def _zone_to_hold(self, request: Pending, within: bool) -> ZoneKey | None:
        """The zone closest to holding the request: the most of its pods fit there once
        the work it may evict there is gone, so that backfill coming and going (once it
        has run the minimum run time) does not move the hold; without preemption, the
        most of its pods fit now."""
        t, k = request.gpu_type, request.gpus_per_pod
        if self.mode is not Mode.GPUFLEET:
            closest = self.capacity.closest_zone(t, k)
            return None if closest is None else closest[0]
        if self.victims is None:
            self.victims = VictimIndex(self.memo.candidates, self.book, self.ranks, self.now)
        rank = self.ranks.get(request.priority, 0)
        # Work still within its protection will be evictable too: counting it keeps the
        # hold off a zone that can never give the request room while one that will soon
        # could (ties between zones, otherwise, when every candidate is young).
        young = self.memo.candidates.young_freeable(within, rank, self.ranks)
        best: tuple[tuple[int, int], ZoneKey] | None = None
        held: tuple[int, int] | None = None
        empty = _NO_CANDIDATES
        for zone in self.capacity.zones_by_type.get(t, ()):
            members = self.victims.zones.get(zone, empty)
            fitting = (
                self.victims.pods_at_most(
                    zone, members, self.capacity, k, within, rank, young.get(zone, {})
                ),
                self.victims.pods_at_most(zone, members, self.capacity, k, within, rank),
            )
            if request.held_zone == zone[:2]:
                held = fitting
            if best is None or fitting > best[0]:
                best = (fitting, zone)
        if best is None:
            return None
        if held is not None and held[0] + max(1, request.pods // HOLD_MARGIN) > best[0][0]:
            return (*request.held_zone, t)  # type: ignore[misc]
        return best[1]
