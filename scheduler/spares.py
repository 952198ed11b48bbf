"""Recovery spares (``Policy.spares``; docs/recovery.md, "Spares"): whole nodes of a zone
held back for jobs restarting after a fault, and lent meanwhile to preemptible work, so
that a restart does not wait in the queue and the spares do not sit idle.

Which nodes (``choose_spares``). Each cycle, for every zone and GPU type given spares, the
first ``n`` of its schedulable nodes whose every GPU is free or runs lendable work (a
preemptible class, or an idle session anyone may reclaim), where no workload stops for
another and no waiting workload's kept placement lies: those holding the most lent GPUs
first (a spare stays where work was lent to it), then in the fleet's order (among empty
nodes the choice does not move from cycle to cycle). A zone short of such nodes has fewer
spares until one empties: a spare a recovering job took is replaced by the next node of
the zone that frees up. Only the ``gpufleet`` mode has spares.

Three steps (``plan_with_spares``):
1. jobs restarting after a fault (``Pending.recovering``) go first, in class then arrival
   order, each onto a zone's spares together with the zone's free GPUs; when those are
   not enough it takes back lent work from the zone's spares — the fewest GPUs that make
   room — which is preempted (``PreemptionCause.SPARE``) however young, and the request
   keeps its placement while that work stops, as any preemptor does;
2. the core plans the rest over the fleet without its spare nodes (as if cordoned:
   ordinary work never lands there, and guarantees are shares of the rest), the
   restarting jobs placed in step 1 holding their GPUs;
3. preemptible requests the core left waiting for room borrow what is free on spares.
Quota caps and per-user caps hold in steps 1 and 3 as in the core.

Invariant: a placement this pass makes uses only GPUs free at that point, or GPUs of its
own victims; each request is decided once (those of step 1 leave the core's queue; step 3
only takes requests the core left waiting for room; nodes under a kept placement are never
spares, so the core keeps every promise).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from .memo import PlanMemo
from .placement import Capacity, FreeIndex, ZoneKey
from .quota import QuotaBook
from .snapshot import (
    Admission,
    Kept,
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
from .waits import Waits

Core = Callable[[SchedulingSnapshot, float, PlanMemo], Plan]
NodeKey = tuple[str, str]  # node name, GPU type

# The first pass's answers that a spare may change: it found no room.
_NO_ROOM = (WaitCause.CAPACITY, WaitCause.RESERVED)
# Preemptible requests tried on spares per cycle: enough to fill a zone's spare nodes,
# bounded when thousands wait.
MAX_LOANS_TRIED = 64


def spares_for(spares: Iterable[tuple[str, int]], zone: ZoneKey) -> int:
    """Spare nodes for a zone: its ``cluster/zone`` entry, else its ``zone`` entry, else
    ``*`` (every zone), else none. Per GPU type of the zone."""
    cluster, name, _ = zone
    table = dict(spares)
    for key in (f"{cluster}/{name}", name, "*"):
        if key in table:
            return table[key]
    return 0


def lendable(workload: Running | Pending, preemptible: Mapping[str, bool]) -> bool:
    """Work that may run on a spare: whatever a recovering job may take back at once."""
    idle = isinstance(workload, Running) and workload.idle_reclaimable
    return idle or preemptible.get(workload.priority, False)


def choose_spares(snapshot: SchedulingSnapshot) -> dict[ZoneKey, tuple[str, ...]]:
    """The spare nodes of each zone this cycle (see the module docstring)."""
    return _survey(snapshot)[0]


def _survey(snapshot: SchedulingSnapshot) -> tuple[dict[ZoneKey, tuple[str, ...]], bool]:
    """The spares, and whether a preemptible request waits (one pass over the queue)."""
    classes = {name for name, yes in snapshot.preemptible.items() if yes}
    # A node runs only lent work when its free GPUs and the lent ones make up all of it;
    # lent work stopping for another request does not count: its GPUs are promised.
    lent: Counter[NodeKey] = Counter()
    for workload in snapshot.running:
        if (
            workload.idle_reclaimable or workload.priority in classes
        ) and workload.stopping_for is None:
            for pod in workload.pods:
                lent[(pod.node, workload.gpu_type)] += len(pod.gpus)
    promised: set[NodeKey] = set()
    lendable_waits = False
    for request in snapshot.queue:
        if request.promised:
            promised.update((pod.node, request.gpu_type) for pod in request.promised)
        elif not lendable_waits and request.priority in classes:
            lendable_waits = True
    eligible: dict[ZoneKey, list[tuple[int, int, str]]] = defaultdict(list)
    for position, node in enumerate(snapshot.nodes):
        key = (node.name, node.gpu_type)
        if node.schedulable and len(node.free) + lent[key] >= node.total and key not in promised:
            zone = (node.cluster, node.zone, node.gpu_type)
            eligible[zone].append((-lent[key], position, node.name))
    chosen = {}
    for zone, nodes in sorted(eligible.items()):
        wanted = spares_for(snapshot.policy.spares, zone)
        if wanted > 0:
            chosen[zone] = tuple(name for _, _, name in sorted(nodes)[:wanted])
    return chosen, lendable_waits


def plan_with_spares(snapshot: SchedulingSnapshot, now: float, memo: PlanMemo, core: Core) -> Plan:
    """Recovering jobs on the spares first, then ``core``'s plan over the fleet without its
    spare nodes and what they took, then loans of what is left on the spares."""
    spares, lendable_waits = _survey(snapshot)
    if not spares:
        return core(snapshot, now, memo)
    spare_pass = _SparePass(snapshot, spares, now, lendable_waits)
    spare_pass.recover()
    first = core(spare_pass.rest_of_fleet(), now, memo)
    spare_pass.lend(first)
    return spare_pass.plan(first)


class _SparePass:
    """One cycle's spare pass. What it reads of the whole fleet (free GPUs, quota usage)
    is built only when a request may use a spare (``_ready``): most cycles of a busy
    fleet have none, and then the pass costs a scan of the queue."""

    def __init__(
        self,
        snapshot: SchedulingSnapshot,
        spares: dict[ZoneKey, tuple[str, ...]],
        now: float,
        lendable_waits: bool,
    ):
        self.snapshot = snapshot
        self.spares = spares
        self.now = now
        self.lendable_waits = lendable_waits
        self.ranks = snapshot.priorities
        self.aside = {(name, zone[2]) for zone, names in spares.items() for name in names}
        self.ready = False
        self.chosen: set[int] = set()  # victims taken this cycle
        self.admissions: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.kept: list[Kept] = []
        self.taken_first: dict[int, tuple[ZoneKey, tuple[Pod, ...]]] = {}  # before the core
        self.recovering_rows: list[Waiting] = []  # those of them waiting for their victims
        self.loaned: set[int] = set()  # requests the core left waiting, lent a spare

    def _ready(self) -> None:
        """The fleet's free GPUs and its quota usage as the core counts it: every
        workload holding GPUs, and the placements kept for preemptors."""
        if self.ready:
            return
        self.ready = True
        snapshot = self.snapshot
        self.pending = {r.id: r for r in snapshot.queue}
        self.capacity = Capacity(FreeIndex(snapshot.nodes))
        self.zone_nodes: dict[ZoneKey, list[NodeKey]] = defaultdict(list)
        for key, zone in self.capacity.zone_of.items():
            self.zone_nodes[zone].append(key)
        schedulable: Counter[str] = Counter()
        for node in snapshot.nodes:
            if node.schedulable and (node.name, node.gpu_type) not in self.aside:
                schedulable[node.gpu_type] += node.total
        counted = [(w.project, w.gpu_type, w.gpus) for w in snapshot.running]
        self.user_used: Counter[tuple[str, str]] = Counter()
        for workload in snapshot.running:
            self.user_used[(workload.project, workload.user)] += workload.gpus
        self.counted = {r.id for r in snapshot.queue if r.promised}
        for request in snapshot.queue:
            if request.promised:
                counted.append((request.project, request.gpu_type, request.gpus))
                self.user_used[(request.project, request.user)] += request.gpus
        self.book = QuotaBook(snapshot.projects, counted, schedulable)

    # ----------------------------------------------------------------- order
    def recover(self) -> None:
        """Jobs restarting after a fault go first, in class then arrival order: each on
        the spares and free GPUs of a zone with spares where it fits, if one does."""
        recovering = [r for r in self.snapshot.queue if r.recovering and not r.promised]
        if recovering:
            self._ready()
        for request in sorted(recovering, key=self._order):
            self._recover(request)

    def rest_of_fleet(self) -> SchedulingSnapshot:
        """What the core plans over: the spare nodes set aside, the GPUs the recovering
        jobs took gone from the others, and those jobs holding them — as workloads that
        are stopping for nobody, so that they count in every quota and are no one's
        victims — rather than in the queue."""
        snapshot = self.snapshot
        taken = self.capacity.free if self.ready else {}
        nodes = tuple(
            replace(n, schedulable=False)
            if (n.name, n.gpu_type) in self.aside
            else replace(n, free=tuple(taken[(n.name, n.gpu_type)]))
            if (n.name, n.gpu_type) in taken
            else n
            for n in snapshot.nodes
        )
        if not self.taken_first:
            return replace(snapshot, nodes=nodes)
        held = tuple(
            Running(
                request.id,
                request.project,
                request.user,
                request.kind,
                request.gpu_type,
                zone[0],
                zone[1],
                pods,
                priority=request.priority,
                started_at=self.now,
                stopping=True,
            )
            for request, (zone, pods) in (
                (self.pending[i], placed) for i, placed in self.taken_first.items()
            )
        )
        return replace(
            snapshot,
            nodes=nodes,
            running=snapshot.running + held,
            queue=tuple(r for r in snapshot.queue if r.id not in self.taken_first),
            changes=None,  # these are not the producer's changes
        )

    def lend(self, first: Plan) -> None:
        """Lend what is free on the spares to the preemptible requests the core left
        waiting for room (once what the core decided is counted)."""
        if not self._may_lend():
            return
        self._ready()
        for workload_id, pods in (
            *((a.workload_id, a.pods) for a in first.admissions),
            *((k.workload_id, k.pods) for k in first.kept),
        ):
            request = self.pending[workload_id]
            self._take_free(request, pods)
            if workload_id not in self.counted:
                self._count(request)
        failed: set[tuple[str, int, int, tuple[tuple[str, str], ...]]] = set()
        loans = sorted(
            (
                self.pending[w.workload_id]
                for w in first.waiting
                if w.cause in _NO_ROOM
                and w.workload_id in self.pending
                and lendable(self.pending[w.workload_id], self.snapshot.preemptible)
            ),
            key=self._order,
        )
        for request in loans[:MAX_LOANS_TRIED]:
            shape = (
                request.gpu_type,
                request.gpus_per_pod,
                request.pods,
                tuple(sorted(request.node_selector.items())),
            )
            if shape in failed or request.avoid_nodes or request.avoid_gpus:
                continue
            if not self._lend(request):
                failed.add(shape)

    def _may_lend(self) -> bool:
        """Whether a preemptible request waits and a spare has a free GPU (cheap: no
        index of the fleet)."""
        if not self.lendable_waits:
            return False
        free = {
            (n.name, n.gpu_type): len(n.free)
            for n in self.snapshot.nodes
            if (n.name, n.gpu_type) in self.aside
        }
        if self.ready:
            free = {key: self.capacity.free_count(key) for key in free}
        return any(free.values())

    def _order(self, request: Pending) -> tuple[int, float, int]:
        return (-self.ranks.get(request.priority, 0), request.created_at, request.id)

    def _refused(self, request: Pending) -> bool:
        """Whether a cap refuses it now: its project's, an enclosing one's, or its user's."""
        if self.book.over_cap(request.project, request.gpu_type, request.gpus) is not None:
            return True
        self.book.path(request.project)  # an undeclared project joins the tree first
        cap = self.book.projects[request.project].per_user_cap
        used = self.user_used[(request.project, request.user)]
        return cap is not None and used + request.gpus > cap

    # ------------------------------------------------------------- deciding
    def _recover(self, request: Pending) -> None:
        """Place a recovering job on a zone's spares and free GPUs, taking lent work back
        from the spares when those are not enough."""
        if self._refused(request):
            return
        zones = [z for z in self.spares if z[2] == request.gpu_type]
        fitting = [
            (self.capacity.zone_free[z], z)
            for z in zones
            if self._placed(request, self._pool(z, request), {}) is not None
        ]
        if fitting:  # the fullest zone where it fits now, as the first pass would choose
            zone = min(fitting)[1]
            pool = self._pool(zone, request)
            pods = self._placed(request, pool, {})
            assert pods is not None
            self._admit(request, zone, pods)
            self.taken_first[request.id] = (zone, pods)
            return
        best: tuple[int, ZoneKey, list[Running]] | None = None
        for zone in zones:
            victims = self._fewest_victims(request, zone)
            if victims is not None:
                evicted = sum(v.gpus for v in victims)
                if best is None or (evicted, zone) < (best[0], best[1]):
                    best = (evicted, zone, victims)
        if best is None:
            return
        _, zone, victims = best
        coming = _coming(victims, self._pool(zone, request))
        pods = self._placed(request, self._pool(zone, request), coming)
        assert pods is not None
        self._take_free(request, pods)
        self._count(request)
        self.chosen.update(v.id for v in victims)
        spares = ", ".join(self.spares[zone])
        for victim in victims:
            self.preemptions.append(
                Preemption(
                    victim.id,
                    request.id,
                    PreemptionCause.SPARE,
                    f"it ran on a recovery spare of {zone[1]} ({spares}), which workload "
                    f"{request.id} needs to restart after a fault",
                )
            )
        self.kept.append(Kept(request.id, pods))
        self.taken_first[request.id] = (zone, pods)
        taken = ", ".join(f"workload {v.id}" for v in victims)
        self.recovering_rows.append(
            Waiting(
                request.id,
                0,  # first in its queue (``_rows``)
                WaitCause.PREEMPTING,
                f"Restarting after a fault on the recovery spares of {zone[1]} ({spares}): "
                f"waiting for the work lent to them to stop ({taken})",
            )
        )

    def _lend(self, request: Pending) -> bool:
        """Lend a preemptible request what is free on the spare nodes of a zone."""
        if self._refused(request):
            return True  # a refusal, not a shape that does not fit
        fitting = []
        for zone, names in self.spares.items():
            if zone[2] == request.gpu_type:
                pool = [(name, zone[2]) for name in names if self._usable(request, name)]
                pods = self._placed(request, pool, {})
                if pods is not None:
                    fitting.append((self.capacity.zone_free[zone], zone, pods))
        if not fitting:
            return False
        _, zone, pods = min(fitting, key=lambda f: (f[0], f[1]))
        self._admit(request, zone, pods)
        self.loaned.add(request.id)
        return True

    # ------------------------------------------------------------- placing
    def _pool(self, zone: ZoneKey, request: Pending) -> list[NodeKey]:
        """The nodes of ``zone`` a recovering request may use: its spares and the rest."""
        return [key for key in self.zone_nodes.get(zone, ()) if self._usable(request, key[0])]

    def _usable(self, request: Pending, name: str) -> bool:
        node = self.capacity.nodes.get((name, request.gpu_type))
        return (
            node is not None
            and name not in request.avoid_nodes
            and all(node.labels.get(k) == v for k, v in request.node_selector.items())
        )

    def _placed(
        self, request: Pending, pool: Sequence[NodeKey], coming: Mapping[NodeKey, list[str]]
    ) -> tuple[Pod, ...] | None:
        """Best fit over free and ``coming`` GPUs of the pool (none the request avoids),
        the coming ones first; None if the gang does not fit. Takes nothing."""
        avoid = request.avoid_gpus
        left: dict[NodeKey, list[str]] = {}
        for key in pool:
            free = [g for g in self._free(key) if g not in avoid]
            left[key] = [g for g in coming.get(key, ()) if g not in avoid] + free
        placed = []
        for _ in range(request.pods):
            fitting = [k for k, gpus in left.items() if len(gpus) >= request.gpus_per_pod]
            if not fitting:
                return None
            key = min(fitting, key=lambda k: (len(left[k]), k))
            gpus, left[key] = left[key][: request.gpus_per_pod], left[key][request.gpus_per_pod :]
            placed.append(Pod(key[0], tuple(gpus)))
        return tuple(placed)

    def _free(self, key: NodeKey) -> list[str]:
        taken = self.capacity.free.get(key)
        return list(taken if taken is not None else self.capacity.nodes[key].free)

    def _fewest_victims(self, request: Pending, zone: ZoneKey) -> list[Running] | None:
        """Lent work on the zone's spares whose GPUs, with the free ones, make room: added
        smallest first until the gang fits, then any the rest make room without dropped
        (largest first). None if all of it would not be enough."""
        spare = set(self.spares[zone])
        candidates = sorted(
            (
                w
                for w in self.snapshot.running
                if w.gpu_type == request.gpu_type
                and not w.stopping
                and w.id not in self.chosen
                and lendable(w, self.snapshot.preemptible)
                and any(p.node in spare for p in w.pods)
            ),
            key=lambda w: (w.gpus, -w.started_at, w.id),
        )
        pool = self._pool(zone, request)
        victims: list[Running] = []
        for candidate in candidates:
            victims.append(candidate)
            if self._placed(request, pool, _coming(victims, pool)) is not None:
                break
        else:
            return None
        for victim in sorted(victims, key=lambda w: -w.gpus):
            rest = [v for v in victims if v is not victim]
            if rest and self._placed(request, pool, _coming(rest, pool)) is not None:
                victims = rest
        return victims

    def _take_free(self, request: Pending, pods: Iterable[Pod]) -> None:
        """Take what of the placement is free (the rest is its victims', still stopping)."""
        for pod in pods:
            key = (pod.node, request.gpu_type)
            free = [g for g in pod.gpus if self.capacity.is_free(key, g)]
            if free:
                self.capacity.take_exact(key, free)

    def _count(self, request: Pending) -> None:
        self.book.add(request.project, request.gpu_type, request.gpus)
        self.user_used[(request.project, request.user)] += request.gpus

    def _admit(self, request: Pending, zone: ZoneKey, pods: tuple[Pod, ...]) -> None:
        p, t = request.project, request.gpu_type
        over_before = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self._take_free(request, pods)
        self._count(request)
        over_after = max(0, self.book.usage(p, t) - self.book.guarantee(p, t))
        self.admissions.append(
            Admission(request.id, zone[0], zone[1], pods, borrowed=over_after - over_before)
        )

    # ------------------------------------------------------------------ plan
    def plan(self, first: Plan) -> Plan:
        """The core's plan with what this pass decided."""
        return Plan(
            first.admissions + tuple(self.admissions),
            first.preemptions + tuple(self.preemptions),
            _Rewritten(lambda: self._rows(first)),
            first.kept + tuple(self.kept),
            first.held,
            spares=self.spares,
        )

    def _rows(self, first: Plan) -> tuple[Waiting, ...]:
        """The core's rows without the loans, after the recovering jobs that wait for
        their victims (first in their queues), positions counted again, and a word on the
        spares for whoever waits for room they hold back."""
        held_back = Counter(zone[2] for zone, names in self.spares.items() for _ in names)
        spare_zones: dict[str, set[str]] = defaultdict(set)
        for zone in self.spares:
            spare_zones[zone[2]].add(zone[1])
        self._ready()
        rows = []
        positions: Counter[tuple[str, str]] = Counter()
        for row in (*self.recovering_rows, *first.waiting):
            if row.workload_id in self.loaned:
                continue
            request = self.pending[row.workload_id]
            queue = (request.project, request.gpu_type)
            positions[queue] += 1
            reason = row.reason
            nodes = held_back.get(request.gpu_type, 0)
            if (
                row.cause in _NO_ROOM
                and nodes
                and not request.recovering
                and not lendable(request, self.snapshot.preemptible)
            ):
                zones = ", ".join(sorted(spare_zones[request.gpu_type]))
                reason = (
                    f"{reason} ({nodes} {request.gpu_type} node{'s' if nodes > 1 else ''} "
                    f"in {zones} {'are' if nodes > 1 else 'is'} held back as "
                    f"{'recovery spares' if nodes > 1 else 'a recovery spare'}, for jobs "
                    "restarting after a fault)"
                )
            rows.append(Waiting(row.workload_id, positions[queue], row.cause, reason))
        return tuple(rows)


class _Rewritten(Waits):
    """A plan's rows, made by ``rewrite`` when first read (a replay reads those of its
    last plan only)."""

    __slots__ = ("_rewrite",)

    def __init__(self, rewrite: Callable[[], tuple[Waiting, ...]]):
        super().__init__(())
        self._rewrite: Callable[[], tuple[Waiting, ...]] | None = rewrite

    def _expanded(self) -> tuple[Waiting, ...]:
        if self._rows is None:
            assert self._rewrite is not None
            self._rows, self._rewrite = self._rewrite(), None
        return self._rows


def _coming(victims: Iterable[Running], pool: Sequence[NodeKey]) -> dict[NodeKey, list[str]]:
    """The GPUs the victims free on the pool's nodes."""
    inside = set(pool)
    coming: dict[NodeKey, list[str]] = defaultdict(list)
    for victim in victims:
        for pod in victim.pods:
            key = (pod.node, victim.gpu_type)
            if key in inside:
                coming[key].extend(pod.gpus)
    return coming
