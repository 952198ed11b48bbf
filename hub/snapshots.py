"""The controller's side of snapshots: where they are stored, and its index of them.

The store and the master key come from ``c.FleetController.snapshot_store`` and
``snapshot_key_file`` (a local directory and a key file under the data directory by
default: the embedded setup needs no S3). The index rows in the database are rebuilt from
a scan of every project's manifests when the controller starts leading and then every
``snapshot_index_interval`` seconds: the store is the truth, the rows follow it. Scans
run in a worker thread, never in the event loop.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from ..scheduler.store.snapshots import SnapshotRecord
from ..snapshotter.crypto import new_master_key, read_master_key
from ..snapshotter.errors import SnapshotNotFound
from ..snapshotter.repository import Repository
from ..snapshotter.store import Store, open_store


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


def scan(store: Store, master: bytes, projects: Iterable[str]) -> list[SnapshotRecord]:
    """A record per manifest of every project's repository (projects without one skipped)."""
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
