"""The controller's side of snapshots: where they are stored, and its index of them.

The store and the master key come from ``c.FleetController.snapshot_store`` and
``snapshot_key_file`` (a local directory and a key file under the data directory by
default: the embedded setup needs no S3). The index rows in the database are rebuilt from
a scan of every project's manifests when the controller starts leading and then every
``snapshot_index_interval`` seconds: the store is the truth, the rows follow it. Scans
run in a worker thread, never in the event loop; a damaged manifest is logged and left
out, as ``gpufleet snapshot list`` marks it, and the scan goes on.

``distinct`` is what the pages list: one row per snapshot. The culler records a live
snapshot's row under the store's setting and the manifest's name inside its project
(``snapshots/<user>/<server>/<id>``), the scan under the store's URI and the full object
name (``projects/<project>/snapshots/...``), so one snapshot can have two rows; the culler
should record ``index_key(project, name)`` and ``store.uri`` as the scan does.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from . import retention
from .crypto import new_master_key, read_master_key
from .errors import CorruptObject, SnapshotNotFound
from .gc import collect_garbage
from .repository import Repository
from .retention import RetentionPolicy
from .store import Store, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotRecord:
    """One manifest of a snapshot store, as the controller's index keeps it (a row of
    ``scheduler/store/snapshots.py``)."""

    project: str
    username: str
    server_name: str
    store_uri: str
    manifest_key: str  # the manifest's object name in the store: unique
    created_at: datetime
    size_bytes: int
    file_count: int
    workload_id: int | None = None


def master_key(path: str | os.PathLike[str], create: bool) -> bytes:
    """The master key in ``path``; with ``create``, a new one is written there first if
    there is none (mode 0600), for the embedded default."""
    key_path = Path(path)
    if create and not key_path.exists():
        key_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(new_master_key()).decode() + "\n")
    return read_master_key(key_path)


def snapshot_store(uri: str, s3_endpoint: str = "") -> Store:
    options = {"endpoint_url": s3_endpoint} if uri.startswith("s3://") and s3_endpoint else {}
    return open_store(uri, **options)


def index_key(project: str, manifest_name: str) -> str:
    """The index's key of a manifest: its full object name in the store, as the scan
    records it (``manifest_name`` is the name inside the project's repository)."""
    return f"projects/{quote(project, safe='')}/{manifest_name}"


@dataclass(frozen=True)
class RetentionRun:
    forgotten: int  # snapshots the policy did not keep
    deleted_packs: int
    deleted_bytes: int


def retain_and_collect(
    store: Store,
    master: bytes,
    projects: Iterable[str],
    policy: RetentionPolicy,
    margin_s: float,
    now: float,
) -> RetentionRun:
    """Apply the retention policy to every project's repository, then collect the data
    nothing keeps any more (``gpufleet snapshot gc`` for each project). Blocking."""
    forgotten = packs = size = 0
    for project in projects:
        try:
            repository = Repository.open(store, project, master, create=False)
        except SnapshotNotFound:
            continue
        forgotten += len(retention.apply(repository, policy, now))
        report = collect_garbage(repository, margin_s=margin_s, now=now)
        packs += report.deleted_packs
        size += report.deleted_bytes
    return RetentionRun(forgotten, packs, size)


def open_snapshots(
    store_uri: str, s3_endpoint: str, key_file: str, data_dir: str
) -> tuple[Store, bytes]:
    """The controller's snapshot store and master key (under ``data_dir`` unless set: the
    embedded default, whose key is made on first use); SnapshotError when unavailable."""
    store = snapshot_store(store_uri or os.path.join(data_dir, "snapshots"), s3_endpoint)
    default_key = os.path.join(data_dir, "snapshot-master.key")
    return store, master_key(key_file or default_key, create=not key_file)


async def retention_pass(options: Any, store: Store, master: bytes, now: float) -> str:
    """One scheduled retention and collection over every project, with the controller's
    ``snapshot_keep_last``, ``snapshot_keep_daily`` and ``snapshot_gc_margin_seconds``;
    what it did, in words."""
    policy = RetentionPolicy(options.snapshot_keep_last, options.snapshot_keep_daily)
    run = await asyncio.to_thread(
        retain_and_collect,
        store,
        master,
        options.store.project_names(),
        policy,
        options.snapshot_gc_margin_seconds,
        now,
    )
    return (
        f"snapshot retention (keep the last {policy.keep_last}, one a day for "
        f"{policy.keep_daily} days): {run.forgotten} snapshot(s) forgotten, "
        f"{run.deleted_packs} pack(s) of unused data deleted ({run.deleted_bytes} bytes)"
    )


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
