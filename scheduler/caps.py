"""Room under the caps of the project tree during a cycle (``plan._Planner`` mixes this
in): what a cap still lacks once the workloads stopping in its subtree are gone, the room
a request within its guarantee claims under an enclosing cap, and a tree node's projects.

Invariant: the quota book's usage counts every workload holding GPUs (stopping ones
too) and every placement kept or admitted in the cycle, plus the room claimed
(``_claim_caps``, named in ``claimed``); ``leaving_by_node`` counts, per tree node, the
GPUs of workloads stopping for a preemptor and of the cycle's victims, which the book
still counts."""

from __future__ import annotations

from collections import defaultdict

from .quota import UNLIMITED, QuotaBook
from .snapshot import Pending, Running


class CapRoom:
    """What the cap accounting reads and keeps of the planner."""

    book: QuotaBook
    epoch: int
    in_flight: dict[int, list[Running]]
    subtrees: dict[str, frozenset[str]]
    leaving_by_node: dict[tuple[str, str], int] | None
    claimed: set[tuple[str, str]]

    def _quota_refusal(self, request: Pending) -> str | None: ...

    def _refused_by_quota_once_gone(self, request: Pending, victims: list[Running]) -> bool:
        """Whether a quota refuses the preemptor even once its victims, still stopping and
        still counted where they run, are gone: they leave for it, so a cap they fill
        must not break its promise (or the GPUs they free would go back to them)."""
        t = request.gpu_type
        for victim in victims:
            self.book.add(victim.project, t, -victim.gpus)
        try:
            return self._quota_refusal(request) is not None
        finally:
            for victim in victims:
                self.book.add(victim.project, t, victim.gpus)

    def _leaving(self, name: str, gpu_type: str) -> int:
        """GPUs of the subtree of ``name`` that workloads stopping for preemptors (or
        chosen as victims this cycle) will give back: a preemptor's kept placement counts
        as its project's usage while its victims still do too, so a cap is short of
        room only by what is left once they are gone."""
        if self.leaving_by_node is None:
            self.leaving_by_node = defaultdict(int)
            for victims in self.in_flight.values():
                for victim in victims:
                    self._count_leaving(victim)
        return self.leaving_by_node.get((name, gpu_type), 0)

    def _count_leaving(self, victim: Running) -> None:
        if self.leaving_by_node is not None:  # else made with it, on first use
            for name in self.book.path(victim.project):
                self.leaving_by_node[(name, victim.gpu_type)] += victim.gpus

    def _excess(self, name: str, gpu_type: str, gpus: int) -> int:
        """What ``gpus`` more would take ``name``'s subtree over its cap once the
        workloads stopping in it are gone (≤ 0: they make room enough)."""
        cap = self.book.cap(name, gpu_type)
        if cap == UNLIMITED:
            return -gpus
        used = self.book.usage(name, gpu_type) - self._leaving(name, gpu_type)
        return int(used + gpus - cap)

    def _claim_caps(self, request: Pending) -> None:
        """A request within its project's guarantee that an enclosing node's cap refuses,
        and that could not make room under it yet, keeps what is left under that cap for
        the rest of the cycle: no borrower of the subtree gets more meanwhile (within
        guarantee requests come first in the order, so only later ones are held back)."""
        p, t, gpus = request.project, request.gpu_type, request.gpus
        if not self.book.within_guarantee(p, t, gpus):
            return
        for name in self.book.path(p)[1:]:
            room = self.book.cap(name, t) - self.book.usage(name, t)
            if 0 < room < gpus:
                self.book.add(name, t, int(room))
                self.claimed.add((name, t))
                self.epoch += 1

    def _subtree(self, name: str) -> frozenset[str]:
        """The projects under a node of the tree (itself included)."""
        found = self.subtrees.get(name)
        if found is None:
            found = self.subtrees[name] = frozenset(
                project for project in self.book.projects if name in self.book.path(project)
            )
        return found
