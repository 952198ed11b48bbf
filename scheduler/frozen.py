"""The frozen tail of a scheduling cycle (``plan.py``): deciding the rest of every queue
at once when nothing the planner does can change the cycle's state any more.

Invariants:
- Frozen (``Frozen``): every preemption search of the cycle is spent (or the mode never
  preempts); for every GPU type waited for, a zone is held for its first in line (or no
  zone has the type); no waiting request has a node selector; and no node outside the
  held zone has as many free GPUs as the smallest pod waiting (or the free GPUs of the
  type are fewer than the smallest request). Then no request can start, search for
  victims or hold a zone, so no decision changes what a later one sees, and each
  decision depends on the state alone, not on the order.
- Once frozen, the state is never changed by this module: it only reads the planner's
  capacity index, quota book and in-flight victims, and appends ``Waiting`` rows.
- A queue's rest decided here is exactly what ``_Planner._next_in_queue`` would decide
  one request at a time (``tests/unit/test_plan_memo.py``,
  ``test_frozen_tails_decide_as_one_by_one``); only a reason's numbers may differ, being
  the frozen state's rather than those of whichever request of the shape came first.
- Last cycle's answers are reused only under equality of everything they read: a queue's
  ``memo.Tail`` when its requests, its first position and its context (its project's
  usage up the tree, the free blocks of its GPU type, the victims stopping for it) are
  equal; a shape's ``memo.Verdict`` when its context (usage view, whether the type is
  known, most pods, largest block) is equal; when only the type's free blocks changed,
  the tail's answers stand except those of the shapes whose verdict changed, unless a
  quota refusal (which moves the positions after it) is involved. Per-user caps and node
  selectors are too particular to compare: such queues and requests go through the
  planner one by one.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Protocol, cast

from .holds import admits
from .memo import PlanMemo, Tail, Verdict
from .placement import Capacity
from .quota import UNLIMITED, QuotaBook
from .snapshot import Mode, Pending, Running, WaitCause, Waiting
from .waits import SettledRun, behind_refusal


class _Queue(Protocol):
    """One queue of the cycle (``plan._Queue``): its requests in order, and the first not
    decided yet."""

    requests: list[Pending]
    head: int

    @property
    def current(self) -> Pending: ...


class _Planner(Protocol):
    """What this module reads of the cycle's planner (``plan._Planner``) and the decisions
    it asks of it. A protocol, so that the planner's module imports this one and not the
    other way round."""

    memo: PlanMemo
    mode: Mode
    book: QuotaBook
    capacity: Capacity
    capped: set[str]
    epoch: int
    searches_left: int
    backfill_left: int
    reserved: dict[str, Any]  # GPU type -> plan.Hold
    in_flight: dict[int, list[Running]]
    settled: dict[tuple[Any, ...], tuple[int, WaitCause, str]]
    no_room_reasons: dict[tuple[Any, ...], str]
    quota_said: dict[tuple[str, str, bool], str]
    waiting: list[Waiting | SettledRun]
    positions: dict[tuple[str, str], int]

    def _order(self, request: Pending) -> tuple[Any, ...]: ...
    def _queue_order(self, key: tuple[str, str], queue: Any) -> tuple[Any, ...]: ...
    def may_enter(self, shape: tuple[str, str, int, int, str], hold: Any) -> bool: ...
    def lower_than(self, priority: str, hold: Any) -> bool: ...
    def _next_in_queue(self, queue: Any, blocked_users: dict[tuple[str, str], int]) -> None: ...
    def _decide(self, request: Pending) -> Any: ...
    def _beyond_limits(self, request: Pending) -> str | None: ...
    def _quota_refusal(self, request: Pending) -> str | None: ...
    def _never_fits(self, request: Pending) -> str: ...
    def _no_room_reason(
        self, request: Pending, block: tuple[int, str] | None, within: bool
    ) -> str: ...


class Frozen:
    """Whether the cycle's state can still change. It cannot once every preemption search
    of the cycle is spent (or the mode never preempts), and, for every GPU type waited
    for, a zone is held for its first in line (or no zone has the type), no waiting
    request has a node selector (those may use the held zone), and no node outside the
    held zone has as many free GPUs as the smallest pod waiting, or the free GPUs of the
    type are fewer than the smallest request: then no request can start, search, or
    hold a zone, so no decision changes what a later one sees. Checked again only after
    something changed."""

    def __init__(self, planner: _Planner):
        self.planner = planner
        self.seen: tuple[int, int, int, bool] | None = None
        self.frozen = False
        self.backfill: set[tuple[str, str]] = set()
        # Queue -> (what its answer read: the hold, its project's usage, the held zone's
        # free GPUs, the refusal epoch; whether it may backfill; the shape that may).
        self.answers: dict[tuple[str, str], tuple[tuple[Any, ...], bool, Any]] = {}

    def now(self, heap: list[tuple[Any, ...]]) -> bool:
        """Whether nothing can change any more but, perhaps, backfill into held zones:
        ``backfill`` then names the queues that could still enter one (the planner
        decides those one by one first; nothing the others do changes the state)."""
        return self.planner.memo.frozen_tails and self.state(heap)[0]

    def state(self, heap: list[tuple[Any, ...]]) -> tuple[bool, set[tuple[str, str]]]:
        """Whether the state is frozen but for backfill, and the queues that could
        backfill; the same with frozen tails or without (the planner counts backfill
        decisions by it either way)."""
        p = self.planner
        state = (p.epoch, p.searches_left, len(p.reserved), p.backfill_left > 0)
        if state != self.seen:
            self.seen = state
            self.backfill = set()
            self.frozen = self._check(heap)
        return self.frozen, self.backfill

    def _check(self, heap: list[tuple[Any, ...]]) -> bool:
        p = self.planner
        if p.mode is Mode.GPUFLEET and p.searches_left > 0:
            return False
        capacity, memo = p.capacity, p.memo
        for gpu_type, pod_sizes in memo.pod_sizes.items():
            if not pod_sizes:
                continue
            if memo.selectors.get(gpu_type):
                return False
            zones = capacity.zones_by_type.get(gpu_type)
            if not zones:
                continue
            if capacity.free_by_type[gpu_type] < min(memo.sizes[gpu_type]):
                if gpu_type in p.reserved or not any(k[1] == gpu_type for *_, k in heap):
                    continue
                return False  # nothing fits, but a refusal may still hold a zone
            held = p.reserved.get(gpu_type)
            if held is None:
                if any(key[1] == gpu_type for *_, key in heap):
                    return False
                continue  # nothing of the type is left to decide
            smallest = min(pod_sizes)
            for zone in zones:
                if capacity.most_free(zone) < smallest:
                    continue
                if zone != held.zone:
                    return False
                self.backfill |= self._may_backfill(gpu_type, held, heap)
        return True

    def _may_backfill(
        self, gpu_type: str, held: Any, heap: list[tuple[Any, ...]]
    ) -> set[tuple[str, str]]:
        """The queues still being decided with a request that could enter the held zone
        as backfill (``plan.may_enter``) and fit there, by the queues' shapes (a few
        hundred, not their requests); a shape refused this cycle whose refusal stands
        cannot. Only a queue's own admissions change whether its shapes may enter (they
        make its project borrow), so no other queue joins these while they are decided."""
        p, capacity = self.planner, self.planner.capacity
        epoch = p.epoch if p.book.lends_with_limits else 0
        queues: set[tuple[str, str]] = set()
        if p.backfill_left <= 0:
            return queues
        # A queue's answer stands while what it read stands: shapes only get refused, so
        # "no" stays "no", and "yes" while its shape is not refused.
        book = p.book
        zone_free = capacity.zone_free.get(held.zone, 0)
        answers = self.answers
        entering = _Entering(p, held, epoch)
        for *_, key in heap:
            if key[1] != gpu_type:
                continue
            used = book.used.get(key, 0) + book.claimed.get(key, 0)
            read = (held, used, zone_free, epoch)
            answer = answers.get(key)
            if answer is not None and answer[0] == read:
                if answer[1]:
                    refused = p.settled.get(answer[2])
                    if refused is None or refused[0] != epoch:
                        queues.add(key)
                        continue
                else:
                    continue
            guarantee_left = book.guaranteed_of.get(key, 0) - used
            found = next((s for s in p.memo.queue_shapes[key] if entering(s, guarantee_left)), None)
            answers[key] = (read, found is not None, found)
            if found is not None:
                queues.add(key)
        return queues

    def entering(self, key: tuple[str, str]) -> set[tuple[Any, ...]]:
        """The shapes of a queue that ``_may_backfill`` named that could enter its type's
        held zone now: the planner decides the first of its requests with one of them
        first (``plan._Planner._backfill_first``)."""
        p = self.planner
        held = p.reserved.get(key[1])
        if held is None:
            return set()
        epoch = p.epoch if p.book.lends_with_limits else 0
        used = p.book.used.get(key, 0) + p.book.claimed.get(key, 0)
        guarantee_left = p.book.guaranteed_of.get(key, 0) - used
        entering = _Entering(p, held, epoch)
        return {s for s in p.memo.queue_shapes[key] if entering(s, guarantee_left)}


class _Entering:
    """Whether a request shape could enter a held zone as backfill now (``plan.may_enter``
    by what it depends on: the guarantee its queue has left and its class) and fit there,
    and is not refused already this cycle. The held zone's room per pod size and the
    classes' answers are kept: a few of each, for thousands of shapes."""

    def __init__(self, planner: _Planner, held: Any, epoch: int):
        self.planner, self.held, self.epoch = planner, held, epoch
        self.fitting: dict[int, int] = {}
        self.lower: dict[str, bool] = {}

    def __call__(self, shape: tuple[Any, ...], guarantee_left: int) -> bool:
        p, held = self.planner, self.held
        refused = p.settled.get(shape)
        if refused is not None and refused[0] == self.epoch:
            return False
        per_pod, pods = shape[2], shape[3]
        room = self.fitting.get(per_pod)
        if room is None:
            room = self.fitting[per_pod] = p.capacity.pods_fitting(held.zone, per_pod)
        if room < pods:
            return False
        below = self.lower.get(shape[4])
        if below is None:
            below = self.lower[shape[4]] = p.lower_than(shape[4], held)
        return admits(held, per_pod * pods <= guarantee_left, shape[0] == held.project, below)


class FrozenTails:
    """The frozen-tail decisions of one cycle, and what they read, for the memo."""

    def __init__(self, planner: _Planner):
        self.p = planner
        self.tails: dict[tuple[str, str], Tail] = {}
        # The numbers frozen refusals read, and the verdicts given, for the memo.
        self.usage_views: dict[tuple[str, str], tuple[int, ...]] = {}
        self.shape_views: dict[tuple[str, int, bool], tuple[Any, ...]] = {}
        self.verdicts: dict[tuple[Any, ...], Verdict] = {}
        self.frozen_said: dict[tuple[Any, ...], tuple[WaitCause, str]] = {}  # by shape
        self.preempting_by_queue: dict[tuple[str, str], tuple[Any, ...]] = {}

    def decide(
        self,
        heap: list[tuple[Any, ...]],
        queues: Mapping[tuple[str, str], _Queue],
        blocked_users: dict[tuple[str, str], int],
    ) -> None:
        """Decide the rest of every queue once nothing can change the cycle's state any
        more (``Frozen``): no request can start, search for victims or hold a zone. Each
        decision then depends on the state, not on the order: the queues are decided one
        after the other (in the order their heads stand), each from its head to its end.

        The refusals remembered so far are dropped first: their reasons' numbers may date
        from before the last admissions, and the answers here must depend on the frozen
        state alone — so that a queue whose requests and whose numbers (its project's
        usage up the tree, the free blocks of its GPU type, the victims stopping for it)
        are those of its tail last cycle gets last cycle's answers without deciding them
        again (``memo.Tail``)."""
        self.p.settled.clear()
        self.p.no_room_reasons.clear()
        self.p.quota_said.clear()
        # In the order deciding one by one would take them (a user blocked by a per-user
        # cap in one queue waits behind in the next).
        order = sorted((self.p._queue_order(key, queues[key]), key) for _, _, key in heap)
        views: dict[str, tuple[Any, ...]] = {}
        previous = self.p.memo.tails
        # The victims stopping for the queue's requests (their reasons name them).
        by_queue: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
        for wid in sorted(self.p.in_flight):
            request = self.p.memo.pending.get(wid)
            if request is not None:
                victims = tuple((v.id, v.gpus) for v in self.p.in_flight[wid])
                by_queue[(request.project, request.gpu_type)].append((wid, victims))
        self.preempting_by_queue = {key: tuple(v) for key, v in by_queue.items()}
        # Queues under a per-user cap go one decision at a time, in the order, as deciding
        # one by one takes them: a user blocked in one of its project's queues waits
        # behind in the others (``blocked_users``), so their decisions depend on it.
        per_user: list[tuple[Any, ...]] = []
        for _, key in order:
            queue = queues[key]
            if key[0] in self.p.capped:
                per_user.append((self.p._queue_order(key, queue), key))
                continue
            rest = queue.requests[queue.head :]
            start = self.p.positions[key]
            context = self._tail_context(key, rest, views, blocked_users)
            tail = previous.get(key)
            if (
                context is not None
                and tail is not None
                and tail.start == start
                and tail.context[0] == context[0]
                and tail.context[2] == context[2]
                and tail.requests == rest
            ):
                if tail.context[1] != context[1]:  # only the type's free blocks changed
                    waits = self._patched(rest, tail)
                    tail = None if waits is None else Tail(rest, start, context, waits, tail.index)
                if tail is not None:
                    self.p.waiting.extend(tail.waits)
                    self.p.positions[key] += len(tail.waits)
                    self.tails[key] = tail
                    continue
            mark = len(self.p.waiting)
            if context is None:
                while queue.head < len(queue.requests):
                    self.p._next_in_queue(queue, blocked_users)
                continue
            index = self._rest(key, rest)
            # ``_rest`` appends rows only: a settled run comes from ``_next_in_queue``.
            rows = cast(list[Waiting], self.p.waiting[mark:])
            self.tails[key] = Tail(rest, start, context, rows, index)
        heapq.heapify(per_user)
        while per_user:
            _, key = heapq.heappop(per_user)
            queue = queues[key]
            self.p._next_in_queue(queue, blocked_users)
            if queue.head < len(queue.requests):
                heapq.heappush(per_user, (self.p._queue_order(key, queue), key))

    def _patched(self, rest: list[Pending], tail: Tail) -> list[Waiting] | None:
        """Last cycle's answers for a queue whose requests, start, usage and victims are
        those of its tail, where only its GPU type's free blocks changed: the answers of
        the shapes whose verdict changed are rebuilt, the others stand. None when that
        could move a position (a quota refusal, which makes the rest wait behind it,
        appears, goes or changes) or the tail has answers not given by a verdict
        (requests with victims stopping for them, or node selectors)."""
        index = tail.index
        if None in index:
            return None
        waits: list[Waiting] | None = None
        old_waits = tail.waits
        make = tuple.__new__  # Waiting's own constructor costs several times more
        for positions in index.values():
            first = old_waits[positions[0]]
            cause, reason = self._outcome(rest[positions[0]])
            if cause is first.cause and reason == first.reason:
                continue
            if cause is WaitCause.QUOTA or first.cause is WaitCause.QUOTA:
                return None
            if waits is None:
                waits = list(old_waits)
            for i in positions:
                waits[i] = make(Waiting, (old_waits[i][0], old_waits[i][1], cause, reason))
        return old_waits if waits is None else waits

    def _rest(self, key: tuple[str, str], rest: list[Pending]) -> dict[Any, list[int]]:
        """Decide a frozen queue's rest (no per-user cap, so no user holds a place) as
        ``_next_in_queue`` would, request by request, with ``_outcome``. The hot
        loop of a cycle at scale: one dictionary read and one tuple per request.

        Returns the index ``_patched`` reads (``memo.Tail``): the positions of each shape
        decided by its verdict (not those waiting behind a quota refusal), or
        ``{None: []}`` when a request was decided otherwise than by its shape's verdict."""
        waiting, in_flight, said = self.p.waiting, self.p.in_flight, self.frozen_said
        append, make = waiting.append, tuple.__new__  # see _patched
        index: dict[Any, list[int]] = {}
        position = self.p.positions[key]
        # After a quota refusal within the guarantee: the row the later requests get
        # (a borrower's refusal holds nothing; ``_Planner._holds_queue``).
        behind: tuple[WaitCause, str] | None = None
        for i, request in enumerate(rest):
            if behind is not None:
                position += 1
                append(make(Waiting, (request.id, position, *behind)))
                continue
            shape = request.shape
            outcome = said.get(shape)
            if outcome is None or request.id in in_flight:
                if request.particular or request.id in in_flight:
                    self.p.positions[key] = position
                    decided = self.p._decide(request)
                    position = self.p.positions[key]
                    assert decided.cause is not None, "nothing starts once frozen"
                    outcome = (decided.cause, decided.reason)
                    index[None] = []
                else:
                    outcome = said[shape] = self._outcome(request)
                    position += 1
                    append(make(Waiting, (request.id, position, *outcome)))
            else:
                position += 1
                append(make(Waiting, (request.id, position, *outcome)))
            positions = index.get(shape)
            if positions is None:
                index[shape] = [i]
            else:
                positions.append(i)
            if outcome[0] is WaitCause.QUOTA and self.p.book.within_guarantee(*key, request.gpus):
                behind = (WaitCause.BEHIND, behind_refusal(request, outcome[1]))
        self.p.positions[key] = position
        return index

    def _outcome(self, request: Pending) -> tuple[WaitCause, str]:
        """A frozen refusal, by what it depends on: project, type and shape (the class
        matters only to searches, which are spent), and a few numbers of the state (see
        ``_verdict_context``): last cycle's stands if those are the same."""
        said = (request.project, request.gpu_type, request.gpus_per_pod, request.pods)
        verdict = self.verdicts.get(said)
        if verdict is None:
            context = self._verdict_context(request)
            verdict = self.p.memo.verdicts.get(said)
            if verdict is None or verdict[0] != context:
                verdict = (context, *self._verdict(request))
            self.verdicts[said] = verdict
        return verdict[1], verdict[2]

    def _verdict(self, request: Pending) -> tuple[WaitCause, str]:
        """``_Planner._decide_afresh`` in a frozen state, where nothing is placed (``Frozen``),
        no search runs and a zone is held for every type the fleet has: the same checks
        in the same order, without those that cannot pass."""
        t, k, pods = request.gpu_type, request.gpus_per_pod, request.pods
        fits = self.p.capacity.ever_fits(t, k, pods)
        if self.p.mode is not Mode.FIFO:
            beyond = self.p._beyond_limits(request)
            if beyond is not None:
                return WaitCause.NEVER_FITS, beyond
            refusal = self.p._quota_refusal(request)
            if refusal is not None:
                if not fits:
                    return WaitCause.NEVER_FITS, self.p._never_fits(request)
                return WaitCause.QUOTA, refusal
        if not fits:
            return WaitCause.NEVER_FITS, self.p._never_fits(request)
        block = self.p.capacity.largest_block(t, k, pods)
        within = self.p.mode is not Mode.FIFO and self.p.book.within_guarantee(
            request.project, t, request.gpus
        )
        return WaitCause.CAPACITY, self.p._no_room_reason(request, block, within)

    def _tail_context(
        self,
        key: tuple[str, str],
        rest: list[Pending],
        views: dict[str, tuple[Any, ...]],
        blocked_users: dict[tuple[str, str], int],
    ) -> tuple[Any, ...] | None:
        """What the frozen decisions on a queue's rest read besides its requests, or None
        when that is too particular to compare (per-user caps: each user's usage)."""
        project, gpu_type = key
        if project in self.p.capped or any(p == project for p, _ in blocked_users):
            return None
        view = views.get(gpu_type)
        if view is None:
            view = views[gpu_type] = self._type_view(gpu_type)
        usage = self._usage_view(project, gpu_type)
        preempting = self.preempting_by_queue.get(key, ())
        return (usage, view, preempting)

    def _usage_view(self, project: str, gpu_type: str) -> tuple[int, ...]:
        """The project's usage, and its ancestors' where they cap it (only then do their
        numbers enter a reason); with lend limits, the free GPUs they keep from it too
        (a reason says so when that is what leaves it short)."""
        view = self.usage_views.get((project, gpu_type))
        if view is None:
            book = self.p.book
            view = tuple(
                book.usage(name, gpu_type)
                for i, name in enumerate(book.path(project))
                if i == 0 or book.cap(name, gpu_type) != UNLIMITED
            )
            claimed = book.claimed.get((project, gpu_type))
            if claimed:  # a holder's claim on the guarantee (``QuotaBook.claim_guarantee``)
                view = (*view, -claimed)
            if book.lends_with_limits and self.p.mode is not Mode.FIFO:
                withheld = book.withheld_from(project, gpu_type)
                view = (*view, -withheld, -self.p.capacity.free_by_type[gpu_type])
            self.usage_views[(project, gpu_type)] = view
        return view

    def _known(self, gpu_type: str) -> bool:
        return gpu_type in self.p.capacity.zones_by_type or any(
            zt == gpu_type for (_, _, zt) in self.p.capacity.totals_by_zone
        )

    def _type_view(self, gpu_type: str) -> tuple[Any, ...]:
        """What a frozen refusal's reason can say about a GPU type's capacity: whether the
        fleet has it, and for every shape waiting the most pods any zone could hold and
        the largest free block it could get."""
        capacity = self.p.capacity
        return (
            self._known(gpu_type),
            tuple(
                (
                    k,
                    multi,
                    capacity.most_pods(gpu_type, k),
                    capacity.largest_block(gpu_type, k, 2 if multi else 1),
                )
                for k, multi in sorted(self.p.memo.shapes[gpu_type])
            ),
        )

    def _verdict_context(self, request: Pending) -> tuple[Any, ...]:
        """What a frozen refusal of the request reads of the state (see ``_tail_context``)."""
        t, k, multi = request.gpu_type, request.gpus_per_pod, request.pods > 1
        usage = self._usage_view(request.project, t)
        shape = self.shape_views.get((t, k, multi))
        if shape is None:
            capacity = self.p.capacity
            shape = self.shape_views[(t, k, multi)] = (
                self._known(t),
                capacity.most_pods(t, k),
                capacity.largest_block(t, k, 2 if multi else 1),
            )
        return (usage, shape)
