"""The producer's side of ``snapshot.Changes``: maps of workloads by id that remember
which ids changed since their changes were last taken.

A producer (the simulator's replay, the controller's mirror of the database) keeps its
running and queued workloads in two ``TrackedMap``s and builds each snapshot with
``ChangeStream.changes()``: every assignment, deletion and pop is recorded, so the hint
cannot miss a change made through the map.
"""

from __future__ import annotations

from typing import Any, TypeVar

from .snapshot import Changes, Pending, Running

V = TypeVar("V")


class TrackedMap(dict[int, V]):
    """A dict by workload id that records each id assigned, deleted or popped."""

    __slots__ = ("changed",)

    def __init__(self) -> None:
        super().__init__()
        self.changed: dict[int, V | None] = {}

    def __setitem__(self, key: int, value: V) -> None:
        super().__setitem__(key, value)
        self.changed[key] = value

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self.changed[key] = None

    def pop(self, key: int, *default: Any) -> Any:
        if key in self:
            self.changed[key] = None
        return super().pop(key, *default)

    def clear(self) -> None:
        self.changed.update(dict.fromkeys(self))
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:  # through __setitem__
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> TrackedMap[V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def setdefault(self, key: int, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self) -> tuple[int, V]:
        key, value = super().popitem()
        self.changed[key] = None
        return key, value

    def take_changes(self) -> dict[int, V | None]:
        changed, self.changed = self.changed, {}
        return changed


class ChangeStream:
    """A producer's stream of snapshots: its tracked maps and the serial of the next."""

    def __init__(self) -> None:
        self.running: TrackedMap[Running] = TrackedMap()
        self.queue: TrackedMap[Pending] = TrackedMap()
        self._token = object()
        self._serial = 0

    def changes(self) -> Changes:
        """The changes since the last call, numbered for the snapshot about to be built."""
        self._serial += 1
        return Changes(
            self._token, self._serial, self.running.take_changes(), self.queue.take_changes()
        )
