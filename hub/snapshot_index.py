"""The controller's snapshot index (docs/snapshots.md) as a component: the loop that
reads the snapshot store into the database's index, now and then and soon after a
session ends, while the controller holds the database lease. Its options are
``c.SnapshotIndexing.<name>``."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from logging import Logger
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float

from ..scheduler.errors import SchedulerError
from ..snapshotter.errors import SnapshotError
from ..snapshotter.settings import StoreAccess
from ..state.snapshots import SnapshotStore
from .components import LoopComponent


class IndexState(Protocol):
    """The repositories this loop uses (the snapshot index; ``FleetStore`` holds them all)."""

    snapshots: SnapshotStore


class IndexingController(Protocol):
    """What the index uses of the controller (``app.FleetController``)."""

    log: Logger
    snapshot_access: StoreAccess
    is_leader: bool

    def now(self) -> datetime: ...

    @property
    def store(self) -> IndexState: ...


class SnapshotIndexing(LoopComponent):
    interval = Float(
        3600.0,
        help="Seconds between rebuilds of the database's snapshot index from the store "
        "(the store is the truth; the index lets pages and the API list snapshots fast).",
    ).tag(config=True)

    min_interval = Float(
        10.0,
        help="Fewest seconds between two reads of the snapshot store into the index; a "
        "session's end asks for one (so researchers see their last snapshot in seconds).",
    ).tag(config=True)

    def __init__(self, controller: IndexingController, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.controller = controller
        self._wanted = asyncio.Event()
        self.indexed_at: datetime | None = None  # when the last rebuild began

    def refresh(self) -> None:
        """Read the snapshot store into the index soon (a session ended)."""
        self._wanted.set()

    async def run(self) -> None:
        from ..snapshotter import listing as snapshots

        c = self.controller
        try:
            store, key = c.snapshot_access.open()
        except SnapshotError as e:
            self.log.error("snapshots are unavailable: %s", e)
            return
        while True:
            self._wanted.clear()
            if c.is_leader:
                try:
                    started = c.now()
                    records = await asyncio.to_thread(
                        snapshots.scan, store, key, c.store.snapshots.project_names()
                    )
                    changes = c.store.snapshots.rebuild_snapshot_index(c.now(), store.uri, records)
                    self.indexed_at = started
                    self.log.info("snapshot index: %s", changes)
                except (SnapshotError, SQLAlchemyError, SchedulerError):
                    self.log.exception("could not rebuild the snapshot index; retrying later")
            # Asked again when a session ends (its final snapshot is in the store by
            # then), at most every min_interval seconds.
            await asyncio.sleep(self.min_interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wanted.wait(), max(0.0, self.interval - self.min_interval)
                )
