"""The controller's index of snapshots: what a scan of the store finds, and what the pages
list.

The manifests in the store are the truth; the controller keeps rows in its database
(``state/snapshots.py``) so that pages and the API list snapshots without
reading the store. The rows are rebuilt from :func:`scan` of every project's manifests
when the controller starts leading and then every ``snapshot_index_interval`` seconds.
Scans run in a worker thread, never in the event loop; a damaged manifest is logged and
left out, as ``gpufleet snapshot list`` marks it, and the scan goes on. Where the store
is, and its key: ``settings.py``.

:func:`distinct` is what the pages list: one row per snapshot. The culler records a live
snapshot's row under the store's URI and :func:`index_key` of its manifest, as the scan
does, so the rebuild replaces that row; rows written before under the manifest's name
inside its project (``snapshots/<user>/<server>/<id>``) are merged with the scan's by
:func:`snapshot_key`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from .errors import CorruptObject, SnapshotNotFound
from .repository import Repository
from .store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotRecord:
    """One manifest of a snapshot store, as the controller's index keeps it (a row of
    ``state/snapshots.py``)."""

    project: str
    username: str
    server_name: str
    store_uri: str
    manifest_key: str  # the manifest's object name in the store: unique
    created_at: datetime
    size_bytes: int
    file_count: int
    workload_id: int | None = None


def index_key(project: str, manifest_name: str) -> str:
    """The index's key of a manifest: its full object name in the store, as the scan
    records it (``manifest_name`` is the name inside the project's repository)."""
    return f"projects/{quote(project, safe='')}/{manifest_name}"


def scan(
    store: Store, master: bytes, projects: Iterable[str], logger: Any = log
) -> list[SnapshotRecord]:
    """A record per manifest of every project's repository (projects without one
    skipped). A manifest that does not open is logged and left out: the others are
    still listed, and its row leaves the index."""
    records = []
    for project in projects:
        try:
            repository = Repository.open(store, project, master, create=False)
        except SnapshotNotFound:
            continue
        for ref in repository.snapshots():
            try:
                manifest = repository.read_manifest(ref)
            except SnapshotNotFound:
                continue  # deleted while scanning
            except CorruptObject as e:
                logger.error(
                    "snapshot index: project %s: snapshot %s of %s is damaged, left out: %s",
                    project,
                    ref.id,
                    ref.user,
                    e,
                )
                continue
            records.append(
                SnapshotRecord(
                    project=project,
                    username=manifest.user,
                    server_name=manifest.server,
                    store_uri=store.uri,
                    manifest_key=repository.name(ref.name),
                    created_at=datetime.fromtimestamp(manifest.created_at, UTC),
                    size_bytes=manifest.stats.bytes,
                    file_count=manifest.stats.files,
                )
            )
    return records


@dataclass(frozen=True)
class ListedSnapshot:
    """A snapshot as the pages list it."""

    key: str  # project/user/server/id: the same for every row of one snapshot
    project: str
    project_label: str
    username: str
    server_name: str
    created_at: datetime
    file_count: int
    size_bytes: int
    restored_next: bool  # the newest of its project and server: what a start there restores


def snapshot_key(project: str, username: str, server: str, manifest_key: str) -> str:
    """What one snapshot's rows share, whichever way their manifest is named."""
    return f"{project}/{username}/{server}/{manifest_key.rsplit('/', 1)[-1]}"


def distinct(
    rows: Sequence[Any], projects: dict[int | None, tuple[str, str]]
) -> list[ListedSnapshot]:
    """One entry per snapshot from the index rows (``Snapshot``), newest first; the row of
    the full object name (the scan's) wins over another of the same snapshot. Each
    project's and server's newest is marked: a start in that project restores it
    (snapshots are per project). ``projects``: project id → (name, display name)."""
    chosen: dict[str, Any] = {}
    for row in rows:
        name, _ = projects.get(row.project_id, ("", ""))
        key = snapshot_key(name, row.username, row.server_name, row.manifest_key)
        if key not in chosen or row.manifest_key.startswith("projects/"):
            chosen[key] = row
    newest: set[tuple[str, str]] = set()
    listed = []
    for key, row in sorted(chosen.items(), key=lambda item: item[1].created_at, reverse=True):
        name, label = projects.get(row.project_id, ("", ""))
        first = (name, row.server_name) not in newest
        newest.add((name, row.server_name))
        listed.append(
            ListedSnapshot(
                key=key,
                project=name,
                project_label=label or name or "(no project)",
                username=row.username,
                server_name=row.server_name,
                created_at=row.created_at,
                file_count=row.file_count,
                size_bytes=row.size_bytes,
                restored_next=first and bool(name),
            )
        )
    return listed
