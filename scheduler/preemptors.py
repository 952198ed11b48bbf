"""Preemptors in a cycle (``plan._Planner`` mixes this in): a preemptor keeps its promise
— it starts where its victims were stopped, or keeps there what it will need while they
stop — and a request that finds no room makes some, by choosing victims
(``preemption.VictimIndex``) on the fleet or under the caps on its path.

Simulate first, then commit: a search changes nothing until it found victims with which
the gang fits; then the victims are chosen, the free GPUs the gang counts on kept for it,
and the request waits for them (``WaitCause.PREEMPTING``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from .memo import PlanMemo
from .placement import Capacity, ZoneKey
from .preemption import VictimIndex
from .quota import QuotaBook
from .reasons import n_of
from .snapshot import Kept, Pending, Pod, Preemption, PreemptionCause, Running, WaitCause

if TYPE_CHECKING:
    from .holds import Hold


class Outcome(NamedTuple):
    """A decision on a request: admitted (no cause), or why it waits."""

    cause: WaitCause | None = None  # None: admitted
    reason: str = ""


def _gpus_by_node(workloads: Iterable[Running]) -> dict[tuple[str, str], list[str]]:
    gpus: dict[tuple[str, str], list[str]] = defaultdict(list)
    for workload in workloads:
        for pod in workload.pods:
            gpus[(pod.node, workload.gpu_type)].extend(pod.gpus)
    return gpus


class Preemptors:
    """What keeping promises and making room read and keep of the planner."""

    book: QuotaBook
    capacity: Capacity
    memo: PlanMemo
    now: float
    ranks: Mapping[str, int]
    epoch: int
    in_flight: dict[int, list[Running]]
    user_used: dict[tuple[str, str], int]
    reserved: dict[str, Hold]
    claimed: set[tuple[str, str]]
    kept: list[Kept]
    preemptions: list[Preemption]
    chosen: set[int]
    failed_searches: set[tuple[Any, ...]]
    searches_left: int
    victims: VictimIndex | None

    if TYPE_CHECKING:  # the planner's own, and its other parts'

        def _admit(self, request: Pending, zone: ZoneKey, pods: tuple[Pod, ...]) -> None: ...
        def _wait(self, request: Pending, cause: WaitCause, reason: str) -> Outcome: ...
        def _beyond_limits(self, request: Pending) -> str | None: ...
        def _quota_refusal(self, request: Pending) -> str | None: ...
        def _user_cap_refusal(self, request: Pending) -> str | None: ...
        def _refused_by_quota_once_gone(self, request: Pending, victims: list[Running]) -> bool: ...
        def _preempting(self, request: Pending) -> str: ...
        def _victim_reason(
            self, victim: Running, request: Pending, cause: PreemptionCause
        ) -> str: ...
        def _count_leaving(self, victim: Running) -> None: ...
        def _subtree(self, name: str) -> frozenset[str]: ...
        def _excess(self, name: str, gpu_type: str, gpus: int) -> int: ...
        def _outranks(self, request: Pending, hold: Hold) -> bool: ...

    # ------------------------------------------------------------ promises
    def _promised_zone(self, request: Pending) -> ZoneKey | None:
        if request.promised:
            node = request.promised[0].node
            return self.capacity.zone_of.get((node, request.gpu_type))
        victims = self.in_flight.get(request.id)
        if victims:
            return (victims[0].cluster, victims[0].zone, request.gpu_type)
        return None

    def _keep_promise(self, request: Pending) -> bool:
        """Start a preemptor where its victims were stopped, or keep there what it will
        need while they stop. False: the promise cannot be kept (a node of it went away,
        another workload holds a GPU of it, its quota changed): the request is decided
        like any other."""
        zone = self._promised_zone(request)
        if zone is None or zone not in self.capacity.buckets:
            return False
        t = request.gpu_type
        victims = self.in_flight.get(request.id, [])
        if (
            self._beyond_limits(request) is not None
            or self._refused_by_quota_once_gone(request, victims)
            or self._user_cap_refusal(request) is not None  # its user started other work
        ):
            return False
        # It starts only once no cap refuses it as things stand (a victim still stopping
        # still holds its GPUs); until then its placement is kept.
        may_start = self._quota_refusal(request) is None
        if request.promised:
            coming = {g for v in victims for pod in v.pods for g in pod.gpus}
            free_now: dict[tuple[str, str], list[str]] = defaultdict(list)
            for pod in request.promised:
                key = (pod.node, t)
                for gpu in pod.gpus:
                    if self.capacity.is_free(key, gpu):
                        free_now[key].append(gpu)
                    elif gpu not in coming:
                        return False
            for key, gpus in free_now.items():
                self.capacity.take_exact(key, gpus)
            if may_start and sum(len(g) for g in free_now.values()) == request.gpus:
                self._admit(request, zone, request.promised)
                return True
            self._kept(request, request.promised)
        else:
            k, pods = request.gpus_per_pod, request.pods
            usable = self.capacity.free_by_type[t] - self.book.withheld_from(request.project, t)
            fits = self.capacity.pods_fitting(zone, k) >= pods and usable >= request.gpus
            if may_start and fits:
                self._admit(request, zone, self.capacity.place(zone, k, pods))
                return True
            if not victims or not self._keep_for(request, zone, _gpus_by_node(victims)):
                return False
        self._wait(request, WaitCause.PREEMPTING, self._preempting(request))
        return True

    def _keep_for(
        self, request: Pending, zone: ZoneKey, coming: dict[tuple[str, str], list[str]]
    ) -> bool:
        """Keep what the request will need in ``zone`` once ``coming`` GPUs are back."""
        kept = self.capacity.hold_for_gang(zone, request.gpus_per_pod, request.pods, coming)
        if kept is None:
            return False
        self._kept(request, kept)
        return True

    def _kept(self, request: Pending, pods: tuple[Pod, ...]) -> None:
        """Count a kept placement as its project's and user's for the rest of the cycle:
        as good as admitted, the request is not within its guarantee twice."""
        self.kept.append(Kept(request.id, pods))
        self.book.add(request.project, request.gpu_type, request.gpus)
        self.user_used[(request.project, request.user)] += request.gpus
        self.epoch += 1

    # ------------------------------------------------------------ making room
    def _make_room_under_caps(self, request: Pending) -> Outcome | None:
        """A request refused by a cap on its path may still make room under that cap.
        Within its project's guarantee, over an enclosing node's cap (its siblings
        borrowed the rest): the borrowers under that node give back what it needs, for a
        guarantee holds whatever fills the parent's cap. Borrowing: its own project
        gives back what every cap on its path lacks, from its lower preemptible classes
        and its backfill (borrowers that started while it waited, behind it in the
        queue). A cap short only of what workloads already stopping give back needs no
        one else stopped (``_excess``)."""
        p, t, gpus = request.project, request.gpu_type, request.gpus
        if self.book.over_cap(p, t, gpus) is None:
            return None
        within = self.book.within_guarantee(p, t, gpus)
        path = self.book.path(p)
        if not within and any((name, t) in self.claimed for name in path):
            return None  # a request within its guarantee waits for that room, not this one
        quotas = tuple(
            (self._subtree(name), excess)
            for name in path[1 if within else 0 :]
            if (excess := self._excess(name, t, gpus)) > 0
        )
        if not quotas:
            return None
        return self._make_room(request, quotas=quotas, own_project=not within)

    def _make_room(
        self,
        request: Pending,
        quotas: tuple[tuple[frozenset[str] | None, int], ...] = (),
        own_project: bool = False,
    ) -> Outcome | None:
        t, p = request.gpu_type, request.project
        rank = self.ranks.get(request.priority, 0)
        within = self.book.within_guarantee(p, t, request.gpus)
        if self.searches_left <= 0 or request.particular:
            return None
        # Lend limits hold here too: free GPUs other subtrees keep back do not count, so
        # the victims must free what they would have had to give.
        usable = self.capacity.free_by_type[t] - self.book.withheld_from(p, t)
        if usable < request.gpus:
            quotas = (*quotas, (None, request.gpus - usable))
        holder = self.reserved.get(t)
        excluded = None
        if holder is not None and holder[1] != request.id and not self._outranks(request, holder):
            excluded = holder[0]
        memo = (
            p,
            t,
            request.gpus_per_pod,
            request.pods,
            rank,
            within,
            quotas,
            own_project,
            excluded,
            request.preempted_by,
        )
        if memo in self.failed_searches:
            return None
        self.searches_left -= 1
        if self.victims is None:
            self.victims = VictimIndex(self.memo.candidates, self.book, self.ranks, self.now)
        found = self.victims.find(
            request,
            rank,
            within,
            self.capacity,
            quotas=quotas,
            own_project=own_project,
            excluded=excluded,
            chosen=self.chosen,
        )
        if found is None:
            self.failed_searches.add(memo)
            return None
        zone, victims = found
        self.epoch += 1
        # Keep the free GPUs the gang counts on, next to its victims' (simulated) ones.
        kept = self._keep_for(request, zone, _gpus_by_node(v for v, _ in victims))
        assert kept, "the search found victims with which the gang fits"
        for victim, cause in victims:
            self.chosen.add(victim.id)
            self._count_leaving(victim)
            self.preemptions.append(
                Preemption(
                    victim.id, request.id, cause, self._victim_reason(victim, request, cause)
                )
            )
        gpus = sum(v.gpus for v, _ in victims)
        ids = ", ".join(str(v.id) for v, _ in victims)
        return self._wait(
            request,
            WaitCause.PREEMPTING,
            f"Other work is stopping to make room: needs {n_of(request.gpus, t)}, stopping "
            f"workload(s) {ids} to free {gpus} GPU(s)",
        )
