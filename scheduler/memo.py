"""What the planner keeps from one cycle to the next: a cache, never a second source of truth.

``plan(snapshot, now, memo)`` returns exactly what ``plan(snapshot, now)`` returns; the memo
only spares it work. ``plan`` without a memo builds a fresh one, so there is one code path,
and ``tests/unit/test_plan_memo.py`` checks over random multi-cycle worlds that a memo
carried across cycles gives the same plans as a fresh one.

What it keeps, each brought up to date from the next snapshot by comparing it with the
last one (frozen values are replaced, never changed in place, so "changed" is "not the same
object"; an equal new object counts as changed, which is merely slower):
- the running workloads and the sums over them: GPUs per (project, type) and per
  (project, user), the victims stopping for each waiting workload, and the candidates a
  preemption search looks at (``preemption.Candidates``);
- the queue, grouped per (project, GPU type) and kept in queue order, with the sizes
  waiting per type (which tell the planner when nothing more can start, see ``plan.py``);
- the frozen tail of each queue (``Tail``): once a cycle's state can no longer change,
  the rest of a queue is decided by its own requests and a few numbers of the state; when
  those are the same as last cycle, last cycle's answers are the answers;
- what only the tree decides (``quota.QuotaLimits``), and the free GPUs indexed by zone
  and free count (``placement.FreeIndex``, which also keeps what only the nodes' sizes
  decide); a cycle takes GPUs from its own ``Capacity`` over that index.

A snapshot that carries ``Changes`` leading on from the last one the memo saw is followed
by those changes alone (a replay's event, a cycle's few arrivals and completions); any
other snapshot is compared whole, as above.

It is reset — everything rebuilt from the snapshot — when the policy, the priority classes
or the project tree change, and when the clock goes backwards.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import ProjectTree
from .placement import FreeIndex
from .preemption import Candidates
from .quota import QuotaLimits
from .snapshot import (
    Changes,
    Pending,
    Policy,
    Running,
    SchedulingSnapshot,
    WaitCause,
    Waiting,
)

QueueKey = tuple[str, str]  # project, GPU type
# A frozen refusal: what it read of the state, its cause and its reason.
Verdict = tuple[tuple[Any, ...], WaitCause, str]


@dataclass(frozen=True)
class Tail:
    """A queue's frozen tail as decided in a cycle: its requests from the first one decided
    after the state froze, their first position, what the state said about them, and the
    answers. ``index``: the positions in ``waits`` of each request shape decided by its
    verdict (up to the first quota refusal), so that when only some shapes' numbers
    changed only their answers are rebuilt; ``{None: []}`` when some answer was not
    given by a verdict (``frozen.py``)."""

    requests: list[Pending]
    start: int
    context: tuple[Any, ...]
    waits: list[Waiting]
    index: dict[Any, list[int]] = field(compare=False)


class PlanMemo:
    def __init__(self, frozen_tails: bool = True, settled_runs: bool = True) -> None:
        # False: decide every request one by one even once the state froze (for tests
        # that compare the two; the decisions are the same, reasons may show older numbers).
        self.frozen_tails = frozen_tails
        # False: write a row for every repeated refusal at once rather than keep runs of
        # them (``waits.py``; for tests that compare the two: the rows are the same).
        self.settled_runs = settled_runs
        self._reset(None)

    def _reset(self, settings: tuple[Any, ...] | None) -> None:
        self.settings = settings
        self.seen: tuple[object, int] | None = None  # the last snapshot's ``Changes``
        self.now = float("-inf")
        self.running: dict[int, Running] = {}
        self.usage: dict[QueueKey, int] = {}
        self.user_used: dict[tuple[str, str], int] = {}
        # Preemptor -> its victims (stopping for it), by victim id.
        self.in_flight: dict[int, dict[int, Running]] = {}
        self.pending: dict[int, Pending] = {}
        self.queues: dict[QueueKey, list[Pending]] = {}
        self.queue_shapes: dict[QueueKey, Counter[tuple[Any, ...]]] = {}  # shapes in each
        # Per GPU type: how many waiting workloads have each pod size, each size in GPUs,
        # each node selector (counted, not kept) and each promised placement.
        self.pod_sizes: dict[str, Counter[int]] = defaultdict(Counter)
        self.shapes: dict[str, Counter[tuple[int, bool]]] = defaultdict(Counter)
        self.sizes: dict[str, Counter[int]] = defaultdict(Counter)
        self.selectors: Counter[str] = Counter()
        self.promised: set[int] = set()
        self.held_zones: Counter[tuple[str, str, str]] = Counter()  # from ``held_zone``
        self.tails: dict[QueueKey, Tail] = {}
        self.verdicts: dict[tuple[Any, ...], Verdict] = {}  # by project, type, shape
        # Why a request exceeds what its project may ever hold, by (project, type, GPUs).
        self.limits: dict[tuple[str, str, int], str | None] = {}
        self.free_index: FreeIndex | None = None  # brought up to date by changed nodes
        self.quota_limits: QuotaLimits | None = None  # kept while the tree is the same
        policy: Policy | None = settings[0] if settings else None
        self.ranks: dict[str, int] = dict(settings[1]) if settings else {}
        self.candidates = Candidates(
            self.ranks, policy.min_run_time_s if policy is not None else 0.0
        )

    # ----------------------------------------------------------------- update
    def update(self, snapshot: SchedulingSnapshot, now: float) -> None:
        """Bring the memo to ``snapshot``: afterwards it holds what a fresh memo would."""
        settings = (
            snapshot.policy,
            _frozen_map(snapshot.priorities),
            _frozen_map(snapshot.preemptible),
            snapshot.projects,
        )
        follows = self._follows(snapshot.changes)
        if not self._same_settings(settings) or now < self.now:
            self._reset(settings)
            follows = False
        self.now = self.candidates.now = now
        self.free_index = FreeIndex.follow(self.free_index, snapshot.nodes)
        if self.quota_limits is None or self.quota_limits.tree is not snapshot.projects:
            self.quota_limits = QuotaLimits(snapshot.projects)
        changes = snapshot.changes
        if follows and changes is not None:
            self._apply_running(changes.running)
            self._apply_queue(changes.queue)
            follows = len(self.running) == len(snapshot.running) and len(self.pending) == len(
                snapshot.queue
            )  # a producer that missed a change: read the snapshot whole after all
        if not follows:
            self._sync_running(snapshot.running)
            self._sync_queue(snapshot.queue)
        self.candidates.hold(frozenset(self.held_zones))
        self.seen = None if changes is None else (changes.stream, changes.serial)

    def _follows(self, changes: Changes | None) -> bool:
        """Whether ``changes`` lead from the snapshot the memo saw last to this one."""
        return (
            changes is not None
            and self.seen is not None
            and changes.stream is self.seen[0]
            and changes.serial == self.seen[1] + 1
        )

    def _same_settings(self, settings: tuple[Any, ...]) -> bool:
        old = self.settings
        if old is None:
            return False
        policy, ranks, preemptible, tree = settings
        return (
            old[0] == policy
            and old[1] == ranks
            and old[2] == preemptible
            and (old[3] is tree or _same_tree(old[3], tree))
        )

    def _sync_running(self, running: tuple[Running, ...]) -> None:
        before = self.running
        now = {r.id: r for r in running}
        changed = [r for r in running if before.get(r.id) is not r]
        gone = before.keys() - now.keys()
        if not changed and not gone:
            return
        for wid in gone:
            self._drop_running(before[wid])
        for workload in changed:
            self._replace_running(before.get(workload.id), workload)
        self.running = now

    def _apply_running(self, changes: Mapping[int, Running | None]) -> None:
        running = self.running
        for wid, workload in changes.items():
            old = running.get(wid)
            if old is workload:
                continue
            if workload is None:
                if old is not None:
                    self._drop_running(old)
                    del running[wid]
            else:
                running[wid] = workload
                self._replace_running(old, workload)

    def _replace_running(self, old: Running | None, new: Running) -> None:
        if old is not None and _only_progress(old, new):
            self.candidates.swap(old, new)  # a checkpoint: nothing else can differ
            return
        if old is not None:
            self._drop_running(old)
        self._add_running(new)

    def _apply_queue(self, changes: Mapping[int, Pending | None]) -> None:
        pending = self.pending
        for wid, request in changes.items():
            old = pending.get(wid)
            if old is request:
                continue
            if old is not None:
                self._drop_pending(old)
                del pending[wid]
            if request is not None:
                pending[wid] = request
                self._add_pending(request)

    def _add_running(self, r: Running) -> None:
        gpus = r.gpus
        _add(self.usage, (r.project, r.gpu_type), gpus)
        _add(self.user_used, (r.project, r.user), gpus)
        if r.stopping and r.stopping_for is not None:
            self.in_flight.setdefault(r.stopping_for, {})[r.id] = r
        self.candidates.add(r)

    def _drop_running(self, r: Running) -> None:
        gpus = r.gpus
        _add(self.usage, (r.project, r.gpu_type), -gpus)
        _add(self.user_used, (r.project, r.user), -gpus)
        if r.stopping and r.stopping_for is not None:
            victims = self.in_flight[r.stopping_for]
            del victims[r.id]
            if not victims:
                del self.in_flight[r.stopping_for]
        self.candidates.drop(r)

    def _sync_queue(self, queue: tuple[Pending, ...]) -> None:
        before = self.pending
        now = {r.id: r for r in queue}
        changed = [r for r in queue if before.get(r.id) is not r]
        gone = before.keys() - now.keys()
        if not changed and not gone:
            return
        for wid in gone:
            self._drop_pending(before[wid])
        for request in changed:
            old = before.get(request.id)
            if old is not None:
                self._drop_pending(old)
            self._add_pending(request)
        self.pending = now

    def queue_order(self, r: Pending) -> tuple[int, float, int]:
        """A queue's order: priority class (higher first), then arrival."""
        return (-self.ranks.get(r.priority, 0), r.created_at, r.id)

    def _add_pending(self, r: Pending) -> None:
        key = (r.project, r.gpu_type)
        requests = self.queues.get(key)
        if requests is None:
            requests = self.queues[key] = []
            self.queue_shapes[key] = Counter()
        bisect.insort(requests, r, key=self.queue_order)
        self.queue_shapes[key][r.shape] += 1
        self.pod_sizes[r.gpu_type][r.gpus_per_pod] += 1
        self.shapes[r.gpu_type][(r.gpus_per_pod, r.pods > 1)] += 1
        self.sizes[r.gpu_type][r.gpus] += 1
        if r.particular:
            self.selectors[r.gpu_type] += 1
        if r.promised:
            self.promised.add(r.id)
        if r.held_zone is not None:
            self.held_zones[(*r.held_zone, r.gpu_type)] += 1

    def _drop_pending(self, r: Pending) -> None:
        key = (r.project, r.gpu_type)
        requests = self.queues[key]
        i = bisect.bisect_left(requests, self.queue_order(r), key=self.queue_order)
        assert requests[i].id == r.id, "the queue lost its order"
        del requests[i]
        if not requests:
            del self.queues[key]
            del self.queue_shapes[key]
            self.tails.pop(key, None)
        else:
            _count_down(self.queue_shapes[key], r.shape)
        _count_down(self.pod_sizes[r.gpu_type], r.gpus_per_pod)
        _count_down(self.shapes[r.gpu_type], (r.gpus_per_pod, r.pods > 1))
        _count_down(self.sizes[r.gpu_type], r.gpus)
        if r.particular:
            _count_down(self.selectors, r.gpu_type)
        self.promised.discard(r.id)
        if r.held_zone is not None:
            _count_down(self.held_zones, (*r.held_zone, r.gpu_type))

    # ------------------------------------------------------------------ reads
    def in_flight_lists(self) -> dict[int, list[Running]]:
        """Preemptor -> its stopping victims, by victim id."""
        return {
            wid: [victims[v] for v in sorted(victims)] for wid, victims in self.in_flight.items()
        }


def _only_progress(old: Running, new: Running) -> bool:
    """Whether ``new`` is ``old`` with a later checkpoint or snapshot and nothing else: the
    sums and who borrows stay; only the candidates must see the new value (victims are
    ordered by lost work). A stopping workload is also indexed by its preemptor: not
    this way."""
    return (
        not old.stopping
        and not new.stopping
        and old.pods is new.pods
        and old.started_at == new.started_at
        and old.idle_reclaimable == new.idle_reclaimable
        and old.priority == new.priority
        and old.preemptible == new.preemptible
        and old.project == new.project
        and old.user == new.user
        and old.gpu_type == new.gpu_type
        and old.cluster == new.cluster
        and old.zone == new.zone
        and old.kind == new.kind
        and old.preemptions == new.preemptions
        and old.checkpoint_interval_s == new.checkpoint_interval_s
    )


def _frozen_map(mapping: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(mapping.items()))


def _same_tree(old: ProjectTree, new: ProjectTree) -> bool:
    return dict(old.projects) == dict(new.projects)


def _add(sums: dict[Any, int], key: Any, value: int) -> None:
    total = sums.get(key, 0) + value
    if total:
        sums[key] = total
    else:
        sums.pop(key, None)


def _count_down(counter: Counter[Any], key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
