"""Where a gang fits: free GPUs per node, grouped by zone, for one scheduling cycle.

A workload's pods all land in one cluster and zone, or none do. Inside a zone each pod goes
to the node with the fewest free GPUs that still holds it (best fit), so partly used nodes
fill first and whole nodes stay free for the pods that need a whole node. Among zones the
fullest one that fits wins, for the same reason at a larger scale.

The index keeps, per zone, its nodes bucketed by free-GPU count, so "do p pods of k GPUs
fit in this zone" costs one pass over at most (GPUs per node + 1) buckets.
Free GPUs only shrink during a cycle (GPUs of stopping workloads come back between
cycles, once those are gone): a shape that failed stays failed for the rest of the cycle.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, is_not

from .snapshot import NodeState, Pod

ZoneKey = tuple[str, str, str]  # cluster, zone, GPU type


_NODE_SIZE = attrgetter("cluster", "zone", "gpu_type", "total")


class FleetShape:
    """What the fleet could ever hold, whatever runs and whatever is cordoned: every node's
    GPUs by zone, and the most pods of a size a zone could hold. It changes only when
    nodes come, go or change size, so a memo keeps it across cycles (``of``)."""

    def __init__(self, nodes: Sequence[NodeState]):
        self.sizes = tuple(map(_NODE_SIZE, nodes))
        totals: dict[ZoneKey, Counter[int]] = defaultdict(Counter)
        for cluster, zone, gpu_type, total in self.sizes:
            totals[(cluster, zone, gpu_type)][total] += 1
        self.totals_by_zone: dict[ZoneKey, Counter[int]] = totals
        self._most: dict[tuple[str, int], int] = {}

    @classmethod
    def of(cls, nodes: Sequence[NodeState], last: FleetShape | None) -> FleetShape:
        """``last`` if the nodes have the sizes it was made from, else a new one."""
        if last is not None and last.sizes == tuple(map(_NODE_SIZE, nodes)):
            return last
        return cls(nodes)

    def most_pods(self, gpu_type: str, per_pod: int) -> int:
        """The most pods of this size any zone of the fleet could hold, empty and healthy."""
        most = self._most.get((gpu_type, per_pod))
        if most is None:
            most = self._most[(gpu_type, per_pod)] = max(
                (
                    sum(nodes * (total // per_pod) for total, nodes in totals.items())
                    for (_, _, zone_type), totals in self.totals_by_zone.items()
                    if zone_type == gpu_type
                ),
                default=0,
            )
        return most


class FreeIndex:
    """The fleet's free GPUs as of one snapshot, indexed the way a cycle's ``Capacity``
    reads them: per zone, the schedulable nodes bucketed by free-GPU count.

    A memo keeps it across cycles and brings it to the next snapshot by the nodes that
    changed (``follow``: a replay's event changes a few of 48, a cycle a few hundred of
    2,000), instead of indexing every node again. A ``Capacity`` works over it and copies
    a zone before taking from it, so the index changes only in ``follow``.

    Invariant: it equals an index built afresh from the same nodes, down to the order of
    the nodes inside a bucket (their order in the snapshot), which decides where a pod
    goes among equally free nodes (``Capacity.place``)."""

    def __init__(self, nodes: Sequence[NodeState], shape: FleetShape | None = None):
        self.seen = tuple(nodes)
        self.shape = FleetShape.of(self.seen, shape)
        self.position = {(n.name, n.gpu_type): i for i, n in enumerate(self.seen)}
        self.nodes: dict[tuple[str, str], NodeState] = {}
        self.zone_of: dict[tuple[str, str], ZoneKey] = {}
        # zone -> free count -> nodes with that many free (dicts as ordered sets)
        self.buckets: dict[ZoneKey, dict[int, dict[tuple[str, str], None]]] = {}
        self.zone_free: dict[ZoneKey, int] = {}
        self.zones_by_type: dict[str, list[ZoneKey]] = {}
        self.free_by_type: dict[str, int] = {}
        self.total_by_type: dict[str, int] = {}  # schedulable GPUs
        self._zone_nodes: Counter[ZoneKey] = Counter()  # schedulable nodes per zone
        self._type_nodes: Counter[str] = Counter()
        for node in self.seen:
            self._count(node, None)

    @classmethod
    def follow(cls, last: FreeIndex | None, nodes: Sequence[NodeState]) -> FreeIndex:
        """The index of ``nodes``: ``last`` brought up to date where only some nodes were
        replaced (frozen values: a node that changed is another object), else a new one."""
        if last is None or len(last.seen) != len(nodes):
            return cls(nodes, last.shape if last is not None else None)
        seen = last.seen
        changed = list(compress(range(len(nodes)), map(is_not, seen, nodes)))
        if not changed:
            return last
        if 4 * len(changed) > len(nodes):
            return cls(nodes, last.shape)
        if any(
            (seen[i].name, seen[i].gpu_type) != (nodes[i].name, nodes[i].gpu_type) for i in changed
        ):
            return cls(nodes, last.shape)  # the fleet itself changed: positions moved
        if any(_NODE_SIZE(seen[i]) != _NODE_SIZE(nodes[i]) for i in changed):
            last.shape = FleetShape(nodes)
        touched: set[tuple[ZoneKey, int]] = set()
        for i in changed:
            last._uncount(seen[i])
            last._count(nodes[i], touched)
        # A node that moved to another bucket went to its end: put it back in its place.
        position = last.position.__getitem__
        for zone, free in touched:
            by_count = last.buckets.get(zone)  # gone if a later change emptied the zone
            if by_count is not None and len(by_count[free]) > 1:
                by_count[free] = dict.fromkeys(sorted(by_count[free], key=position))
        last.seen = tuple(nodes)
        return last

    def _count(self, node: NodeState, touched: set[tuple[ZoneKey, int]] | None) -> None:
        if not node.schedulable:
            return
        gpu_type, zone, key, free = _indexed_as(node)
        self.nodes[key] = node
        self.zone_of[key] = zone
        by_count = self.buckets.get(zone)
        if by_count is None:
            by_count = self.buckets[zone] = defaultdict(dict)
            self.zone_free[zone] = 0
            bisect.insort(self.zones_by_type.setdefault(gpu_type, []), zone)
        by_count[free][key] = None
        if touched is not None:
            touched.add((zone, free))
        self.zone_free[zone] += free
        self._zone_nodes[zone] += 1
        self._type_nodes[gpu_type] += 1
        self.free_by_type[gpu_type] = self.free_by_type.get(gpu_type, 0) + free
        self.total_by_type[gpu_type] = self.total_by_type.get(gpu_type, 0) + node.total

    def _uncount(self, node: NodeState) -> None:
        if not node.schedulable:
            return
        gpu_type, zone, key, free = _indexed_as(node)
        del self.nodes[key], self.zone_of[key], self.buckets[zone][free][key]
        self.zone_free[zone] -= free
        self.free_by_type[gpu_type] -= free
        self.total_by_type[gpu_type] -= node.total
        self._zone_nodes[zone] -= 1
        if not self._zone_nodes[zone]:  # as if never indexed, like a fresh index
            del self.buckets[zone], self.zone_free[zone], self._zone_nodes[zone]
            self.zones_by_type[gpu_type].remove(zone)
            if not self.zones_by_type[gpu_type]:
                del self.zones_by_type[gpu_type]
        self._type_nodes[gpu_type] -= 1
        if not self._type_nodes[gpu_type]:
            del self.free_by_type[gpu_type], self.total_by_type[gpu_type]
            del self._type_nodes[gpu_type]


def _indexed_as(node: NodeState) -> tuple[str, ZoneKey, tuple[str, str], int]:
    """A node's GPU type, zone, key and free-GPU count in the index."""
    return (
        node.gpu_type,
        (node.cluster, node.zone, node.gpu_type),
        (node.name, node.gpu_type),
        len(node.free),
    )


@dataclass(frozen=True)
class Reach:
    """What a particular request (``Pending.particular``) could get now, for its reason
    (``Capacity.reach``)."""

    # As ``Capacity.largest_block`` gives it, over the nodes and GPUs the request may use.
    block: tuple[int, str] | None
    # The node (one pod) or zone (a gang) whose free GPUs would hold it but for nodes
    # and GPUs it avoids, and those: None when what it avoids keeps it from nothing.
    avoided_at: str | None = None
    free_there: int = 0  # free GPUs of its type on that node (one pod)
    avoided_nodes: tuple[str, ...] = ()
    avoided_gpus: tuple[str, ...] = ()


class Capacity:
    """One cycle's free GPUs: what it takes comes off here, never off the ``FreeIndex`` it
    reads (a zone's buckets are copied before the first take from it)."""

    def __init__(self, nodes: FreeIndex | Sequence[NodeState], shape: FleetShape | None = None):
        index = nodes if isinstance(nodes, FreeIndex) else FreeIndex(nodes, shape)
        self.shape = index.shape
        self.totals_by_zone = self.shape.totals_by_zone
        # Read only in a cycle: shared with the index.
        self.nodes = index.nodes
        self.zone_of = index.zone_of
        self.zones_by_type = index.zones_by_type
        # Taken from in a cycle: the cycle's own copies (a zone's buckets once taken from).
        self.buckets = dict(index.buckets)
        self._own: set[ZoneKey] = set()
        self.free: dict[tuple[str, str], list[str]] = {}  # copied from the node when taken from
        self.zone_free = dict(index.zone_free)
        self.free_by_type: dict[str, int] = defaultdict(int, index.free_by_type)
        self.total_by_type: dict[str, int] = defaultdict(int, index.total_by_type)
        # Memo: the largest free block per (type, pod size) with the type's version when
        # it was computed.
        self._version: dict[str, int] = defaultdict(int)
        self._block: dict[tuple[str, int], tuple[int, tuple[int, str] | None]] = {}
        self._reach: dict[tuple[object, ...], tuple[int, Reach]] = {}  # likewise

    def _taking_from(self, zone: ZoneKey) -> dict[int, dict[tuple[str, str], None]]:
        """The zone's buckets, this cycle's own copy (made on the first take)."""
        if zone in self._own:
            return self.buckets[zone]
        self._own.add(zone)
        copied = self.buckets[zone] = defaultdict(
            dict, {count: dict(nodes) for count, nodes in self.buckets[zone].items()}
        )
        return copied

    def free_count(self, key: tuple[str, str]) -> int:
        taken = self.free.get(key)
        return len(taken) if taken is not None else len(self.nodes[key].free)

    # --------------------------------------------------------------- fitting
    def pods_fitting(self, zone: ZoneKey, per_pod: int) -> int:
        return sum(
            len(nodes) * (count // per_pod)
            for count, nodes in self.buckets[zone].items()
            if count >= per_pod and nodes
        )

    def best_zone(
        self, gpu_type: str, per_pod: int, pods: int, excluded: frozenset[ZoneKey] = frozenset()
    ) -> ZoneKey | None:
        """The fullest zone where the gang fits, or None."""
        best: ZoneKey | None = None
        for zone in self.zones_by_type.get(gpu_type, ()):
            if zone in excluded or self.zone_free[zone] < per_pod * pods:
                continue
            if best is not None and self.zone_free[zone] >= self.zone_free[best]:
                continue
            if self.pods_fitting(zone, per_pod) >= pods:
                best = zone
        return best

    def closest_zone(
        self, gpu_type: str, per_pod: int, excluded: frozenset[ZoneKey] = frozenset()
    ) -> tuple[ZoneKey, int] | None:
        """The zone that holds the most pods of this size now, and how many."""
        best: tuple[ZoneKey, int] | None = None
        for zone in self.zones_by_type.get(gpu_type, ()):
            if zone in excluded:
                continue
            fitting = self.pods_fitting(zone, per_pod)
            if best is None or fitting > best[1]:
                best = (zone, fitting)
        return best

    def ever_fits(self, gpu_type: str, per_pod: int, pods: int) -> bool:
        """Whether any zone of the fleet, empty and healthy, could hold the gang."""
        return self.most_pods(gpu_type, per_pod) >= pods

    def most_pods(self, gpu_type: str, per_pod: int) -> int:
        """The most pods of this size any zone of the fleet could hold, empty and healthy."""
        return self.shape.most_pods(gpu_type, per_pod)

    def most_free(self, zone: ZoneKey) -> int:
        """The most free GPUs on one node of the zone now."""
        return max((c for c, nodes in self.buckets[zone].items() if nodes), default=0)

    def largest_block(self, gpu_type: str, per_pod: int, pods: int) -> tuple[int, str] | None:
        """What the request could get now, for its reason: the most free GPUs on one node
        for a single pod, else the most GPUs its pods could get in one zone."""
        memo = (gpu_type, per_pod if pods > 1 else 0)
        version = self._version[gpu_type]
        cached = self._block.get(memo)
        if cached is not None and cached[0] == version:
            return cached[1]
        block: tuple[int, str] | None = None
        for zone in self.zones_by_type.get(gpu_type, ()):
            if pods > 1:
                size = self.pods_fitting(zone, per_pod) * per_pod
            else:
                size = max((c for c, nodes in self.buckets[zone].items() if nodes), default=0)
            if block is None or size > block[0]:
                block = (size, zone[1])
        self._block[memo] = (version, block)
        return block

    # ------------------------------------------------------------- placing
    def place(self, zone: ZoneKey, per_pod: int, pods: int) -> tuple[Pod, ...]:
        """Take the GPUs of a gang the caller checked fits (``best_zone``)."""
        buckets = self._taking_from(zone)
        placed = []
        for _ in range(pods):
            count = min(c for c, nodes in buckets.items() if c >= per_pod and nodes)
            key = next(iter(buckets[count]))
            placed.append(Pod(key[0], self.take(key, per_pod)))
        return tuple(placed)

    def place_selected(
        self,
        gpu_type: str,
        per_pod: int,
        pods: int,
        selector: Mapping[str, str],
        avoid_nodes: frozenset[str] = frozenset(),
        avoid_gpus: frozenset[str] = frozenset(),
    ) -> tuple[ZoneKey, tuple[Pod, ...]] | None:
        """The slow path for a particular workload: only nodes that match its selector and
        that it need not avoid count, and only the GPUs it need not avoid on them."""
        by_zone: dict[ZoneKey, list[tuple[str, str]]] = defaultdict(list)
        for key, node in self.nodes.items():
            if (
                node.gpu_type == gpu_type
                and node.name not in avoid_nodes
                and all(node.labels.get(k) == v for k, v in selector.items())
            ):
                by_zone[self.zone_of[key]].append(key)

        def usable(key: tuple[str, str]) -> int:
            free = self.free.get(key)
            gpus = free if free is not None else self.nodes[key].free
            return len(gpus) - len(avoid_gpus.intersection(gpus)) if avoid_gpus else len(gpus)

        best: tuple[ZoneKey, list[tuple[str, str]]] | None = None
        for zone, keys in sorted(by_zone.items()):
            if sum(usable(k) // per_pod for k in keys) >= pods and (
                best is None or self.zone_free[zone] < self.zone_free[best[0]]
            ):
                best = (zone, keys)
        if best is None:
            return None
        zone, keys = best
        placed = []
        for _ in range(pods):
            key = min((k for k in keys if usable(k) >= per_pod), key=lambda k: (usable(k), k))
            placed.append(Pod(key[0], self.take(key, per_pod, avoid_gpus)))
        return zone, tuple(placed)

    def reach(
        self,
        gpu_type: str,
        per_pod: int,
        pods: int,
        selector: Mapping[str, str],
        avoid_nodes: frozenset[str],
        avoid_gpus: frozenset[str],
    ) -> Reach:
        """What a particular request could get now over the nodes its selector picks, the
        nodes and GPUs it avoids apart (see ``Reach``). For its reason only: one pass over
        the fleet, kept while the type's free GPUs do not change (the requests of one
        selector share it)."""
        memo = (gpu_type, per_pod, pods, tuple(sorted(selector.items())), avoid_nodes, avoid_gpus)
        cached = self._reach.get(memo)
        if cached is not None and cached[0] == self._version[gpu_type]:
            return cached[1]
        found = self._reach_afresh(gpu_type, per_pod, pods, selector, avoid_nodes, avoid_gpus)
        self._reach[memo] = (self._version[gpu_type], found)
        return found

    def _reach_afresh(
        self,
        gpu_type: str,
        per_pod: int,
        pods: int,
        selector: Mapping[str, str],
        avoid_nodes: frozenset[str],
        avoid_gpus: frozenset[str],
    ) -> Reach:
        by_zone: dict[ZoneKey, list[tuple[str, Sequence[str], tuple[str, ...]]]]
        by_zone = defaultdict(list)
        for key, node in self.nodes.items():
            if node.gpu_type != gpu_type or any(
                node.labels.get(k) != v for k, v in selector.items()
            ):
                continue
            taken = self.free.get(key)
            free: Sequence[str] = taken if taken is not None else node.free
            avoided = tuple(free if node.name in avoid_nodes else avoid_gpus.intersection(free))
            by_zone[self.zone_of[key]].append((node.name, free, avoided))
        block: tuple[int, str] | None = None
        # Where avoidance alone keeps it out: (free GPUs there, where, nodes, GPUs avoided).
        blocked: list[tuple[int, str, tuple[str, ...], tuple[str, ...]]] = []
        for zone, nodes in sorted(by_zone.items()):
            if pods > 1:
                size = per_pod * sum((len(f) - len(a)) // per_pod for _, f, a in nodes)
                if size < per_pod * pods <= per_pod * sum(len(f) // per_pod for _, f, _ in nodes):
                    blocked.append(
                        (
                            sum(len(f) for _, f, _ in nodes),
                            zone[1],
                            tuple(sorted(n for n, _, a in nodes if a and n in avoid_nodes)),
                            tuple(g for n, _, a in nodes if n not in avoid_nodes for g in a),
                        )
                    )
            else:
                size = max(len(f) - len(a) for _, f, a in nodes)
                for name, f, a in nodes:
                    if len(f) - len(a) < per_pod <= len(f):
                        on_node = name in avoid_nodes
                        blocked.append(
                            (len(f), name, (name,) if on_node else (), () if on_node else a)
                        )
            if block is None or size > block[0]:
                block = (size, zone[1])
        if not blocked:
            return Reach(block)
        most, where, names, uuids = min(blocked, key=lambda b: (-b[0], b[1]))
        return Reach(block, where, most, names, tuple(sorted(uuids)))

    def hold_for_gang(
        self, zone: ZoneKey, per_pod: int, pods: int, coming: Mapping[tuple[str, str], list[str]]
    ) -> tuple[Pod, ...] | None:
        """Keep what a gang will need once ``coming`` GPUs (its victims', still stopping)
        are back: place it best-fit on free plus coming GPUs, the coming ones first, and
        take the free ones it would use. Returns the whole placement, or None (nothing
        taken) if it would not fit even then."""
        still_coming = {key: list(gpus) for key, gpus in coming.items() if key in self.nodes}
        counts = {
            key: self.free_count(key) + len(still_coming.get(key, ()))
            for nodes in self.buckets[zone].values()
            for key in nodes
        }
        plan: list[tuple[tuple[str, str], list[str], int]] = []
        for _ in range(pods):
            fitting = [key for key, count in counts.items() if count >= per_pod]
            if not fitting:
                return None
            key = min(fitting, key=lambda k: (counts[k], k))
            counts[key] -= per_pod
            waiting = still_coming.get(key, [])
            from_coming, still_coming[key] = waiting[:per_pod], waiting[per_pod:]
            plan.append((key, from_coming, per_pod - len(from_coming)))
        return tuple(
            Pod(key[0], (*from_coming, *(self.take(key, n) if n else ())))
            for key, from_coming, n in plan
        )

    def take_exact(self, key: tuple[str, str], gpus: list[str]) -> None:
        """Take these free GPUs (the caller checked they are free)."""
        free = self.free.get(key)
        if free is None:
            free = self.free[key] = list(self.nodes[key].free)
        zone = self.zone_of[key]
        before = len(free)
        for gpu in gpus:
            free.remove(gpu)
        buckets = self._taking_from(zone)
        del buckets[before][key]
        buckets[len(free)][key] = None
        self.zone_free[zone] -= len(gpus)
        self.free_by_type[key[1]] -= len(gpus)
        self._version[key[1]] += 1

    def is_free(self, key: tuple[str, str], gpu: str) -> bool:
        if key not in self.nodes:
            return False
        free = self.free.get(key)
        return gpu in (free if free is not None else self.nodes[key].free)

    def take(
        self, key: tuple[str, str], gpus: int, avoid: frozenset[str] = frozenset()
    ) -> tuple[str, ...]:
        """The first ``gpus`` free GPUs of the node, in device order, but none in ``avoid``
        (the caller checked that enough others are free)."""
        free = self.free.get(key)
        if free is None:
            free = self.free[key] = list(self.nodes[key].free)
        zone = self.zone_of[key]
        before = len(free)
        if avoid:
            taken = tuple(itertools.islice((g for g in free if g not in avoid), gpus))
            free[:] = [g for g in free if g not in taken]
        else:
            taken = tuple(free[:gpus])
            del free[:gpus]
        buckets = self._taking_from(zone)
        del buckets[before][key]
        buckets[before - gpus][key] = None
        self.zone_free[zone] -= gpus
        self.free_by_type[key[1]] -= gpus
        self._version[key[1]] += 1
        return taken
