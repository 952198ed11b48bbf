"""The controller's index of snapshots: rows that point at manifests in a snapshot store.

The manifests in the store are the truth (DESIGN.md); these rows let pages, the API and
the culler find a user's snapshots without reading the store. ``record_snapshot`` adds
the row of a snapshot the controller just saw committed; ``rebuild_snapshot_index``
makes the rows of one store match a scan of it (``gpufleet.snapshotter.listing.scan``),
adding what is missing, updating what differs and removing rows whose manifest is gone.
The repository is ``store.snapshots``; every write is fenced by the controller lease.

The records are the snapshotter's (``snapshotter.listing.IndexedSnapshot``); this module
reads them through :class:`IndexedSnapshot`, what a row is made of, and imports nothing of
the snapshotter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from .base import Repository, _event
from .models import Project, Snapshot


class IndexedSnapshot(Protocol):
    """What an index row is made of: one manifest in a snapshot store."""

    @property
    def project(self) -> str: ...
    @property
    def username(self) -> str: ...
    @property
    def server_name(self) -> str: ...
    @property
    def store_uri(self) -> str: ...
    @property
    def manifest_key(self) -> str: ...  # the manifest's object name in the store: unique
    @property
    def created_at(self) -> datetime: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def file_count(self) -> int: ...
    @property
    def workload_id(self) -> int | None: ...  # None: the row keeps the one it has


@dataclass(frozen=True)
class IndexChanges:
    added: int
    updated: int
    removed: int


class SnapshotStore(Repository):
    def record_snapshot(self, now: datetime, record: IndexedSnapshot) -> None:
        with self._write(now) as session:
            project_ids = self._project_ids(session)
            row = session.scalars(
                select(Snapshot).where(Snapshot.manifest_key == record.manifest_key)
            ).one_or_none()
            if row is None:
                session.add(_row(record, project_ids))
                _event(
                    session,
                    now,
                    EventKind.SNAPSHOT_TAKEN,
                    f"snapshot of {record.username}'s server {record.server_name or '(default)'}: "
                    f"{record.file_count} files, {record.size_bytes} bytes",
                    data={"manifest": record.manifest_key},
                )
            else:
                _update(row, record, project_ids)

    def rebuild_snapshot_index(
        self, now: datetime, store_uri: str, scanned: Iterable[IndexedSnapshot]
    ) -> IndexChanges:
        """Make the rows of ``store_uri`` exactly the scanned manifests."""
        found = {r.manifest_key: r for r in scanned}
        added = updated = removed = 0
        with self._write(now) as session:
            project_ids = self._project_ids(session)
            rows = session.scalars(select(Snapshot).where(Snapshot.store_uri == store_uri))
            for row in rows:
                record = found.pop(row.manifest_key, None)
                if record is None:
                    session.delete(row)
                    removed += 1
                elif _update(row, record, project_ids):
                    updated += 1
            for record in found.values():
                session.add(_row(record, project_ids))
                added += 1
            if added or updated or removed:
                _event(
                    session,
                    now,
                    EventKind.SNAPSHOT_INDEX_REBUILT,
                    f"snapshot index of {store_uri} rebuilt from the store: {added} added, "
                    f"{updated} updated, {removed} removed",
                )
        return IndexChanges(added, updated, removed)

    def snapshots_of(self, username: str, server_name: str | None = None) -> list[Snapshot]:
        """A user's snapshots, newest first (of one server, if named)."""
        with self.read() as session:
            query = select(Snapshot).where(Snapshot.username == username)
            if server_name is not None:
                query = query.where(Snapshot.server_name == server_name)
            return list(session.scalars(query.order_by(Snapshot.created_at.desc())))

    def project_names(self) -> list[str]:
        with self.read() as session:
            return list(session.scalars(select(Project.name).order_by(Project.name)))

    @staticmethod
    def _project_ids(session: Session) -> dict[str, int]:
        return {name: pid for name, pid in session.execute(select(Project.name, Project.id))}


def _row(record: IndexedSnapshot, project_ids: dict[str, int]) -> Snapshot:
    row = Snapshot(manifest_key=record.manifest_key, store_uri=record.store_uri)
    _update(row, record, project_ids)
    return row


def _update(row: Snapshot, record: IndexedSnapshot, project_ids: dict[str, int]) -> bool:
    """Copy the record onto the row; whether anything changed."""
    values = {
        "username": record.username,
        "server_name": record.server_name,
        "project_id": project_ids.get(record.project),
        "store_uri": record.store_uri,
        "created_at": record.created_at,
        "size_bytes": record.size_bytes,
        "file_count": record.file_count,
    }
    if record.workload_id is not None:
        values["workload_id"] = record.workload_id
    changed = False
    for name, value in values.items():
        if getattr(row, name, None) != value:
            setattr(row, name, value)
            changed = True
    return changed
