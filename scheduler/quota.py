"""Quota accounting for one scheduling cycle: usage, limits and fair share over the tree.

Per tree node and GPU type:
- a project's ``guaranteed`` is its own; an inner node's is the larger of what it declares
  and its children's sum (a declared surplus is a pool its projects share);
- the cap is ``guaranteed + borrow_limit`` where a borrow limit is set, else none: a
  workload is admitted only if every node on its project's path stays within its cap;
- a lend limit ``L`` keeps ``max(0, guaranteed - used - L)`` of the node's unused guarantee
  for its own subtree: workloads outside that subtree cannot count those GPUs as free.

Fair share (for ordering borrowers): a node's share is what its subtree borrows from
outside (usage above its guarantee) over what its parent's subtree could lend at the start
of the cycle, divided by its weight, dominant over GPU types. A project's key is the tuple
of shares from the top of the tree down to it, compared lexicographically: siblings compete
inside their parent first, so a team that stays within its own guarantee (its projects
borrowing each other's idle GPUs) goes before a team that borrows from outside — unused
guarantee is lent inside the nearest subtree first.

Usage only grows during a cycle (admissions); GPUs come back only between cycles, once
their workloads are gone. Shares therefore only grow too, which the planner's lazy queue
ordering relies on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from .model import Project, ProjectTree

UNLIMITED = math.inf


class QuotaLimits:
    """The tree's half of a quota book: guarantees summed up the tree, caps and lend
    limits. It depends on the tree alone, so a memo keeps it while the tree stays the same
    object (``QuotaBook(..., limits=)``); nothing changes it once made."""

    def __init__(self, tree: ProjectTree):
        self.tree = tree
        self.projects: dict[str, Project] = dict(tree.projects)
        self.children: dict[str | None, list[str]] = defaultdict(list)
        for declared in self.projects.values():
            self.children[declared.parent].append(declared.name)
        self.guaranteed: dict[str, dict[str, int]] = {}
        for name in self._bottom_up():
            self.guaranteed[name] = self._subtree_guarantee(name)
        self.guaranteed_of = {
            (name, t): g for name, per_type in self.guaranteed.items() for t, g in per_type.items()
        }
        # A node that declares a guarantee is capped at what it declares plus its borrow
        # limit (children may not be guaranteed more: ``model.guarantees_over_limits``);
        # one that declares none at its children's sum plus its borrow limit.
        self.caps = {
            (name, t): (q.guaranteed or self.guaranteed_of.get((name, t), 0)) + q.borrow_limit
            for name, p in self.projects.items()
            for t, q in p.quotas.items()
            if q.borrow_limit is not None
        }
        self.limited = [
            name
            for name, p in self.projects.items()
            if any(q.lend_limit is not None for q in p.quotas.values())
        ]

    def _bottom_up(self) -> list[str]:
        order: list[str] = []
        stack: list[str | None] = [None]
        while stack:
            node = stack.pop()
            for child in self.children.get(node, ()):
                order.append(child)
                stack.append(child)
        return order[::-1]

    def _subtree_guarantee(self, name: str) -> dict[str, int]:
        own = {t: q.guaranteed for t, q in self.projects[name].quotas.items()}
        children = self.children.get(name, ())
        if not children:
            return own
        total: dict[str, int] = defaultdict(int)
        for child in children:
            for gpu_type, gpus in self.guaranteed[child].items():
                total[gpu_type] += gpus
        for gpu_type, gpus in own.items():
            total[gpu_type] = max(total[gpu_type], gpus)
        return dict(total)


class QuotaBook:
    def __init__(
        self,
        tree: ProjectTree,
        usage: Iterable[tuple[str, str, int]],  # (project, gpu type, GPUs) per workload
        capacity: Mapping[str, int],  # GPU type -> schedulable GPUs in the fleet
        limits: QuotaLimits | None = None,  # the tree's, from an earlier cycle
    ):
        if limits is None or limits.tree is not tree:
            limits = QuotaLimits(tree)
        self.limits = limits
        self.projects: dict[str, Project] = dict(limits.projects)  # ``ensure`` adds to it
        self.children = limits.children  # shared until ``ensure`` adds to it
        self.guaranteed = limits.guaranteed
        self.guaranteed_of = limits.guaranteed_of
        self._caps = limits.caps
        self._limited = limits.limited
        self.capacity = capacity
        self._path: dict[str, tuple[str, ...]] = {}
        self._share: dict[str, float] = {}
        self._share_keys: dict[str, tuple[float, ...]] = {}
        # Flat (node, GPU type) keys: these are read tens of thousands of times a cycle.
        self.used: dict[tuple[str, str], int] = defaultdict(int)
        self.types_used: dict[str, set[str]] = defaultdict(set)
        # (project, GPU type) -> GPUs of its guarantee claimed this cycle by the request a
        # zone is held for (``claim_guarantee``): its later requests count them as used.
        self.claimed: dict[tuple[str, str], int] = {}
        # Top of the tree -> how many times usage or a claim under it changed: a queue's
        # place in the cycle's order reads only its own path (fair shares, guarantee), so
        # while this count stands for its top the place stands (``plan._run_queues``).
        self.changes: dict[str, int] = defaultdict(int)
        for project, gpu_type, gpus in usage:
            self.add(project, gpu_type, gpus)
        self._lendable = self._lendable_at_start()

    @property
    def lends_with_limits(self) -> bool:
        """Whether some node keeps unused guarantee back: then free GPUs a project may take
        can grow during a cycle (when the keeper's own use grows)."""
        return bool(self._limited)

    # ------------------------------------------------------------- the tree
    def ensure(self, name: str) -> None:
        """A project the tree does not declare runs as a top-level project without
        guarantee (the simulator's trace groups; a project removed from the config)."""
        if name not in self.projects:
            self.projects[name] = Project(name=name, default_priority="opportunistic")
            if self.children is self.limits.children:  # the memo's: not ours to change
                self.children = {parent: list(c) for parent, c in self.children.items()}
            self.children.setdefault(None, []).append(name)

    def path(self, name: str) -> tuple[str, ...]:
        """The project and its ancestors, nearest first."""
        path = self._path.get(name)
        if path is None:
            self.ensure(name)
            chain = [name]
            parent = self.projects[name].parent
            while parent is not None:
                chain.append(parent)
                parent = self.projects[parent].parent
            path = self._path[name] = tuple(chain)
        return path

    # ------------------------------------------------------------ accounting
    def add(self, project: str, gpu_type: str, gpus: int) -> None:
        path = self.path(project)
        for name in path:
            self.used[(name, gpu_type)] += gpus
            self.types_used[name].add(gpu_type)
            self._share.pop(name, None)
        self.changes[path[-1]] += 1
        if self._share_keys:
            self._share_keys.clear()

    def guarantee(self, name: str, gpu_type: str) -> int:
        return self.guaranteed_of.get((name, gpu_type), 0)

    def usage(self, name: str, gpu_type: str) -> int:
        return self.used.get((name, gpu_type), 0)

    def cap(self, name: str, gpu_type: str) -> float:
        return self._caps.get((name, gpu_type), UNLIMITED)

    def within_guarantee(self, project: str, gpu_type: str, gpus: int) -> bool:
        key = (project, gpu_type)
        return self.used.get(key, 0) + self.claimed.get(key, 0) + gpus <= self.guaranteed_of.get(
            key, 0
        )

    def claim_guarantee(self, project: str, gpu_type: str, gpus: int) -> None:
        """Keep ``gpus`` of the project's guarantee for a request that waits for room
        within it: the project's later requests are within their guarantee only beside
        it. Only the project's own guarantee: caps and fair shares count what runs."""
        key = (project, gpu_type)
        self.claimed[key] = self.claimed.get(key, 0) + gpus
        self.changes[self.path(project)[-1]] += 1

    def over_cap(self, project: str, gpu_type: str, gpus: int) -> str | None:
        """The nearest node on the project's path that the request would take over its cap."""
        if not self._caps:
            return None
        for name in self.path(project):
            key = (name, gpu_type)
            if self.used.get(key, 0) + gpus > self._caps.get(key, UNLIMITED):
                return name
        return None

    def ceiling(self, project: str, gpu_type: str) -> tuple[str, float]:
        """The tightest cap on the project's path, and whose: more than this the project
        can never hold, however idle the fleet."""
        return min(
            ((name, self.cap(name, gpu_type)) for name in self.path(project)),
            key=lambda named: named[1],
        )

    def may_borrow(self, project: str, gpu_type: str) -> float:
        """How many more GPUs the project may take beyond its guarantee, by its caps."""
        room = min(self.cap(n, gpu_type) - self.usage(n, gpu_type) for n in self.path(project))
        unused = max(0, self.guarantee(project, gpu_type) - self.usage(project, gpu_type))
        return max(0.0, room - unused)

    # --------------------------------------------------------------- lending
    def _reserve(self, name: str, gpu_type: str) -> int:
        quota = self.projects[name].quotas.get(gpu_type)
        if quota is None or quota.lend_limit is None:
            return 0
        unused = self.guarantee(name, gpu_type) - self.usage(name, gpu_type)
        return max(0, unused - quota.lend_limit)

    def withheld_from(self, project: str, gpu_type: str) -> int:
        """Free GPUs the project may not take: unused guarantee that other subtrees keep
        for themselves by their lend limits. Nested limits count once (the larger)."""
        if not self._limited:
            return 0
        path = set(self.path(project))
        withheld = 0
        for name in self._limited:
            if name in path:
                continue
            # Counted at the outermost limited node outside the path that encloses it.
            outer = next(
                (a for a in self.path(name)[1:] if a in self._limited and a not in path), None
            )
            if outer is None:
                withheld += self._protected(name, gpu_type)
        return withheld

    def _protected(self, name: str, gpu_type: str) -> int:
        inner = sum(self._protected(c, gpu_type) for c in self.children.get(name, ()))
        return max(self._reserve(name, gpu_type), inner)

    # ------------------------------------------------------------ fair share
    def _lendable_at_start(self) -> dict[str | None, dict[str, float]]:
        """What each subtree could lend its members at the start of the cycle: its
        children's unused guarantee within their lend limits (the fleet's unguaranteed
        GPUs too, at the top). Never below 1, so a share is always defined."""
        lendable: dict[str | None, dict[str, float]] = {}
        for parent, children in list(self.children.items()):
            per_type: dict[str, float] = defaultdict(float)
            for child in children:
                for gpu_type, guaranteed in self.guaranteed.get(child, {}).items():
                    unused = max(0, guaranteed - self.usage(child, gpu_type))
                    quota = self.projects[child].quotas.get(gpu_type)
                    if quota is not None and quota.lend_limit is not None:
                        unused = min(unused, quota.lend_limit)
                    per_type[gpu_type] += unused
            if parent is None:
                for gpu_type, total in self.capacity.items():
                    top = sum(self.guarantee(c, gpu_type) for c in children)
                    per_type[gpu_type] += max(0, total - top)
            lendable[parent] = per_type
        return lendable

    def share(self, name: str) -> float:
        cached = self._share.get(name)
        if cached is not None:
            return cached
        project = self.projects[name]
        lendable = self._lendable.get(project.parent, {})
        dominant = 0.0
        for gpu_type in self.types_used.get(name, ()):
            borrowed = self.usage(name, gpu_type) - self.guarantee(name, gpu_type)
            if borrowed > 0:
                dominant = max(dominant, borrowed / max(1.0, lendable.get(gpu_type, 0.0)))
        value = self._share[name] = dominant / project.weight
        return value

    def share_key(self, project: str) -> tuple[float, ...]:
        """Shares from the top of the tree down to the project (lexicographic order)."""
        key = self._share_keys.get(project)
        if key is None:
            key = self._share_keys[project] = tuple(
                self.share(n) for n in reversed(self.path(project))
            )
        return key
