"""A project's repository in a store: its key, packs, index files, manifests, tombstones.

Layout, under ``projects/<project>/`` of the store (the same in S3 and in a directory)::

    config                      plain JSON: format version, chunker sizes
    keys/data                   the project's data key, sealed with the master key
    keys/check                  crypto.key_check: tells a wrong master key from a damaged key
    packs/<aa>/<pack id>        packs (pack.py); the id is the BLAKE3 hash of the bytes
    index/<index id>            index files (index.py), one per snapshot run
    snapshots/<user>/<server>/<snapshot id>   manifests (manifest.py), written last
    gc/tombstones/<id>          packs garbage collection means to delete (gc.py)

Order of writes in a snapshot: packs, then the index file naming them, then the manifest.
A run killed before its manifest leaves packs nothing refers to; garbage collection removes
them once they are older than its safety margin. ``docs/snapshots.md`` has the format.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import quote

import blake3

from .crypto import ProjectKeys, diagnose_unwrap, key_check, seal, unseal
from .errors import (
    CorruptObject,
    DamagedKey,
    KeyUnavailable,
    ObjectMissing,
    SnapshotError,
    SnapshotNotFound,
)
from .index import Index, decode_index, encode_index
from .manifest import Manifest, owner_prefix, parse_manifest_name
from .pack import TREE, FinishedPack, Segment, open_segment, pack_name, read_pack_table
from .retry import with_retries
from .store import ObjectInfo, Store

REPOSITORY_VERSION = 1
# A snapshot run must commit within this long of taking its writer lock; garbage collection
# waits for younger locks before it deletes, and ignores older ones (a writer killed -9).
MAX_WRITER_S = 6 * 3600.0
TREE_CACHE_BYTES = 256 << 20  # packs and opened segments of trees kept by read_blob
DEFAULT_CHUNKER = {"min": 256 << 10, "avg": 1 << 20, "max": 4 << 20}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterLock:
    name: str
    taken_at: float  # time.monotonic() when it was written


@dataclass(frozen=True)
class SnapshotRef:
    user: str
    server: str
    id: str
    name: str  # the manifest's object name, inside the project's prefix


class Repository:
    def __init__(self, store: Store, project: str, keys: ProjectKeys, config: dict[str, object]):
        self.store = store
        self.project = project
        self.keys = keys
        self.config = config
        self.prefix = f"projects/{quote(project, safe='')}/"
        self._packs_cache: dict[str, bytes] = {}
        self._segments: dict[tuple[str, int], bytes] = {}
        self._cached_bytes = 0
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------- opening
    @classmethod
    def open(cls, store: Store, project: str, master_key: bytes, create: bool = True) -> Repository:
        """Open the project's repository, creating its config and key on first use. Two
        writers creating it at once agree: the key written first wins (conditional write)
        and the other reads it back. A key that does not open is told apart as a wrong
        master key (``KeyUnavailable``) or a damaged key file (``DamagedKey``) where the
        repository can tell (``crypto.diagnose_unwrap``)."""
        prefix = f"projects/{quote(project, safe='')}/"
        key_name, config_name = prefix + "keys/data", prefix + "config"
        check_name = prefix + "keys/check"
        try:
            sealed = with_retries(lambda: store.get(key_name), f"reading {key_name}")
        except ObjectMissing:
            if _holds_snapshots(store, prefix):
                raise DamagedKey(
                    key_name,
                    "it is missing, yet the repository holds snapshots: restore it from a "
                    "backup (a new key would not open them)",
                ) from None
            if not create:
                raise SnapshotNotFound(
                    f"project {project} has no snapshot repository yet"
                ) from None
            keys = ProjectKeys.generate()
            config = {"version": REPOSITORY_VERSION, "chunker": DEFAULT_CHUNKER}
            store.put(config_name, json.dumps(config).encode(), if_absent=True)
            if not store.put(key_name, keys.wrap(master_key, project), if_absent=True):
                sealed = store.get(key_name)  # another writer created it first
            else:
                store.put(check_name, key_check(master_key, project), if_absent=True)
                return cls(store, project, keys, config)
        try:
            keys = ProjectKeys.unwrap(master_key, project, sealed, key_name)
        except KeyUnavailable:
            try:
                check: bytes | None = with_retries(
                    lambda: store.get(check_name), f"reading {check_name}"
                )
            except ObjectMissing:
                check = None
            raise diagnose_unwrap(master_key, project, check, key_name) from None
        if create:  # repositories made before keys/check get theirs from their next writer
            with_retries(
                lambda: store.put(check_name, key_check(master_key, project), if_absent=True),
                f"writing {check_name}",
            )
        try:
            raw = with_retries(lambda: store.get(config_name), f"reading {config_name}")
        except ObjectMissing:
            raise CorruptObject(config_name, "missing, yet the repository has a key") from None
        try:
            config = json.loads(raw)
        except ValueError:
            raise CorruptObject(config_name, "it is not JSON") from None
        if not isinstance(config, dict) or config.get("version") != REPOSITORY_VERSION:
            version = config.get("version") if isinstance(config, dict) else None
            raise CorruptObject(config_name, f"repository version {version}")
        return cls(store, project, keys, config)

    def name(self, relative: str) -> str:
        return self.prefix + relative

    # ---------------------------------------------------------------- packs
    def write_pack(self, pack: FinishedPack) -> int:
        """Upload a pack (idempotent: named by its bytes); the bytes sent."""
        name = self.name(pack_name(pack.pack_id))
        with_retries(lambda: self.store.put(name, pack.data, if_absent=True), f"uploading {name}")
        return len(pack.data)

    def read_pack(self, pack_id: str) -> bytes:
        name = self.name(pack_name(pack_id))
        return with_retries(lambda: self.store.get(name), f"downloading {name}")

    def list_packs(self) -> Iterator[ObjectInfo]:
        for info in self.store.list(self.name("packs/")):
            yield info._replace(name=info.name.rsplit("/", 1)[-1])

    def delete_pack(self, pack_id: str) -> None:
        self.store.delete(self.name(pack_name(pack_id)))

    def read_blob(self, index: Index, blob_id: bytes) -> bytes:
        """One blob through the index, its content id checked. Meant for trees: their
        packs are read whole and their opened segments kept (a segment bundles hundreds
        of trees), up to ``TREE_CACHE_BYTES``."""
        location = index.get(blob_id)
        if location is None:
            raise ObjectMissing(blob_id.hex(), f"blob {blob_id.hex()} is in no pack of the index")
        key = (location.pack_id, location.segment_offset)
        with self._cache_lock:
            plain = self._segments.get(key)
        if plain is None:
            with self._cache_lock:
                data = self._packs_cache.get(location.pack_id)
            if data is None:
                data = self.read_pack(location.pack_id)
            name = self.name(pack_name(location.pack_id))
            end = location.segment_offset + location.segment_length
            plain = open_segment(self.keys, memoryview(data)[location.segment_offset : end], name)
            if location.blob_type == TREE:
                with self._cache_lock:
                    if self._cached_bytes + len(data) + len(plain) > TREE_CACHE_BYTES:
                        self._packs_cache.clear()
                        self._segments.clear()
                        self._cached_bytes = 0
                    if location.pack_id not in self._packs_cache:
                        self._packs_cache[location.pack_id] = data
                        self._cached_bytes += len(data)
                    self._segments[key] = plain
                    self._cached_bytes += len(plain)
        blob = plain[location.offset : location.offset + location.length]
        if self.keys.content_id(blob) != blob_id:
            raise CorruptObject(
                self.name(pack_name(location.pack_id)),
                f"blob {blob_id.hex()} does not match its id",
            )
        return blob

    # ---------------------------------------------------------------- index
    def load_index(self, workers: int = 8, attempts: int = 5, complete: bool = False) -> Index:
        """The union of every index file. Garbage collection replaces index files (the new
        one is written before the old ones are deleted), so a file listed and gone before
        it was read means: list again.

        An index file that does not open (changed, truncated) is left out with a warning
        naming it, and the tables of the packs no whole index file lists are read from the
        packs themselves instead, so no snapshot is lost with it (``Index.damaged_files``
        says what was found). ``complete``: read those tables even when every index file
        opened (``gc.rebuild_index``: an index file deleted leaves its packs unlisted)."""
        for attempt in range(1, attempts + 1):
            try:
                return self._load_index_once(workers, complete)
            except ObjectMissing:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    def _load_index_once(self, workers: int, complete: bool) -> Index:
        index = Index()
        # Index files before packs: every pack a listed index file names is stored before
        # that file was written, so the pack listing below has it.
        index.files = [info.name for info in self.store.list(self.name("index/"))]

        def fetch(name: str) -> tuple[str, list[tuple[str, list[Segment]]] | str]:
            sealed = with_retries(lambda: self.store.get(name), f"reading {name}")
            try:
                plain = unseal(self.keys.seal_key, b"index", sealed, name)
                return name, list(decode_index(plain, name))
            except CorruptObject as e:
                return name, e.detail

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for name, packs in pool.map(fetch, index.files):
                if isinstance(packs, str):
                    index.damaged_files[name] = packs
                    continue
                for pack_id, segments in packs:
                    index.add_pack(pack_id, segments)
            if complete or index.damaged_files:
                self._add_unlisted_packs(index, pool)
        for name, why in index.damaged_files.items():
            log.warning(
                "index file %s is damaged (%s): read the tables of %d packs no whole index "
                "file lists from the packs instead (%d did not open); `gpufleet snapshot "
                "rebuild-index` writes a whole index",
                name,
                why,
                index.tables_read,
                len(index.unreadable_packs),
            )
        return index

    def _add_unlisted_packs(self, index: Index, pool: ThreadPoolExecutor) -> None:
        """Index every stored pack the index lacks from the pack's own table (a pack is
        read whole: the store has no ranged reads)."""
        unlisted = [info.name for info in self.list_packs() if info.name not in index.packs]

        def table(pack_id: str) -> tuple[str, list[Segment] | str | None]:
            try:
                data = self.read_pack(pack_id)
            except ObjectMissing:
                return pack_id, None  # deleted since it was listed: nothing needs it
            try:
                return pack_id, read_pack_table(self.keys, data, self.name(pack_name(pack_id)))
            except CorruptObject as e:
                return pack_id, e.detail

        for pack_id, found in pool.map(table, unlisted):  # at most `workers` packs in memory
            if found is None:
                continue
            index.tables_read += 1
            if isinstance(found, str):
                index.unreadable_packs[pack_id] = found
            else:
                index.add_pack(pack_id, found)

    def write_index(self, packs: Iterable[tuple[str, Iterable[Segment]]]) -> tuple[str, int]:
        """An index file for ``packs``; its name and size."""
        sealed = seal(self.keys.seal_key, b"index", encode_index(packs))
        name = self.name("index/" + blake3.blake3(sealed).hexdigest())
        with_retries(lambda: self.store.put(name, sealed, if_absent=True), f"uploading {name}")
        return name, len(sealed)

    def list_index_files(self) -> list[ObjectInfo]:
        return list(self.store.list(self.name("index/")))

    # ------------------------------------------------------------ manifests
    def write_manifest(self, manifest: Manifest) -> int:
        sealed = seal(self.keys.seal_key, b"snapshot", manifest.encode())
        name = self.name(manifest.name)
        written = with_retries(
            lambda: self.store.put(name, sealed, if_absent=True), f"committing {name}"
        )
        if not written:
            raise CorruptObject(name, "a snapshot with this id exists already")
        return len(sealed)

    def snapshots(self, user: str | None = None, server: str | None = None) -> list[SnapshotRef]:
        """Snapshots in id (time) order, all of them or an owner's."""
        prefix = "snapshots/" if user is None else owner_prefix(user, server or "")
        if user is not None and server is None:
            prefix = prefix.rsplit("/", 2)[0] + "/"
        refs = []
        for info in self.store.list(self.name(prefix)):
            parsed = parse_manifest_name(info.name[len(self.prefix) :])
            if parsed is not None:
                refs.append(SnapshotRef(*parsed, name=info.name[len(self.prefix) :]))
        refs.sort(key=lambda r: r.id)
        return refs

    def find(self, snapshot_id: str) -> SnapshotRef:
        for ref in self.snapshots():
            if ref.id == snapshot_id or (len(snapshot_id) >= 8 and ref.id.endswith(snapshot_id)):
                return ref
        raise SnapshotNotFound(
            f"no snapshot {snapshot_id!r} in project {self.project}: "
            f"`gpufleet snapshot list` shows the ids"
        )

    def latest(self, user: str, server: str) -> SnapshotRef | None:
        refs = self.snapshots(user, server)
        return refs[-1] if refs else None

    def read_manifest(self, ref: SnapshotRef) -> Manifest:
        name = self.name(ref.name)
        try:
            sealed = with_retries(lambda: self.store.get(name), f"reading {name}")
        except ObjectMissing:
            raise SnapshotNotFound(f"snapshot {ref.id} was deleted") from None
        plain = unseal(self.keys.seal_key, b"snapshot", sealed, name)
        try:
            return Manifest.decode(plain)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # It opened, so this project's key sealed it: a format this version cannot read.
            raise CorruptObject(name, f"it does not parse as a manifest ({e!r})") from None

    def has_manifest(self, name: str) -> bool:
        return self.store.stat(self.name(name)) is not None

    def delete_manifest(self, ref: SnapshotRef) -> None:
        """Forget a snapshot; its data goes at the next garbage collection."""
        self.store.delete(self.name(ref.name))

    # ------------------------------------------------------ writers and GC
    def acquire_writer_lock(self, run_id: str) -> WriterLock:
        """Announce a snapshot run to garbage collection (``gc.py``): until this lock is
        released or older than ``MAX_WRITER_S``, no tombstone written after it is swept."""
        name = self.name(f"locks/{run_id}")
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        with_retries(lambda: self.store.put(name, body), f"writing {name}")
        return WriterLock(name, time.monotonic())

    def check_writer_lock(self, lock: WriterLock) -> None:
        if time.monotonic() - lock.taken_at > MAX_WRITER_S * 0.9:
            raise SnapshotError(
                f"this snapshot run took longer than {MAX_WRITER_S * 0.9:.0f} s; garbage "
                f"collection may have removed data it counted on, so it is not committed: "
                f"take it again"
            )

    def release_writer_lock(self, lock: WriterLock) -> None:
        self.store.delete(lock.name)

    def writer_locks(self) -> list[ObjectInfo]:
        return list(self.store.list(self.name("locks/")))

    def tombstones(self) -> list[tuple[ObjectInfo, list[str]]]:
        """Each tombstone and the pack ids it names."""
        found = []
        for info in self.store.list(self.name("gc/tombstones/")):
            try:
                sealed = self.store.get(info.name)
            except ObjectMissing:
                continue  # swept meanwhile
            packs = json.loads(unseal(self.keys.seal_key, b"tombstone", sealed, info.name))
            found.append((info, list(packs)))
        return found

    def tombstoned_packs(self) -> set[str]:
        return {p for _, packs in self.tombstones() for p in packs}

    def write_tombstone(self, pack_ids: Iterable[str]) -> str:
        sealed = seal(self.keys.seal_key, b"tombstone", json.dumps(sorted(pack_ids)).encode())
        name = self.name("gc/tombstones/" + blake3.blake3(sealed).hexdigest())
        with_retries(lambda: self.store.put(name, sealed), f"writing {name}")
        return name


def _holds_snapshots(store: Store, prefix: str) -> bool:
    """Whether a repository whose key is missing holds data that key sealed: then a new
    key must not be made. ``config`` is written before the key, so without it there is no
    repository; with it, a creator may still be on its way to writing the key, and index
    files or manifests tell the two apart (a creator has written neither yet)."""
    if store.stat(prefix + "config") is None:
        return False
    for part in ("index/", "snapshots/"):
        if next(iter(store.list(prefix + part)), None) is not None:
            return True
    return False
