"""The scheduling core: ``plan(snapshot, now, memo=None) -> Plan``. Pure: plain values in,
decisions out; ``memo`` (``memo.py``) is a cache of the last cycle's indexes and answers
that makes a cycle cost what changed, never what it decides.

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

Head of line. A borrower stopped by a cap holds nothing: later requests of its queue may
start beyond the guarantee as its backfill, which it takes back (``backfill``) once it can
start without them — so a big request is not starved by small ones of its own project,
and the quota it waits for does not idle. A request within its guarantee stopped by an
enclosing cap holds its queue; a queue whose head borrows takes its place in the order
from its first request within the guarantee, decided first. A request stopped by the
per-user cap holds only that user's later requests. The first request of a GPU type that
finds no room and cannot make room holds a zone: the one closest to fitting it, which
later requests of the type leave alone, so it starts as GPUs free up there while the rest
of the fleet keeps filling (backfill).

Preemption (``gpufleet`` mode, ``preemptors.py``). A request that does not fit looks for
victims, simulating first and committing nothing until it found a set that makes the gang
fit in one zone.
Who may be a victim:
- an idle session whose project lets anyone reclaim it (the culler marks it);
- a borrower of another project — a workload beyond its project's guarantee when the
  project's workloads are counted by class, then those in held zones last, then arrival —
  for a request within its own guarantee; for a borrowing request, only a preemptible
  borrower of a lower class;
- a preemptible workload of a lower class in the request's own project;
- for a borrower refused by a cap: its own project's borrowers that started while it
  waited, behind it in the queue (its backfill), wherever they run.
A workload is spared for ``min_run_time_s`` after its start (idle ones aside), longer
after earlier preemptions (``preemption.protected_until``). The victims are the feasible
set with the fewest evicted GPUs, then the least lost work (``eviction.py``), in the zone
where that is cheapest. The request then waits for its victims to be gone (they are
``stopping_for`` it in later snapshots) and asks for no more while they stop. Free GPUs
that other subtrees keep back by lend limits never count, for a placement or a search.

Held zones. Backfill — work the holder could evict once it can start — may use a held
zone's free GPUs, and so may a request within its guarantee when the holder borrows.

Recovery spares. With ``Policy.spares`` the plan is made over the fleet without the
zones' spare nodes, then a second pass places jobs restarting after a fault and lends the
spares to preemptible work (``spares.py``).

Frozen tail. After the first hundred or so decisions of a busy cycle nothing can change any
more: the preemption searches are spent, a zone is held for each type, and no free block
outside it holds the smallest pod waiting (``frozen.py``). The rest of each queue is then
decided queue by queue with the checks that can still fail (limits, quota, never fits, no
room), by request shape; a queue whose requests and numbers are those of last cycle's
tail gets last cycle's answers (``memo.Tail``), a shape whose numbers are the same gets
last cycle's verdict. The decisions are those of deciding one by one
(``tests/unit/test_plan_memo.py``); the reasons carry the frozen state's numbers.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .caps import CapRoom
from .frozen import Frozen, FrozenTails
from .holds import HeldZones, Hold
from .memo import PlanMemo
from .placement import Capacity, ZoneKey
from .preemption import VictimIndex
from .preemptors import Outcome, Preemptors
from .quota import QuotaBook
from .reasons import Reasons
from .snapshot import (
    Admission,
    Kept,
    Mode,
    Pending,
    Plan,
    Pod,
    Preemption,
    Running,
    SchedulingSnapshot,
    WaitCause,
    Waiting,
)
from .spares import plan_with_spares
from .waits import SettledRun, Waits, behind_refusal

_SHAPE = operator.attrgetter("shape")

# Decisions per cycle of the queues that could backfill a held zone, once nothing else
# can change the state: reaching their requests means deciding them one by one.
MAX_BACKFILL_DECISIONS = 64

# Outcomes an identical request would get too, as long as nothing changed.
_REPEATABLE = (WaitCause.QUOTA, WaitCause.USER_CAP, WaitCause.CAPACITY, WaitCause.NEVER_FITS)


def plan(snapshot: SchedulingSnapshot, now: float, memo: PlanMemo | None = None) -> Plan:
    """Decide the cycle. ``memo`` (``memo.py``) carries indexes and answers from the last
    cycle: the plan is the same with it or without it, only cheaper. The caller keeps one
    per stream of snapshots and drops it when unsure what it saw (it resets itself when
    the policy, the priority classes or the project tree change)."""
    if memo is None:
        memo = PlanMemo()
    if snapshot.policy.spares and snapshot.policy.mode is Mode.GPUFLEET:
        return plan_with_spares(snapshot, now, memo, _plan_without_spares)
    return _plan_without_spares(snapshot, now, memo)


def _plan_without_spares(snapshot: SchedulingSnapshot, now: float, memo: PlanMemo) -> Plan:
    memo.update(snapshot, now)
    planner = _Planner(snapshot, now, memo)
    try:
        return planner.run()
    finally:
        # The frozen tails point back at the planner. Without this the cycle's whole
        # working state (thousands of waits, indexes) would wait for a full collection
        # instead of going at once: in a replay, most of the time spent collecting.
        del planner.frozen


@dataclass
class _Queue:
    requests: list[Pending]
    head: int = 0
    # From here on a request within the project's guarantee may still stand behind a
    # borrowing head (``_first_within``; usage only grows in a cycle, so it only moves on).
    scan: int = 0

    @property
    def current(self) -> Pending:
        return self.requests[self.head]


class _Planner(Reasons, CapRoom, HeldZones, Preemptors):
    def __init__(self, snapshot: SchedulingSnapshot, now: float, memo: PlanMemo):
        self.snapshot = snapshot
        self.now = now
        self.memo = memo
        self.policy = snapshot.policy
        self.mode = snapshot.policy.mode
        self.ranks = snapshot.priorities
        assert memo.free_index is not None  # memo.update made it
        self.capacity = Capacity(memo.free_index)
        # The sums over what runs come from the memo; the cycle adds to copies.
        self.user_used: dict[tuple[str, str], int] = defaultdict(int, memo.user_used)
        self.in_flight: dict[int, list[Running]] = memo.in_flight_lists()
        self.book = QuotaBook(
            snapshot.projects,
            ((p, t, gpus) for (p, t), gpus in memo.usage.items()),
            self.capacity.total_by_type,
            memo.quota_limits,
        )
        self.reserved: dict[str, Hold] = {}  # GPU type -> the zone held, and for whom
        # (type, per pod, may use the held zone) -> the fewest pods that failed to fit
        self.failed_shapes: dict[tuple[str, int, bool], int] = {}
        self.subtrees: dict[str, frozenset[str]] = {}
        self.failed_searches: set[tuple[Any, ...]] = set()
        self.searches_left = self.policy.max_preemption_searches
        # Decisions left, once only backfill can change the state, of the queues that
        # could backfill (``_run_queues``): past them backfill waits for the next cycle.
        self.backfill_left = MAX_BACKFILL_DECISIONS
        self.chosen: set[int] = set()
        # (tree node, GPU type) -> GPUs of its subtree's workloads stopping for a
        # preemptor (or chosen as victims this cycle): still counted in the book's usage,
        # but gone by the time a preemptor starts. Made on first use (``_leaving``).
        self.leaving_by_node: dict[tuple[str, str], int] | None = None
        # (tree node, GPU type) whose room a request within its guarantee claimed
        # (``_claim_caps``): what is left there is that request's, not a borrower's.
        self.claimed: set[tuple[str, str]] = set()
        self.victims: VictimIndex | None = None  # brought up to date on the first search
        # Bumped by every change of state; a decision made in the same epoch for an
        # identical request stands (``_decide``), and a queue's order stays valid.
        self.epoch = 0
        self.settled: dict[tuple[Any, ...], tuple[int, WaitCause, str]] = {}
        self.no_room_reasons: dict[tuple[Any, ...], str] = {}
        self.limits = memo.limits  # they change only with the tree or the mode
        self.quota_said: dict[tuple[str, str, bool], str] = {}
        self.admissions: list[Admission] = []
        self.kept: list[Kept] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting | SettledRun] = []
        self.positions: dict[tuple[str, str], int] = defaultdict(int)
        self.smallest: dict[tuple[str, str], int] = {}  # queue -> its smallest request
        self.frozen = FrozenTails(self)  # the rest of every queue once nothing can change

    # ----------------------------------------------------------------- order
    def run(self) -> Plan:
        memo = self.memo
        for project, _ in memo.queues:
            self.book.path(project)  # undeclared projects join the tree first
        self.capped = {n for n, p in self.book.projects.items() if p.per_user_cap is not None}
        # Preemptors first: what their victims free, and the free GPUs they counted on,
        # are theirs — or another request could take them and they would preempt again.
        promising = [
            memo.pending[i] for i in {*memo.promised, *self.in_flight} if i in memo.pending
        ]
        # In the cycle's order (within the guarantee first, then class, then arrival): a
        # victim back in the queue that made room for itself meanwhile must not take the
        # quota its own preemptor counts on.
        kept = {
            r.id
            for r in sorted(promising, key=self._order)
            if self._promised_zone(r) is not None and self._keep_promise(r)
        }
        if self.mode is Mode.FIFO:
            pending = [r for r in self.snapshot.queue if r.id not in kept]
            for request in sorted(pending, key=lambda r: (r.created_at, r.id)):
                self._decide(request)
        else:
            self._run_queues(kept)
        memo.tails, memo.verdicts = self.frozen.tails, self.frozen.verdicts
        return Plan(
            tuple(self.admissions),
            tuple(self.preemptions),
            Waits(self.waiting),
            tuple(self.kept),
            {hold.zone: hold.holder for hold in self.reserved.values()},
        )

    def _run_queues(self, kept: set[int]) -> None:
        queues = {}
        heap: list[tuple[Any, ...]] = []
        pending = self.memo.pending
        with_kept = {(pending[i].project, pending[i].gpu_type) for i in kept}
        for key, requests in self.memo.queues.items():
            if key in with_kept:
                requests = [r for r in requests if r.id not in kept]
                if not requests:
                    continue
            queue = queues[key] = _Queue(requests)
            heap.append((self._queue_order(key, queue), self._order_stamp(key), key))
        heapq.heapify(heap)
        blocked_users: dict[tuple[str, str], int] = {}
        frozen = Frozen(self)
        aside: list[tuple[Any, ...]] = []  # queues that wait while backfill is decided
        while heap or aside:
            still, backfill = frozen.state(heap)
            if still and backfill and heap:
                # Only the queues that could backfill a held zone can still change the
                # state: decide them, in order, before the rest (frozen tails or not: an
                # admission there may use room under a cap the others share).
                if heap[0][2] in backfill:
                    self.backfill_left -= 1
                else:
                    aside.append(heapq.heappop(heap))
                    continue
            elif aside:
                for entry in aside:
                    heapq.heappush(heap, entry)
                aside.clear()
                frozen.seen = None  # the heap it looked at lacked these
                continue
            elif frozen.now(heap):
                self.frozen.decide(heap, queues, blocked_users)
                return
            order, stamp, key = heapq.heappop(heap)
            queue = queues[key]
            fresh_stamp = self._order_stamp(key)
            if stamp != fresh_stamp:  # its path's usage changed since: its place may be later
                fresh = self._queue_order(key, queue)
                if fresh > order:
                    heapq.heappush(heap, (fresh, fresh_stamp, key))
                    continue
            if not still:  # once frozen nothing starts: the order cannot matter
                self._within_first(key, queue)
            elif key in backfill:
                self._backfill_first(key, queue, frozen.entering(key))
            self._next_in_queue(queue, blocked_users)
            if queue.head < len(queue.requests):
                heapq.heappush(heap, (self._queue_order(key, queue), self._order_stamp(key), key))

    def _order_stamp(self, key: tuple[str, str]) -> tuple[int, int]:
        """What a queue's place in the order (``_queue_order``) reads that the cycle
        changes: usage and claims along its project's path (counted per top of the tree),
        and the zones held (a holder's ``_within``; holds are only added in a cycle).
        While it stands, the place stands."""
        return self.book.changes[self.book.path(key[0])[-1]], len(self.reserved)

    def _queue_order(self, key: tuple[str, str], queue: _Queue) -> tuple[Any, ...]:
        """The queue's place in the cycle's order: its head's, or, when the head borrows,
        that of its first request within the project's guarantee — a borrower never
        holds back its project's guaranteed GPUs, not even behind other projects'
        borrowers that would take them meanwhile (under a team's cap)."""
        order = self._order(queue.current)
        if order[0] == 0 or self.mode is Mode.FIFO:
            return order
        within = self._first_within(key, queue)
        return order if within is None else self._order(queue.requests[within])

    def _first_within(self, key: tuple[str, str], queue: _Queue) -> int | None:
        """The index of the queue's first request after its head that fits within the
        project's guarantee, if any."""
        book = self.book
        room = book.guaranteed_of.get(key, 0) - book.used.get(key, 0) - book.claimed.get(key, 0)
        if room <= 0:
            return None
        smallest = self.smallest.get(key)
        if smallest is None:
            smallest = self.smallest[key] = min(
                per_pod * pods for _, _, per_pod, pods, _ in self.memo.queue_shapes[key]
            )
        if smallest > room:
            return None
        requests = queue.requests
        i = max(queue.scan, queue.head + 1)
        while i < len(requests) and requests[i].gpus > room:
            i += 1
        queue.scan = i
        return i if i < len(requests) else None

    def _within_first(self, key: tuple[str, str], queue: _Queue) -> None:
        """Bring the queue's first request within the guarantee before its borrowing
        head (``_queue_order`` put the queue in the order by it)."""
        if self._order(queue.current)[0] == 0:
            return
        within = self._first_within(key, queue)
        if within is None:
            return
        if queue.requests is self.memo.queues.get(key):
            queue.requests = list(queue.requests)  # the memo's: not ours to reorder
        queue.requests.insert(queue.head, queue.requests.pop(within))
        queue.scan = within + 1

    def _backfill_first(
        self, key: tuple[str, str], queue: _Queue, entering: set[tuple[Any, ...]]
    ) -> None:
        """Once only backfill can change the state, bring the queue's first request that
        could enter the held zone (of a shape in ``entering``) before its earlier ones:
        those can start nowhere (no free block outside the held zone fits a pod, and they
        may not enter it), so deciding them first would only spend the cycle's backfill
        decisions (``MAX_BACKFILL_DECISIONS``), and the same ones again next cycle,
        before reaching it. They are decided after it, in their order."""
        requests, head = queue.requests, queue.head
        if not entering or requests[head].shape in entering:
            return
        found = next(
            (i for i in range(head + 1, len(requests)) if requests[i].shape in entering), None
        )
        if found is None:
            return
        if requests is self.memo.queues.get(key):
            queue.requests = requests = list(requests)  # the memo's: not ours to reorder
        requests.insert(head, requests.pop(found))
        queue.scan = head + 1  # what lay between moved up by one

    def _next_in_queue(self, queue: _Queue, blocked_users: dict[tuple[str, str], int]) -> None:
        """Decide the queue's current request, and the later ones that only repeat an
        earlier refusal; a quota refusal of a request within its guarantee decides the
        whole rest of the queue (``_holds_queue``)."""
        request = queue.current
        head = blocked_users.get((request.project, request.user))
        if head is not None:
            self._wait(
                request,
                WaitCause.BEHIND,
                f"Waiting for your earlier request in project {request.project} to start "
                f"first (workload {head})",
            )
        else:
            outcome = self._decide(request)
            if outcome.cause is WaitCause.QUOTA and self._holds_queue(request):
                self._behind_quota_refusal(queue, outcome.reason)
                return
            if outcome.cause is WaitCause.USER_CAP:
                blocked_users[(request.project, request.user)] = request.id
        queue.head += 1
        self._settle_repeats(queue, blocked_users)

    def _holds_queue(self, request: Pending) -> bool:
        """Whether a request refused by a quota holds its queue: only one within its
        project's guarantee (an enclosing cap refused it; it reclaims there). A borrower
        does not: the later requests of its queue may start meanwhile, beyond the
        guarantee as its backfill, which it takes back once it can start
        (``_make_room_under_caps``) — so a large request is not starved by small ones
        of its own project, and the quota it waits for does not idle."""
        return self.book.within_guarantee(request.project, request.gpu_type, request.gpus)

    def _behind_quota_refusal(self, queue: _Queue, reason: str) -> None:
        """The queue's current request, within its guarantee, was refused by an enclosing
        cap: the later ones wait behind it."""
        request = queue.current
        later = queue.head + 1
        requests = queue.requests
        while later < len(requests):
            self._wait(requests[later], WaitCause.BEHIND, behind_refusal(request, reason))
            later += 1
        queue.head = later

    def _settle_repeats(self, queue: _Queue, blocked_users: dict[tuple[str, str], int]) -> None:
        """Settle the later requests of this queue that would only repeat an earlier
        refusal: they change nothing, so the global order does not matter for them
        (positions count within the queue). Stops at the first that needs deciding.

        In a replay where the queues are hundreds long this runs over millions of
        requests. Without a per-user cap (a request's signature is its shape) and node
        selectors, the stretch is found by a scan that runs in C and kept as one
        ``SettledRun``, expanded into rows only if the plan's waits are read
        (``waits.py``). Within it nothing changes the cycle's state (no admission, so
        the refusal epoch holds)."""
        requests, head = queue.requests, queue.head
        if head >= len(requests):
            return
        project, gpu_type = requests[head].project, requests[head].gpu_type
        if (
            project in self.capped
            or self.memo.selectors.get(gpu_type)
            or not self.memo.settled_runs
        ):
            self._settle_repeats_one_by_one(queue, blocked_users)
            return
        settled, epoch = self.settled, self._refusal_epoch
        if epoch == 0:  # no lend limits: every refusal stands for the whole cycle
            stands = settled.__contains__
        else:
            stands = {s for s, seen in settled.items() if seen[0] == epoch}.__contains__
        key = (project, gpu_type)
        if all(map(stands, self.memo.queue_shapes[key])):
            count = len(requests) - head
        else:
            rest = itertools.islice(requests, head, None)
            try:
                count = operator.indexOf(map(stands, map(_SHAPE, rest)), False)
            except ValueError:
                count = len(requests) - head
        if count:  # it ends before the first request with victims stopping for it
            count = min(count, self._first_preemptor(requests, head) - head)
        if not count:
            return
        self.waiting.append(
            SettledRun(requests[head : head + count], self.positions[key], dict(settled))
        )
        self.positions[key] += count
        queue.head = head + count

    def _first_preemptor(self, requests: list[Pending], head: int) -> int:
        """The index of the queue's first request from ``head`` on with victims stopping
        for it (too particular to repeat a refusal), or the queue's length."""
        first = len(requests)
        order, pending = self.memo.queue_order, self.memo.pending
        for wid in self.in_flight:
            request = pending.get(wid)
            if request is None or request.shape[:2] != requests[head].shape[:2]:
                continue
            i = bisect.bisect_left(requests, order(request), lo=head, key=order)
            if i < len(requests) and requests[i].id == wid:
                first = min(first, i)
        return first

    def _settle_repeats_one_by_one(
        self, queue: _Queue, blocked_users: dict[tuple[str, str], int]
    ) -> None:
        """``_settle_repeats`` where a per-user cap or node selectors make each request's
        signature its own: what ``_settled`` and ``_wait`` do for each, inlined. Every
        request of a queue shares its project, so whether a per-user cap applies is
        decided once."""
        requests, head = queue.requests, queue.head
        project, gpu_type = requests[head].project, requests[head].gpu_type
        per_user = project in self.capped
        in_flight, settled, epoch = self.in_flight, self.settled, self._refusal_epoch
        key = (project, gpu_type)
        position = self.positions[key]
        append, make = self.waiting.append, tuple.__new__
        last_signature: tuple[Any, ...] | None = None
        seen: tuple[int, WaitCause, str] | None = None
        for later in itertools.islice(requests, head, None):
            if blocked_users and (project, later.user) in blocked_users:
                break
            if later.particular or later.id in in_flight:
                break  # too particular to repeat a refusal (``_signature``)
            signature = (*later.shape, later.user) if per_user else later.shape
            if signature is not last_signature:
                seen = settled.get(signature)
                if seen is None or seen[0] != epoch:
                    break
                last_signature = signature
            assert seen is not None
            position += 1
            append(make(Waiting, (later.id, position, seen[1], seen[2])))
            head += 1
        self.positions[key] = position
        queue.head = head

    def _order(self, request: Pending) -> tuple[Any, ...]:
        rank = -self.ranks.get(request.priority, 0)
        key = (request.project, request.gpu_type)  # within_guarantee, inlined: hot
        book = self.book
        if book.used.get(key, 0) + book.claimed.get(key, 0) + request.gpus <= (
            book.guaranteed_of.get(key, 0)
        ) or (request.held_zone is not None and self._within(request)):
            return (0, rank, (), request.created_at, request.id)
        if self.mode is Mode.STATIC:
            return (1, rank, (), request.created_at, request.id)
        return (1, rank, self.book.share_key(request.project), request.created_at, request.id)

    # -------------------------------------------------------------- decision
    def _decide(self, request: Pending) -> Outcome:
        """Decide, or repeat the refusal an identical request got earlier in the cycle.

        At 10,000 waiting workloads most decisions are "still no room" for a request like
        one before it. A refusal stands for the rest of the cycle: free GPUs only shrink,
        usage only grows, zones are only held, and a failed or deferred search for victims
        fails again — unless lend limits are set, under which another project's growing
        use can release GPUs it kept back; then a refusal stands only until the next
        admission. (Its reason's numbers may lag the cycle's last admissions; the next
        cycle writes fresh ones.)"""
        refused = self._settled(request)
        if refused is not None:
            return self._wait(request, *refused)
        outcome = self._decide_afresh(request)
        signature = self._signature(request)
        if signature is not None and outcome.cause in _REPEATABLE:
            assert outcome.cause is not None
            self.settled[signature] = (self._refusal_epoch, outcome.cause, outcome.reason)
        return outcome

    def _signature(self, request: Pending) -> tuple[Any, ...] | None:
        """What a decision depends on besides the cycle's state; None: too particular."""
        if request.particular or request.id in self.in_flight:
            return None
        if request.project in self.capped:
            return (*request.shape, request.user)
        return request.shape

    def _settled(self, request: Pending) -> tuple[WaitCause, str] | None:
        """The refusal an identical request got earlier in the cycle, if it still stands."""
        signature = self._signature(request)
        seen = self.settled.get(signature) if signature is not None else None
        if seen is None or seen[0] != self._refusal_epoch:
            return None
        return seen[1], seen[2]

    @property
    def _refusal_epoch(self) -> int:
        return self.epoch if self.book.lends_with_limits else 0

    def _decide_afresh(self, request: Pending) -> Outcome:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        if self.mode is not Mode.FIFO:
            beyond = self._beyond_limits(request)
            if beyond is not None:  # waiting would not help: it must not hold its queue
                return self._wait(request, WaitCause.NEVER_FITS, beyond)
            refusal = self._quota_refusal(request)
            if refusal is not None:
                if not self.capacity.ever_fits(t, k, pods):  # nor may it hold its queue
                    return self._wait(request, WaitCause.NEVER_FITS, self._never_fits(request))
                if self.mode is Mode.GPUFLEET:
                    outcome = self._make_room_under_caps(request)
                    if outcome is not None:
                        return outcome
                    self._claim_caps(request)
                return self._wait(request, WaitCause.QUOTA, refusal)
            over_user_cap = self._user_cap_refusal(request)
            if over_user_cap is not None:
                return self._wait(request, WaitCause.USER_CAP, over_user_cap)
        placed = self._place(request)
        if placed is not None:
            self._admit(request, *placed)
            return Outcome()
        if not self.capacity.ever_fits(t, k, pods):
            return self._wait(request, WaitCause.NEVER_FITS, self._never_fits(request))
        if self.in_flight.get(request.id):
            return self._wait(request, WaitCause.PREEMPTING, self._preempting(request))
        if self.mode is Mode.GPUFLEET:
            outcome = self._make_room(request)
            if outcome is not None:
                return outcome
        return self._no_room(request)

    def _place(self, request: Pending) -> tuple[ZoneKey, tuple[Pod, ...]] | None:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        withheld = self.book.withheld_from(request.project, t) if self.mode is not Mode.FIFO else 0
        if self.capacity.free_by_type[t] - withheld < request.gpus:
            return None
        if request.particular:
            return self.capacity.place_selected(
                t, k, pods, request.node_selector, request.avoid_nodes, request.avoid_gpus
            )
        holder = self.reserved.get(t)
        holds = holder is not None and holder.holder == request.id
        enters = holds or holder is None or self._enters(request, holder)
        failed = (t, k, enters)
        if not holds and self.failed_shapes.get(failed, pods + 1) <= pods:
            return None
        excluded = frozenset() if enters else frozenset([holder.zone])  # type: ignore[union-attr]
        zone = self.capacity.best_zone(t, k, pods, excluded)
        if zone is None:
            if not holds:
                self.failed_shapes[failed] = min(pods, self.failed_shapes.get(failed, pods))
            return None
        return zone, self.capacity.place(zone, k, pods)

    # ---------------------------------------------------------- held zones

    def _admit(self, request: Pending, zone: ZoneKey, pods: tuple[Pod, ...]) -> None:
        p, t = request.project, request.gpu_type
        over_before = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self.book.add(p, t, request.gpus)
        over_after = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self.user_used[(request.project, request.user)] += request.gpus
        self.epoch += 1
        self.admissions.append(
            Admission(request.id, zone[0], zone[1], pods, borrowed=over_after - over_before)
        )

    def _wait(self, request: Pending, cause: WaitCause, reason: str) -> Outcome:
        queue = (request.project, request.gpu_type)
        self.positions[queue] += 1
        self.waiting.append(Waiting(request.id, self.positions[queue], cause, reason))
        return Outcome(cause, reason)

    # --------------------------------------------------------------- reasons

    def _no_room(self, request: Pending) -> Outcome:
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        block = self.capacity.largest_block(t, k, pods)
        within = self.mode is not Mode.FIFO and self.book.within_guarantee(
            request.project, t, request.gpus
        )
        # Per cycle (see _decide on staleness); a particular request's reason is its own.
        said = None if request.particular else (request.project, t, k, pods, within)
        reason = self.no_room_reasons.get(said) if said is not None else None
        if reason is None:
            reason = self._no_room_reason(request, block, within)
            if said is not None:
                self.no_room_reasons[said] = reason
        holder = self.reserved.get(t)
        if holder is None and block is not None and not request.particular:
            closest = self._zone_to_hold(request, within)
            if closest is not None:
                rank = self.ranks.get(request.priority, 0)
                self.reserved[t] = Hold(closest, request.id, within, rank, request.project)
                if within or self._within(request):
                    self.book.claim_guarantee(request.project, t, request.gpus)
                self.epoch += 1
                zone = closest[1]
                return self._wait(
                    request,
                    WaitCause.RESERVED,
                    f"{reason}; you are next for {t}, {zone} is kept for you as GPUs free up",
                )
        return self._wait(request, WaitCause.CAPACITY, reason)
