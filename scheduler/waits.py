"""A plan's waiting workloads, kept as the planner found them: rows, and runs of a queue
that repeat refusals given earlier in the cycle, expanded into rows only when read.

At a few hundred or thousand waiting workloads most of a plan's rows are "the same no as
the identical request before it". Building a ``Waiting`` row for each of them, every
cycle, was most of a replay's time, while a replay reads the rows of one plan only, its
last. A ``SettledRun`` records such a stretch in O(1) rows; ``Waits`` is the sequence a
reader sees, row by row, equal to the tuple of rows it stands for.

Invariant: a run's requests, first position and answers are copies taken when the run
was settled, never changed afterwards (the planner's queues and refusals go on changing),
so expanding it later gives the rows the planner would have written then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from .snapshot import Pending, WaitCause, Waiting


def behind_refusal(earlier: Pending, reason: str) -> str:
    """Why a request waits behind an earlier one of its queue that its quota refused:
    plain words that say so, then the earlier one's reason (``plan.py`` and ``frozen.py``
    both write it)."""
    return (
        f"Waiting behind an earlier {earlier.gpu_type} request of project {earlier.project} "
        f"(workload {earlier.id}), {reason[:1].lower()}{reason[1:]}"
    )


class SettledRun:
    """Consecutive requests of one queue (no per-user cap), each answered by the refusal
    its shape got earlier in the cycle. Positions count on from ``after``."""

    __slots__ = ("after", "answers", "requests")

    def __init__(
        self,
        requests: list[Pending],
        after: int,
        answers: dict[Any, tuple[int, WaitCause, str]],
    ):
        self.requests = requests
        self.after = after
        self.answers = answers  # shape -> (refusal epoch, cause, reason)

    def __len__(self) -> int:
        return len(self.requests)

    def rows(self) -> Iterator[Waiting]:
        answers = self.answers
        for position, request in enumerate(self.requests, start=self.after + 1):
            _, cause, reason = answers[request.shape]
            yield Waiting(request.id, position, cause, reason)


class Waits(Sequence[Waiting]):
    """The waiting rows of a plan, in the planner's order; expanded on first read."""

    __slots__ = ("_parts", "_rows")

    def __init__(self, parts: Sequence[Waiting | SettledRun] = ()):
        self._parts = parts
        self._rows: tuple[Waiting, ...] | None = None

    def _expanded(self) -> tuple[Waiting, ...]:
        if self._rows is None:
            rows: list[Waiting] = []
            for part in self._parts:
                if type(part) is SettledRun:
                    rows.extend(part.rows())
                else:
                    rows.append(part)  # type: ignore[arg-type]
            self._rows = tuple(rows)
            self._parts = ()
        return self._rows

    def __len__(self) -> int:
        return len(self._expanded())

    @overload
    def __getitem__(self, index: int) -> Waiting: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Waiting]: ...
    def __getitem__(self, index: int | slice) -> Waiting | Sequence[Waiting]:
        return self._expanded()[index]

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self._expanded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Waits):
            other = other._expanded()
        if isinstance(other, tuple):
            return self._expanded() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expanded())

    def __repr__(self) -> str:
        return f"Waits({self._expanded()!r})"
