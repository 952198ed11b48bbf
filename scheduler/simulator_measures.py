"""What the simulator measures beside the replay itself: which jobs the configuration can
never admit, the most GPUs the quota tree lets be held while work waits (the ceiling),
and what each preemption decision evicted against what its preemptor needed.

Pure helpers over plain values; ``simulator.py`` calls them as the replay runs.

- **Never fits** (``beyond_limits``): a request larger than its project may ever hold
  under the policy, even on an empty fleet — more than the tightest guarantee plus
  borrow limit on its project's path (``static``: more than its guarantee), or more than
  its project's per-user cap (each trace job is its own user). ``fifo`` has no quotas.
- **Ceiling** (``QuotaCeiling``): per GPU type, each tree node may hold the smaller of
  its own limit and what its subtree runs and waits for (each waiting request counted up
  to its per-user cap); the fleet's size of the type caps the total. Gang packing, zones
  and lend limits are not counted, so the ceiling is an upper bound on what any scheduler
  could hold under these quotas, and at least what the replay holds. A second figure
  takes off what lend limits keep idle for projects that do not ask for it
  (``kept_back``): still an upper bound, for a scheduler that honours lend limits. A
  third counts waiting requests whole (``permitted_whole``): a project waiting for a
  request larger than its room under its own limit is counted at what it runs plus the
  largest sum of its waiting requests that fits, not at the limit. A fourth takes both
  at once (``permitted_by_quotas``): lend limits counted with waiting requests whole.
- **Idle while waiting, by why** (``idle.idle_by_cause``, shared with the controller's
  ``gpufleet_idle_gpus``): the free GPUs of the types waited for, by ``IdleCause``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .model import ProjectTree
from .quota import QuotaLimits
from .snapshot import Mode, NodeState, Pod

UNLIMITED = math.inf


def _limit(limits: QuotaLimits, mode: Mode, name: str, gpu_type: str) -> float:
    """The most GPUs of the type the node's subtree may hold under the policy."""
    if mode is Mode.FIFO:
        return UNLIMITED
    if mode is Mode.STATIC:  # admits within the guarantee only, which is below every cap
        return limits.guaranteed_of.get((name, gpu_type), 0)
    return limits.caps.get((name, gpu_type), UNLIMITED)


def beyond_limits(
    limits: QuotaLimits, mode: Mode, project: str, gpu_type: str, gpus: int
) -> str | None:
    """Why a request of ``gpus`` can never be admitted under the configuration, or None."""
    if mode is Mode.FIFO:
        return None
    tree = limits.tree
    if mode is Mode.STATIC:
        guaranteed = limits.guaranteed_of.get((project, gpu_type), 0)
        if gpus > guaranteed:
            return (
                f"more than project {project} may ever hold: needs {gpus} × {gpu_type}, "
                f"project {project} is guaranteed {guaranteed} and borrowing is off "
                "(static quotas)"
            )
    else:
        path = (project, *tree.ancestors(project))
        name, ceiling = min(
            ((n, _limit(limits, mode, n, gpu_type)) for n in path), key=lambda named: named[1]
        )
        if gpus > ceiling:
            whose = (
                f"project {project}" if name == project else f"{limits.projects[name].kind} {name}"
            )
            return (
                f"more than {whose} may ever hold: needs {gpus} × {gpu_type}, {whose} may "
                f"never hold more than {int(ceiling)} × {gpu_type} (guarantee plus borrow limit)"
            )
    cap = limits.projects[project].per_user_cap
    if cap is not None and gpus > cap:
        return (
            f"more than one user may hold in project {project}: needs {gpus} × {gpu_type}, "
            f"the per-user cap is {cap} GPUs (each trace job is its own user)"
        )
    return None


class QuotaCeiling:
    """The most GPUs of a type the quota tree lets be held, given what each project runs
    and waits for; kept incrementally (``add``), computed on demand (``permitted``).

    Invariant: ``demand[(project, type)]`` is the GPUs the project's running (and
    stopping) workloads hold plus, for each of its queued requests, its GPUs up to the
    project's per-user cap (``counted``)."""

    def __init__(self, tree: ProjectTree, mode: Mode, capacity: Mapping[str, int]):
        limits = QuotaLimits(tree)
        self.mode = mode
        self.capacity = capacity
        self.parent = {p.name: p.parent for p in tree}
        self.inner = {parent for parent in self.parent.values() if parent is not None}
        # Children before their parents, so one pass sums a subtree before its root.
        depth = {name: len(tree.ancestors(name)) for name in self.parent}
        self.order = sorted(self.parent, key=lambda name: -depth[name])
        self.limit = {
            (name, t): _limit(limits, mode, name, t) for name in self.parent for t in capacity
        }
        self.user_cap = {
            p.name: p.per_user_cap
            for p in tree
            if p.per_user_cap is not None and mode is not Mode.FIFO
        }
        # (node, type) -> (guarantee, lend limit) of the nodes that set a lend limit.
        self.lends: dict[tuple[str, str], tuple[int, int]] = (
            {
                (p.name, t): (limits.guaranteed_of.get((p.name, t), 0), quota.lend_limit)
                for p in tree
                for t, quota in p.quotas.items()
                if quota.lend_limit is not None
            }
            if mode is Mode.GPUFLEET
            else {}
        )
        self.demand: dict[tuple[str, str], int] = defaultdict(int)
        # (project, type) -> how many waiting requests of each counted size: part of the
        # demand, kept apart for ``permitted_whole``.
        self.queued: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)

    def counted(self, project: str, gpus: int) -> int:
        """What a queued request of ``gpus`` adds to its project's demand."""
        cap = self.user_cap.get(project)
        return gpus if cap is None else min(gpus, cap)

    def add(self, project: str, gpu_type: str, gpus: int) -> None:
        """GPUs a project's workloads now hold (negative: no longer)."""
        self.demand[(project, gpu_type)] += gpus

    def enqueue(self, project: str, gpu_type: str, gpus: int) -> None:
        counted = self.counted(project, gpus)
        self.demand[(project, gpu_type)] += counted
        self.queued[(project, gpu_type)][counted] += 1

    def dequeue(self, project: str, gpu_type: str, gpus: int) -> None:
        counted = self.counted(project, gpus)
        self.demand[(project, gpu_type)] -= counted
        sizes = self.queued[(project, gpu_type)]
        sizes[counted] -= 1
        if not sizes[counted]:
            del sizes[counted]

    def permitted(self, gpu_type: str, whole: bool = False) -> float:
        """min(the fleet's GPUs of the type, the sum over top-level nodes of what each may
        hold), a node holding min(its limit, its own demand + its children's). ``whole``:
        ``permitted_whole``."""
        return self._pass(gpu_type, whole)[0]

    def _pass(self, gpu_type: str, whole: bool) -> tuple[float, dict[str, float]]:
        """``permitted``, and each node's own demand as counted (children first)."""
        subtree: dict[str, float] = defaultdict(float)
        own_demand: dict[str, float] = {}
        # Whole, where some node has children (a team's cap): what each node's children's
        # subtrees run, and the sizes they wait for.
        runs_below: dict[str, int] = defaultdict(int)
        queued_below: dict[str, Counter[int]] = {}
        total = 0.0
        demand, limit = self.demand, self.limit
        for name in self.order:
            own = demand.get((name, gpu_type), 0)
            if whole and self.queued.get((name, gpu_type)):
                own = self._whole(name, gpu_type, own, limit[(name, gpu_type)] - subtree[name])
            own_demand[name] = own
            held = min(limit[(name, gpu_type)], own + subtree[name])
            parent = self.parent[name]
            if whole and self.inner:
                runs, sizes = self._subtree_requests(name, gpu_type, runs_below, queued_below)
                room = limit[(name, gpu_type)] - runs
                if name in self.inner and sizes and queued_gpus(sizes) > room:
                    held = min(held, runs + largest_sum(sizes, int(room)))
                if parent is not None:
                    runs_below[parent] += runs
                    if sizes:
                        queued_below.setdefault(parent, Counter()).update(sizes)
            if parent is None:
                total += held
            else:
                subtree[parent] += held
        return min(total, self.capacity.get(gpu_type, 0)), own_demand

    def _subtree_requests(
        self,
        name: str,
        gpu_type: str,
        runs_below: dict[str, int],
        queued_below: dict[str, Counter[int]],
    ) -> tuple[int, Counter[int] | None]:
        """What the node's subtree runs, and the sizes of the requests it waits for (as
        counted), from its own and what its children's passed up (taken from the maps)."""
        own = self.queued.get((name, gpu_type))
        waiting = queued_gpus(own) if own else 0
        runs = self.demand.get((name, gpu_type), 0) - waiting + runs_below.pop(name, 0)
        sizes = queued_below.pop(name, None)
        if own:
            if sizes is None:
                return runs, own  # read only: the parent's count copies it
            sizes.update(own)
        return runs, sizes

    def permitted_whole(self, gpu_type: str) -> float:
        """``permitted`` with each node's waiting requests counted whole: the node's own
        demand is what it runs plus the largest sum of its waiting requests that fits its
        room under its limit (its children's share taken first). A request no scheduler
        could start under the project's own limit until its running work ends is not
        counted in part; nor under an inner node's limit (a team's cap): it holds no more
        than its subtree runs plus the largest sum of the subtree's waiting requests that
        fits its limit (each child's own limit aside: still a bound)."""
        return self.permitted(gpu_type, whole=True)

    def _whole(self, name: str, gpu_type: str, demand: int, room: float) -> int:
        sizes = self.queued[(name, gpu_type)]
        waiting = queued_gpus(sizes)
        runs = demand - waiting
        if runs + waiting <= room:
            return demand
        return runs + largest_sum(sizes, int(room - runs))

    def kept_back(self, gpu_type: str, own_demand: Mapping[str, float] | None = None) -> float:
        """GPUs of the type that lend limits keep idle: for each node with a lend limit,
        its guarantee beyond what its subtree runs and waits for (each node's own part:
        ``own_demand``, by default all of it), less what it lends; nested limits count
        once (the larger), as the core withholds them."""
        if not self.lends:
            return 0.0
        demand: dict[str, float] = defaultdict(float)
        protected: dict[str, float] = defaultdict(float)
        total = 0.0
        for name in self.order:  # children first
            demand[name] += (
                self.demand.get((name, gpu_type), 0) if own_demand is None else own_demand[name]
            )
            lend = self.lends.get((name, gpu_type))
            own = 0.0 if lend is None else max(0.0, lend[0] - demand[name] - lend[1])
            kept = max(own, protected[name])
            parent = self.parent[name]
            if parent is None:
                total += kept
            else:
                demand[parent] += demand[name]
                protected[parent] += kept
        return total

    def permitted_within_lend_limits(self, gpu_type: str) -> float:
        """``permitted``, less what lend limits keep idle for projects that do not ask
        for it: the most any scheduler that honours them could hold."""
        room = self.capacity.get(gpu_type, 0) - self.kept_back(gpu_type)
        return min(self.permitted(gpu_type), max(0.0, room))

    def permitted_by_quotas(self, gpu_type: str) -> float:
        """The quotas' tightest bound here: ``permitted_whole``, less what lend limits
        keep idle when each project's waiting requests count whole — a project can run
        no more than what it runs plus the largest sum of its requests that fits its
        limit, so its lend limit keeps back at least its guarantee beyond that."""
        held, own_demand = self._pass(gpu_type, whole=True)
        room = self.capacity.get(gpu_type, 0) - self.kept_back(gpu_type, own_demand)
        return min(held, max(0.0, room))


def queued_gpus(sizes: Mapping[int, int]) -> int:
    """The GPUs of the requests counted in ``sizes`` (size -> how many)."""
    return sum(size * n for size, n in sizes.items())


def largest_sum(sizes: Mapping[int, int], room: int) -> int:
    """The largest sum of whole items no greater than ``room``, ``sizes`` giving how many
    items there are of each size: a bounded subset sum, on the bits of one integer (bit
    ``i`` set: ``i`` is reachable), each size's count split in powers of two."""
    if room <= 0:
        return 0
    mask = (1 << (room + 1)) - 1
    reach = 1
    for size, count in sizes.items():
        if size > room or size <= 0:
            continue
        count, step = min(count, room // size), 1
        while count > 0:
            take = min(step, count)
            reach = (reach | (reach << (size * take))) & mask
            count -= take
            step *= 2
    return reach.bit_length() - 1


@dataclass(frozen=True)
class PreemptionDecision:
    """One preemptor and the victims one plan stopped for it, measured when the plan was
    applied (its admissions already placed): ``free_gpus`` of its type in the zone where
    it lands, less free GPUs kept for other preemptors; ``need_gpus``: the fewest GPUs
    any preemption for it had to free — for room, in the zone of its type where that is
    least (``pod_need``: whole pods on one node each, victims' sizes not counted), or
    under the caps on its project's path, whichever is more; ``fitted``:
    no cap asked anything of its victims (none taken back as backfill) and its gang
    (whole pods) already fitted the free GPUs of some zone of its type not held for
    another request, so the preemption was not needed for room (it may still have been
    needed for free GPUs that lend limits keep back).
    """

    at_s: float
    job_id: str
    victims: tuple[str, ...]  # trace job ids
    cluster: str
    zone: str
    gpus: int  # the preemptor's
    free_gpus: int
    need_gpus: int
    evicted_gpus: int
    fitted: bool

    @property
    def beyond_need_gpus(self) -> int:
        return max(0, self.evicted_gpus - self.need_gpus)


def free_for(nodes: Iterable[NodeState], others_kept: Iterable[Pod]) -> dict[str, int]:
    """Free GPUs per node, less the ones kept for other workloads."""
    kept = {g for pod in others_kept for g in pod.gpus}
    return {n.name: sum(1 for g in n.free if g not in kept) for n in nodes}


def pod_need(free_and_size: Iterable[tuple[int, int]], gpus_per_pod: int, pods: int) -> int:
    """The fewest GPUs that must be freed in a zone (its nodes' free and total GPUs) for
    ``pods`` pods of ``gpus_per_pod`` to fit, each on one node: the pods that do not fit
    now each take the cheapest remaining completion of a node's pod — its first one costs
    what the node lacks of a whole pod, the next ones a whole pod. None-fitting zones
    (too few slots even empty) give a number larger than any eviction."""
    k = gpus_per_pod
    fitting = 0
    costs: list[int] = []
    for free, size in free_and_size:
        fitting += free // k
        slots = size // k - free // k
        if slots <= 0:
            continue
        costs.append(k - free % k)
        costs.extend([k] * (slots - 1))
    lacking = pods - fitting
    if lacking <= 0:
        return 0
    if len(costs) < lacking:
        return 1 << 30
    return sum(sorted(costs)[:lacking])


def gang_fits(free_per_node: Iterable[int], gpus_per_pod: int, pods: int) -> bool:
    return sum(free // gpus_per_pod for free in free_per_node) >= pods
