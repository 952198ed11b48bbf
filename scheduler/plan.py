"""The scheduling core: ``plan(snapshot, now) -> Plan``. Pure: plain values in, decisions out.

Order. Each (project, GPU type) queue is ordered by priority class, then arrival. Queues
compete through one ordering, re-evaluated lazily as the plan admits:
1. requests that fit within their project's guarantee, by class, then arrival;
2. borrowers (above their guarantee), by class, then fair share (lowest first; see
   ``quota.py``), then arrival.
In ``fifo`` mode there is one queue in arrival order and no quota.

Admission. A request is admitted when every node on its project's path stays within its
cap (guarantee + borrow limit), the user stays within the project's per-user cap, free GPUs
outside other subtrees' lend-limit reserves suffice, and its gang fits in one zone (see
``placement.py``). ``static`` mode admits only within the guarantee.

Head of line. A request stopped by its project's quota holds that queue: later requests of
the same project and GPU type wait behind it (a big request is not starved by small ones
of its own project); a request stopped by the per-user cap holds only that user's later
requests. The first request of a GPU type that finds no room and cannot make room holds a
zone: the one closest to fitting it, which later requests of the type leave alone, so it
starts as GPUs free up there while the rest of the fleet keeps filling (backfill).

Preemption (``gpufleet`` mode). A request that does not fit looks for victims, simulating
first and committing nothing until it found a set that makes the gang fit in one zone.
Who may be a victim:
- an idle session whose project lets anyone reclaim it (the culler marks it);
- a borrower of another project — a workload beyond its project's guarantee when the
  project's workloads are counted by class, then start time — for a request within its
  own guarantee; for a borrowing request, only a preemptible borrower of a lower class;
- a preemptible workload of a lower class in the request's own project.
A workload that started less than ``min_run_time_s`` ago is spared (idle ones aside).
Victims are tried in order: idle sessions, then lowest class, highest share, least lost
work (GPU-seconds since the last checkpoint or snapshot). Victims the gang turns out not to
need are dropped again, so a reclaim for N GPUs evicts no more than it needs. The request
then waits for its victims to be gone (they are ``stopping_for`` it in later snapshots) and
asks for no more while they stop.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .placement import Capacity, ZoneKey
from .quota import QuotaBook
from .snapshot import (
    Admission,
    Mode,
    Pending,
    Plan,
    Pod,
    Preemption,
    PreemptionCause,
    Running,
    SchedulingSnapshot,
    WaitCause,
    Waiting,
)


def plan(snapshot: SchedulingSnapshot, now: float) -> Plan:
    return _Planner(snapshot, now).run()


def _n(gpus: int, gpu_type: str) -> str:
    return f"{gpus} × {gpu_type}"


@dataclass
class _Queue:
    requests: list[Pending]
    head: int = 0

    @property
    def current(self) -> Pending:
        return self.requests[self.head]


@dataclass
class _Outcome:
    cause: WaitCause | None = None  # None: admitted
    reason: str = ""
    victims: tuple[int, ...] = ()


class _Planner:
    def __init__(self, snapshot: SchedulingSnapshot, now: float):
        self.snapshot = snapshot
        self.now = now
        self.policy = snapshot.policy
        self.mode = snapshot.policy.mode
        self.ranks = snapshot.priorities
        self.capacity = Capacity(snapshot.nodes)
        totals: dict[str, int] = defaultdict(int)
        for node in snapshot.nodes:
            if node.schedulable:
                totals[node.gpu_type] += node.total
        self.book = QuotaBook(
            snapshot.projects,
            ((r.project, r.gpu_type, r.gpus) for r in snapshot.running),
            totals,
        )
        self.user_used: dict[tuple[str, str], int] = defaultdict(int)
        self.in_flight: dict[int, list[Running]] = defaultdict(list)
        for running in snapshot.running:
            self.user_used[(running.project, running.user)] += running.gpus
            if running.stopping and running.stopping_for is not None:
                self.in_flight[running.stopping_for].append(running)
        self.reserved: dict[str, tuple[ZoneKey, int]] = {}  # GPU type -> (zone, holder)
        self.failed_shapes: dict[tuple[str, int], int] = {}  # (type, per pod) -> fewest pods
        self.failed_searches: set[tuple[Any, ...]] = set()
        self.searches_left = self.policy.max_preemption_searches
        self.chosen: set[int] = set()
        self.victim_order: dict[str, list[Running]] | None = None
        self.borrowing: set[int] | None = None
        self.admissions: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting] = []
        self.positions: dict[str, int] = defaultdict(int)

    # ----------------------------------------------------------------- order
    def run(self) -> Plan:
        for request in self.snapshot.queue:
            self.book.path(request.project)  # undeclared projects join the tree first
        if self.mode is Mode.FIFO:
            for request in sorted(self.snapshot.queue, key=lambda r: (r.created_at, r.id)):
                self._decide(request)
        else:
            self._run_queues()
        return Plan(tuple(self.admissions), tuple(self.preemptions), tuple(self.waiting))

    def _run_queues(self) -> None:
        grouped: dict[tuple[str, str], list[Pending]] = defaultdict(list)
        for request in self.snapshot.queue:
            grouped[(request.project, request.gpu_type)].append(request)
        queues = {}
        heap: list[tuple[Any, ...]] = []
        for key, requests in grouped.items():
            requests.sort(key=lambda r: (-self.ranks.get(r.priority, 0), r.created_at, r.id))
            queues[key] = _Queue(requests)
            heap.append((self._order(requests[0]), key))
        heapq.heapify(heap)
        blocked_users: dict[tuple[str, str], int] = {}
        while heap:
            order, key = heapq.heappop(heap)
            queue = queues[key]
            request = queue.current
            fresh = self._order(request)
            if fresh > order:  # its project borrowed more meanwhile: take its new place
                heapq.heappush(heap, (fresh, key))
                continue
            head = blocked_users.get((request.project, request.user))
            if head is not None:
                self._wait(
                    request,
                    WaitCause.BEHIND,
                    f"waiting behind your earlier request in project {request.project} "
                    f"(workload {head})",
                )
            else:
                outcome = self._decide(request)
                if outcome.cause is WaitCause.QUOTA:
                    for later in queue.requests[queue.head + 1 :]:
                        self._wait(
                            later,
                            WaitCause.BEHIND,
                            f"waiting behind an earlier request for {request.gpu_type} in "
                            f"project {request.project} (workload {request.id}): "
                            f"{outcome.reason}",
                        )
                    continue
                if outcome.cause is WaitCause.USER_CAP:
                    blocked_users[(request.project, request.user)] = request.id
            queue.head += 1
            if queue.head < len(queue.requests):
                heapq.heappush(heap, (self._order(queue.current), key))

    def _order(self, request: Pending) -> tuple[Any, ...]:
        rank = -self.ranks.get(request.priority, 0)
        if self.book.within_guarantee(request.project, request.gpu_type, request.gpus):
            return (0, rank, (), request.created_at, request.id)
        if self.mode is Mode.STATIC:
            return (1, rank, (), request.created_at, request.id)
        return (1, rank, self.book.share_key(request.project), request.created_at, request.id)

    # -------------------------------------------------------------- decision
    def _decide(self, request: Pending) -> _Outcome:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        if not self.capacity.ever_fits(t, k, pods):
            return self._wait(request, WaitCause.NEVER_FITS, self._never_fits(request))
        if self.mode is not Mode.FIFO:
            refusal = self._quota_refusal(request)
            if refusal is not None:
                # Over its own project's cap, a request may still make room inside the
                # project: its lower classes give back what it needs.
                over = self.book.over_cap(request.project, t, request.gpus)
                if self.mode is Mode.GPUFLEET and over == request.project:
                    excess = self.book.usage(over, t) + request.gpus - self.book.cap(over, t)
                    outcome = self._make_room(request, must_free=int(excess), own_project=True)
                    if outcome is not None:
                        return outcome
                return self._wait(request, WaitCause.QUOTA, refusal)
            project = self.book.projects[request.project]
            cap = project.per_user_cap
            used = self.user_used[(request.project, request.user)]
            if cap is not None and used + request.gpus > cap:
                return self._wait(
                    request,
                    WaitCause.USER_CAP,
                    f"needs {_n(request.gpus, t)}; {request.user} uses {used} of the "
                    f"{cap}-GPU per-user cap in project {request.project}",
                )
        placed = self._place(request)
        if placed is not None:
            self._admit(request, *placed)
            return _Outcome()
        if self.in_flight.get(request.id):
            return self._wait(request, WaitCause.PREEMPTING, self._preempting(request))
        if self.mode is Mode.GPUFLEET:
            outcome = self._make_room(request)
            if outcome is not None:
                return outcome
        return self._no_room(request)

    def _quota_refusal(self, request: Pending) -> str | None:
        t, p = request.gpu_type, request.project
        within = self.book.within_guarantee(p, t, request.gpus)
        used, guaranteed = self.book.usage(p, t), self.book.guarantee(p, t)
        if self.mode is Mode.STATIC and not within:
            return (
                f"needs {_n(request.gpus, t)}; project {p} uses {used}/{guaranteed} "
                f"guaranteed {t} and borrowing is off (static quotas)"
            )
        over = self.book.over_cap(p, t, request.gpus)
        if over is None:
            return None
        room = max(0, int(self.book.borrow_room(p, t)))
        if over == p:
            return (
                f"needs {_n(request.gpus, t)}; project {p} uses {used}/{guaranteed} "
                f"guaranteed {t} and may borrow {max(0, room)} more"
            )
        node = self.book.projects[over]
        return (
            f"needs {_n(request.gpus, t)}; {node.kind} {over} caps its projects at "
            f"{int(self.book.cap(over, t))} × {t} and they use {self.book.usage(over, t)}"
        )

    def _place(self, request: Pending) -> tuple[ZoneKey, tuple[Pod, ...]] | None:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        withheld = self.book.withheld_from(request.project, t) if self.mode is not Mode.FIFO else 0
        if self.capacity.free_by_type[t] - withheld < request.gpus:
            return None
        if request.node_selector:
            return self.capacity.place_selected(t, k, pods, request.node_selector)
        holder = self.reserved.get(t)
        holds = holder is not None and holder[1] == request.id
        if not holds and self.failed_shapes.get((t, k), pods + 1) <= pods:
            return None
        excluded = frozenset([holder[0]]) if holder is not None and not holds else frozenset()
        zone = self.capacity.best_zone(t, k, pods, excluded)
        if zone is None:
            if not holds:
                self.failed_shapes[(t, k)] = min(pods, self.failed_shapes.get((t, k), pods))
            return None
        return zone, self.capacity.place(zone, k, pods)

    def _admit(self, request: Pending, zone: ZoneKey, pods: tuple[Pod, ...]) -> None:
        p, t = request.project, request.gpu_type
        over_before = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self.book.add(p, t, request.gpus)
        over_after = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self.user_used[(request.project, request.user)] += request.gpus
        self.admissions.append(
            Admission(request.id, zone[0], zone[1], pods, borrowed=over_after - over_before)
        )

    def _wait(self, request: Pending, cause: WaitCause, reason: str) -> _Outcome:
        self.positions[request.gpu_type] += 1
        self.waiting.append(Waiting(request.id, self.positions[request.gpu_type], cause, reason))
        return _Outcome(cause, reason)

    # --------------------------------------------------------------- reasons
    def _never_fits(self, request: Pending) -> str:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        if t not in self.capacity.zones_by_type and not any(
            zt == t for (_, _, zt) in self.capacity.totals_by_zone
        ):
            return f"needs {_n(request.gpus, t)}; no node of the fleet has {t}"
        shape = f"{pods} pods × {k}" if pods > 1 else f"{k} on one node"
        return (
            f"needs {_n(request.gpus, t)} ({shape}) in one zone; no zone of the fleet holds "
            f"that many even when empty: ask for fewer GPUs, or for smaller pods"
        )

    def _no_room(self, request: Pending) -> _Outcome:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        where = f"{_n(request.gpus, t)} in one zone" if pods > 1 else f"{_n(k, t)} on one node"
        block = self.capacity.largest_block(t, k, pods)
        if block is None:
            free = f"no schedulable node has {t} right now (cordoned, unhealthy or silent)"
        else:
            free = f"largest free block is {block[0]} in {block[1]}"
        quota = ""
        if self.mode is not Mode.FIFO:
            p = request.project
            used, guaranteed = self.book.usage(p, t), self.book.guarantee(p, t)
            room = self.book.borrow_room(p, t)
            more = "without limit" if room == float("inf") else f"{max(0, int(room))} more"
            if self.mode is Mode.STATIC:
                more = "0 more"
            quota = f"; project {p} uses {used}/{guaranteed} guaranteed and may borrow {more}"
        reason = f"needs {where}; {free}{quota}"
        holder = self.reserved.get(t)
        if holder is None and block is not None and not request.node_selector:
            closest = self.capacity.closest_zone(t, k)
            if closest is not None:
                self.reserved[t] = (closest[0], request.id)
                zone = closest[0][1]
                return self._wait(
                    request,
                    WaitCause.RESERVED,
                    f"{reason}; first in line for {t}: {zone} is held for it as GPUs free up",
                )
        return self._wait(request, WaitCause.CAPACITY, reason)

    def _preempting(self, request: Pending) -> str:
        victims = self.in_flight[request.id]
        gpus = sum(v.gpus for v in victims)
        ids = ", ".join(str(v.id) for v in victims)
        return (
            f"needs {_n(request.gpus, request.gpu_type)}; waiting for {gpus} GPU(s) being "
            f"freed by preempted workload(s) {ids}"
        )

    # ------------------------------------------------------------ preemption
    def _make_room(
        self, request: Pending, must_free: int = 0, own_project: bool = False
    ) -> _Outcome | None:
        t, p = request.gpu_type, request.project
        rank = self.ranks.get(request.priority, 0)
        within = self.book.within_guarantee(p, t, request.gpus)
        memo = (p, t, request.gpus_per_pod, request.pods, rank, within, must_free, own_project)
        if memo in self.failed_searches or self.searches_left <= 0 or request.node_selector:
            return None
        self.searches_left -= 1
        found = self._search(request, rank, within, must_free, own_project)
        if found is None:
            self.failed_searches.add(memo)
            return None
        victims = found
        for victim, cause in victims:
            self.chosen.add(victim.id)
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
            f"needs {_n(request.gpus, t)}; stopping workload(s) {ids} to free {gpus} GPU(s)",
        )

    def _victim_reason(self, victim: Running, request: Pending, cause: PreemptionCause) -> str:
        who = f"workload {request.id} of project {request.project}"
        if cause is PreemptionCause.IDLE:
            return f"idle; its GPUs were reclaimed for {who}"
        if cause is PreemptionCause.GUARANTEE:
            return (
                f"it ran on GPUs borrowed beyond project {victim.project}'s guarantee, which "
                f"{who} needed within its own guarantee"
            )
        if cause is PreemptionCause.PRIORITY:
            return f"preempted by higher-priority ({request.priority}) {who}"
        return (
            f"it ran on borrowed GPUs and {who} has a higher priority class "
            f"({request.priority} over {victim.priority})"
        )

    def _eligible(
        self, victim: Running, request: Pending, rank: int, within: bool
    ) -> PreemptionCause | None:
        if victim.idle_reclaimable:
            return PreemptionCause.IDLE
        if victim.started_at + self.policy.min_run_time_s > self.now:
            return None
        victim_rank = self.ranks.get(victim.priority, 0)
        if victim.project == request.project:
            if victim.preemptible and victim_rank < rank:
                return PreemptionCause.PRIORITY
            return None
        assert self.borrowing is not None
        if victim.id not in self.borrowing:
            return None
        if within:
            return PreemptionCause.GUARANTEE
        if victim.preemptible and victim_rank < rank:
            return PreemptionCause.BORROWER_PRIORITY
        return None

    def _prepare_victims(self) -> dict[str, list[Running]]:
        """Once per cycle, on the first search: victim order per GPU type, and which
        running workloads are borrowers."""
        self.borrowing = set()
        by_project: dict[tuple[str, str], list[Running]] = defaultdict(list)
        for running in self.snapshot.running:
            if not running.stopping:
                by_project[(running.project, running.gpu_type)].append(running)
        for (project, gpu_type), workloads in by_project.items():
            workloads.sort(key=lambda r: (-self.ranks.get(r.priority, 0), r.started_at, r.id))
            guaranteed = self.book.guarantee(project, gpu_type)
            counted = 0
            for running in workloads:
                counted += running.gpus
                if counted > guaranteed:
                    self.borrowing.add(running.id)
        order: dict[str, list[Running]] = defaultdict(list)
        for workloads in by_project.values():
            for running in workloads:
                order[running.gpu_type].append(running)
        for workloads in order.values():
            workloads.sort(key=self._victim_key)
        return order

    def _victim_key(self, victim: Running) -> tuple[Any, ...]:
        share = self.book.share_key(victim.project)
        lost = victim.gpus * (self.now - max(victim.started_at, victim.last_progress_at or 0.0))
        return (
            not victim.idle_reclaimable,
            self.ranks.get(victim.priority, 0),
            tuple(-s for s in share),
            lost,
            victim.id,
        )

    def _search(
        self, request: Pending, rank: int, within: bool, must_free: int, own_project: bool
    ) -> list[tuple[Running, PreemptionCause]] | None:
        if self.victim_order is None:
            self.victim_order = self._prepare_victims()
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        holder = self.reserved.get(t)
        by_zone: dict[ZoneKey, list[tuple[Running, PreemptionCause]]] = defaultdict(list)
        for victim in self.victim_order.get(t, ()):
            if victim.id in self.chosen or (own_project and victim.project != request.project):
                continue
            zone = (victim.cluster, victim.zone, t)
            if holder is not None and holder[0] == zone and holder[1] != request.id:
                continue
            if zone not in self.capacity.buckets:
                continue
            cause = self._eligible(victim, request, rank, within)
            if cause is not None:
                by_zone[zone].append((victim, cause))
        best: tuple[tuple[Any, ...], list[tuple[Running, PreemptionCause]]] | None = None
        for zone, candidates in by_zone.items():
            victims = self._fewest_victims(zone, candidates, k, pods, must_free)
            if victims is None:
                continue
            cost = (
                sum(1 for _, c in victims if c is not PreemptionCause.IDLE),
                sum(v.gpus for v, _ in victims),
                zone,
            )
            if best is None or cost < best[0]:
                best = (cost, victims)
        return None if best is None else best[1]

    def _fewest_victims(
        self,
        zone: ZoneKey,
        candidates: list[tuple[Running, PreemptionCause]],
        per_pod: int,
        pods: int,
        must_free: int,
    ) -> list[tuple[Running, PreemptionCause]] | None:
        """Victims in order until the gang fits (and, for a request over its project's
        cap, until ``must_free`` GPUs of the project come back), then without those it
        turns out not to need."""
        free: dict[tuple[str, str], int] = {}
        fitting = self.capacity.pods_fitting(zone, per_pod)
        chosen: list[tuple[Running, PreemptionCause]] = []

        def release(victim: Running, sign: int) -> int:
            change = 0
            for pod in victim.pods:
                key = (pod.node, zone[2])
                if key not in self.capacity.nodes:
                    continue  # on an unschedulable node: freeing it gives nothing usable
                before = free.get(key, self.capacity.free_count(key))
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
        # Drop, latest first, every victim the gang turns out not to need.
        for item in reversed(chosen[:-1]):
            lost = release(item[0], -1)
            if fitting + lost >= pods and freed - item[0].gpus >= must_free:
                fitting += lost
                freed -= item[0].gpus
                chosen.remove(item)
            else:
                release(item[0], +1)
        return chosen
