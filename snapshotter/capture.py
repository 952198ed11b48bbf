"""Taking a snapshot: walk the sources, store what is new, commit the manifest last.

``create_snapshot(repository, sources, owner...)`` runs in three phases:
1. **walk** each source (a directory tree, an environment prefix, or an overlay upper
   directory's changes) and stat everything; a file whose stat signature matches the
   stat cache is not read again; every other regular file is queued for reading;
2. **read** queued files in worker threads: content-defined chunks (FastCDC; a file below
   the chunker's minimum is one chunk), keyed BLAKE3 ids, and every chunk the repository
   does not hold yet goes into a segment (small ones bundled), segments into packs, packs
   to the store while the walk goes on;
3. **trees** bottom-up, one blob per directory (an unchanged directory keeps its tree id
   from the stat cache), then the index file for the new packs, then the manifest.

Nothing before the manifest makes a snapshot: a run killed at any point leaves at most
packs and an index file that no manifest refers to, and the previous snapshot stays the
latest. The run holds a lock object while it works, which garbage collection respects
(``gc.py``); before it loads the index it reads the tombstones, so it never reuses a pack
that garbage collection is about to delete.
"""

from __future__ import annotations

import fnmatch
import marshal
import mmap
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from stat import S_ISREG
from typing import Any

import blake3
import zstandard
from pyfastcdc import FastCDC

from . import statcache
from .collector import cycle_collector_paused
from .errors import CaptureError
from .fileattrs import data_ranges, group_name, user_name, xattrs
from .index import Index
from .manifest import Manifest, Source, SourceKind, Stats, new_snapshot_id
from .pack import BUNDLE_BYTES, DATA, TREE, FinishedPack, PackAssembler, Segment, seal_segment
from .repository import Repository, SnapshotRef
from .tree import Node, NodeType, encode_entries, node_json


@dataclass(frozen=True)
class SourceSpec:
    """What to capture: ``path`` (absolute) as a tree, an environment prefix, or an overlay
    upper directory (``merged`` is its mounted view, read for file data)."""

    name: str
    path: Path
    kind: SourceKind = SourceKind.DIR
    exclude: tuple[str, ...] = ()
    merged: Path | None = None
    spec: dict[str, str] = field(default_factory=dict)


@dataclass
class CaptureProgress:
    """What a progress bar shows; ``on_progress`` gets it after every file read."""

    phase: str = "walk"
    files_total: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0


ProgressCallback = Callable[[CaptureProgress], None]


def compile_excludes(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A predicate on relative paths: fnmatch patterns, a match on a directory excluding
    its whole subtree (``.cache/pip`` also excludes ``.cache/pip/wheels/x``)."""
    listed = [p.strip("/") for p in patterns if p.strip("/")]
    if not listed:
        return lambda _path: False
    regex = re.compile("|".join(fnmatch.translate(p) for p in listed))
    return lambda path: regex.match(path) is not None


_by_name = attrgetter("name")


@dataclass(slots=True)
class _Entry:
    name: str
    st: os.stat_result
    node_type: NodeType
    # Where it is on disk; its extended attributes are read from there only when its
    # directory's tree is built (an unchanged directory needs none of them).
    where: str
    target: str = ""
    link: str = ""
    # A regular file's chunk ids and, when sparse, its data ranges: from the stat cache,
    # or once it has been read.
    content: tuple[tuple[bytes, ...], tuple[tuple[int, int], ...]] | None = None
    subdir: _Dir | None = None
    opaque: bool = False


# A child as the walk found it, before it becomes an _Entry: name, path, stat, type,
# symlink target, the first path of a hard link, and its own walk when a directory.
_Found = tuple[str, str, os.stat_result, NodeType, str, str, "_Dir | None"]


@dataclass(slots=True)
class _Dir:
    rel: str  # "" for the source's root
    st: os.stat_result | None
    entries: list[_Entry] = field(default_factory=list)
    tree: bytes = b""
    signature: bytes = b""
    # What a tree walk found here. Entries are made from it only when the stat cache does
    # not vouch for the whole directory: most directories of an unchanged source never
    # need one (overlay walks make their entries as they go, and leave this None).
    found: list[_Found] | None = None
    vouched: bool = False  # the stat cache's tree stands for it, unread


def _signature_row(
    name: str,
    node_type: NodeType,
    st: os.stat_result,
    target: str,
    link: str,
    opaque: bool,
    subdir_signature: bytes,
) -> tuple[Any, ...]:
    """What a directory's signature covers of one child: any change of content (ctime),
    owner, mode, name or link shows here."""
    return (
        name,
        node_type._value_,  # not .value: a property, and this runs once per path
        st.st_mode,
        st.st_uid,
        st.st_gid,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
        target,
        link,
        opaque,
        subdir_signature,
    )


def _signature(rows: list[tuple[Any, ...]]) -> bytes:
    # marshal format 2: from 3 on, an object met twice (a shared string) is written as a
    # back-reference and an interned string flagged, so equal rows could sign unequally.
    return blake3.blake3(marshal.dumps(rows, 2)).digest()


class _Run:
    """One snapshot run's shared state; the worker threads touch only what is locked."""

    def __init__(
        self,
        repository: Repository,
        index: Index,
        workers: int,
        level: int,
        on_progress: ProgressCallback | None,
    ):
        self.repository = repository
        self.keys = repository.keys
        self.index = index
        self.level = level
        chunker = repository.config.get("chunker", {})
        assert isinstance(chunker, dict)
        self.min_chunk = int(chunker["min"])
        self.cdc = FastCDC(
            avg_size=int(chunker["avg"]), min_size=self.min_chunk, max_size=int(chunker["max"])
        )
        self.readers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snap-read")
        self.uploads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="snap-upload")
        self.in_flight = threading.BoundedSemaphore(4)  # packs held in memory for upload
        self.upload_futures: list[Future[int]] = []
        self.lock = threading.Lock()
        self.seen: set[bytes] = set()
        # What the index file will list; a pack's bytes are dropped once uploaded.
        self.new_packs: list[tuple[str, tuple[Segment, ...]]] = []
        self.new_bytes = 0
        self.uploaded = 0
        self.local = threading.local()
        self.bundles: dict[int, list[tuple[bytes, int, bytes]]] = {DATA: [], TREE: []}
        self.bundle_sizes = {DATA: 0, TREE: 0}
        self.assemblers = {
            DATA: PackAssembler(self.keys, self._ship),
            TREE: PackAssembler(self.keys, self._ship),
        }
        self.progress = CaptureProgress()
        self.on_progress = on_progress

    # ------------------------------------------------------------- storing
    def compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self.local, "compressor", None)
        if compressor is None:
            compressor = self.local.compressor = zstandard.ZstdCompressor(level=self.level)
        return compressor

    def store_blob(self, blob_type: int, data: bytes | memoryview) -> bytes:
        """The blob's id; its content goes to a pack unless the repository has it."""
        blob_id = self.keys.content_id(data)
        with self.lock:
            if blob_id in self.seen or blob_id in self.index:
                return blob_id
            self.seen.add(blob_id)
            self.new_bytes += len(data)
        if len(data) >= BUNDLE_BYTES // 2:
            sealed = seal_segment(self.keys, self.compressor(), [(blob_id, blob_type, data)])
            self.assemblers[blob_type].add(sealed)
            return blob_id
        full = None
        with self.lock:
            bundle = self.bundles[blob_type]
            bundle.append((blob_id, blob_type, bytes(data)))
            self.bundle_sizes[blob_type] += len(data)
            if self.bundle_sizes[blob_type] >= BUNDLE_BYTES:
                full, self.bundles[blob_type] = bundle, []
                self.bundle_sizes[blob_type] = 0
        if full is not None:
            self.assemblers[blob_type].add(seal_segment(self.keys, self.compressor(), full))
        return blob_id

    def _ship(self, pack: FinishedPack) -> None:
        self.in_flight.acquire()  # back-pressure: readers wait while 4 packs are uploading

        def upload() -> int:
            try:
                sent = self.repository.write_pack(pack)
            finally:
                self.in_flight.release()
            with self.lock:
                self.new_packs.append((pack.pack_id, pack.segments))
                self.uploaded += sent
            return sent

        self.upload_futures.append(self.uploads.submit(upload))

    def flush(self) -> None:
        for blob_type in (DATA, TREE):
            bundle, self.bundles[blob_type] = self.bundles[blob_type], []
            if bundle:
                self.assemblers[blob_type].add(seal_segment(self.keys, self.compressor(), bundle))
            self.assemblers[blob_type].flush()
        for future in self.upload_futures:
            future.result()  # an upload that failed after its retries fails the run

    def close(self) -> None:
        self.readers.shutdown(wait=True, cancel_futures=True)
        self.uploads.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------- reading
    def read_all(self, entries: Sequence[_Entry]) -> None:
        """Phase 2: read every queued file in the worker threads. Small files go in
        batches (a future per 30,000 small files would cost more than reading them)."""
        self.progress.files_total = len(entries)
        self.progress.bytes_total = sum(e.st.st_size for e in entries)
        batches: list[list[_Entry]] = []
        batch: list[_Entry] = []
        batch_bytes = 0
        for entry in entries:
            if entry.st.st_size > self.min_chunk:
                batches.append([entry])
                continue
            batch.append(entry)
            batch_bytes += entry.st.st_size
            if len(batch) >= 256 or batch_bytes >= 8 << 20:
                batches.append(batch)
                batch, batch_bytes = [], 0
        if batch:
            batches.append(batch)
        for future in [self.readers.submit(self._read_batch, b) for b in batches]:
            future.result()

    def _read_batch(self, entries: list[_Entry]) -> None:
        done = 0
        for entry in entries:
            st = entry.st
            sparse = st.st_size > 0 and st.st_blocks * 512 < st.st_size
            entry.content = self.read_file(entry.where, st.st_size, sparse)
            done += st.st_size
        with self.lock:
            self.progress.files_done += len(entries)
            self.progress.bytes_done += done
            if self.on_progress is not None:
                self.on_progress(self.progress)

    def read_file(
        self, path: str, size: int, sparse: bool
    ) -> tuple[tuple[bytes, ...], tuple[tuple[int, int], ...]]:
        with open(path, "rb", buffering=0) as f:
            ranges = data_ranges(f.fileno(), size) if sparse else ()
            if ranges:
                chunks = []
                for offset, length in ranges:
                    chunks.extend(self._chunk(os.pread(f.fileno(), length, offset)))
            elif size <= self.min_chunk:
                chunks = [self.store_blob(DATA, f.read())] if size else []
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        chunks = self._chunk(view)
                    finally:
                        view.release()
        return tuple(chunks), tuple(ranges)

    def _chunk(self, data: bytes | memoryview) -> list[bytes]:
        if len(data) <= self.min_chunk:
            return [self.store_blob(DATA, data)] if len(data) else []
        ids = []
        for chunk in self.cdc.cut_buf(data):
            piece = chunk.data
            try:
                ids.append(self.store_blob(DATA, piece))
            finally:
                if isinstance(piece, memoryview):
                    piece.release()
        return ids


_TYPES = {
    stat.S_IFREG: NodeType.FILE,
    stat.S_IFDIR: NodeType.DIR,
    stat.S_IFLNK: NodeType.SYMLINK,
    stat.S_IFCHR: NodeType.CHAR,
    stat.S_IFBLK: NodeType.BLOCK,
    stat.S_IFIFO: NodeType.FIFO,
    stat.S_IFSOCK: NodeType.SOCKET,
}


class _Walker:
    """Phase 1 for one source: stat everything, queue the files the cache cannot vouch for."""

    def __init__(self, run: _Run, spec: SourceSpec, cache: statcache.StatCache, use_dirs: bool):
        self.run = run
        self.spec = spec
        self.cache = cache
        self.use_dirs = use_dirs
        self.excluded = compile_excludes(spec.exclude)
        self.links: dict[tuple[int, int], str] = {}
        self.files = 0
        self.bytes = 0
        self.reused = 0
        self.dirs: list[_Dir] = []  # post-order: children before their parent
        self.to_read: list[_Entry] = []
        self.unverified: list[_Entry] = []  # unchanged by the cache, chunks not yet checked
        self.rebuilt_dirs = 0  # directories whose tree the cache could not vouch for

    def classify(self, rel: str, path: str, st: os.stat_result) -> tuple[NodeType, str, str]:
        """A child's type, symlink target and (for the second and later paths of a hard
        link) its first path; regular files are counted here, once."""
        node_type = _TYPES.get(stat.S_IFMT(st.st_mode))
        if node_type is None:
            raise CaptureError(f"{path}: unknown file type {stat.S_IFMT(st.st_mode):o}")
        if node_type is NodeType.FILE:
            if st.st_nlink > 1:
                first = self.links.setdefault((st.st_dev, st.st_ino), rel)
                if first != rel:
                    return NodeType.HARDLINK, "", first
            self.files += 1
            self.bytes += st.st_size
        elif node_type is NodeType.SYMLINK:
            return node_type, os.readlink(path), ""
        return node_type, "", ""

    def entry(self, rel: str, name: str, found: _Found) -> _Entry:
        """An entry for what the walk found; a regular file goes to the readers unless the
        stat cache knows it unchanged."""
        _, path, st, node_type, target, link, subdir = found
        entry = _Entry(name, st, node_type, path, target, link, subdir=subdir)
        if node_type is NodeType.FILE:
            cached = self.cache.files.get(rel)
            if cached is not None and cached[0] == (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_ctime_ns,
            ):
                entry.content = (cached[1], cached[2])  # once the index has its chunks
                self.unverified.append(entry)
            else:
                self.to_read.append(entry)
        return entry

    def walk_tree(self, root: Path) -> _Dir:
        try:
            st = os.lstat(root)
        except OSError as e:
            raise CaptureError(f"cannot read source {self.spec.name} at {root}: {e}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise CaptureError(f"source {self.spec.name}: {root} is not a directory")
        return self._walk_dir("", str(root), st)

    def _walk_dir(self, rel: str, path: str, st: os.stat_result) -> _Dir:
        """Stat a directory's children (subdirectories first walked) and sign its listing;
        no entry objects yet (``settle`` makes them only where the cache does not vouch).
        This loop runs once per path of the source: it is what an unchanged snapshot
        costs, so the common case (a file with one link) stays inline."""
        found: list[_Found] = []
        here = _Dir(rel, st, found=found)
        try:
            with os.scandir(path) as listing:
                children = sorted(listing, key=_by_name)
        except OSError as e:
            raise CaptureError(f"cannot list {path}: {e}") from e
        excluded = self.excluded if self.spec.exclude else None
        prefix = f"{rel}/" if rel else ""
        rows: list[tuple[Any, ...]] = []
        files = size = 0
        for child in children:
            name = child.name
            if excluded is not None and excluded(prefix + name):
                continue
            try:
                child_st = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while walking
            subdir = None
            if S_ISREG(child_st.st_mode) and child_st.st_nlink == 1:
                node_type, target, link = NodeType.FILE, "", ""
                files += 1
                size += child_st.st_size
            else:
                node_type, target, link = self.classify(prefix + name, child.path, child_st)
                if node_type is NodeType.DIR:
                    if child_st.st_dev != st.st_dev:
                        continue  # another file system mounted here: not part of the source
                    subdir = self._walk_dir(prefix + name, child.path, child_st)
            found.append((name, child.path, child_st, node_type, target, link, subdir))
            # _signature_row's tuple, inline (a call per path is a tenth of this loop);
            # tests check that both sign a restored tree alike.
            rows.append(
                (
                    name,
                    node_type._value_,
                    child_st.st_mode,
                    child_st.st_uid,
                    child_st.st_gid,
                    child_st.st_size,
                    child_st.st_mtime_ns,
                    child_st.st_ctime_ns,
                    child_st.st_ino,
                    target,
                    link,
                    False,
                    subdir.signature if subdir is not None else b"",
                )
            )
        self.files += files
        self.bytes += size
        here.signature = _signature(rows)
        self.dirs.append(here)
        return here

    def walk_overlay(self, upper: Path, merged: Path | None) -> _Dir:
        from .overlay import ChangeKind, read_upper

        try:
            root_st = os.lstat(merged or upper)
        except OSError as e:
            raise CaptureError(f"cannot read overlay source {self.spec.name}: {e}") from e
        dirs: dict[str, _Dir] = {"": _Dir("", root_st)}
        order: list[_Dir] = []
        for change in read_upper(upper, merged):
            parent_rel, _, name = change.path.rpartition("/")
            parent = dirs.get(parent_rel)
            if parent is None or self.excluded(change.path):
                continue  # under an excluded or deleted directory
            if change.kind is ChangeKind.DELETED:
                st = os.lstat(upper)  # a placeholder; DELETED nodes keep no metadata
                parent.entries.append(_Entry(name, st, NodeType.DELETED, ""))
                continue
            path = os.path.join(merged or upper, change.path)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            node_type, target, link = self.classify(change.path, path, st)
            subdir = None
            if node_type is NodeType.DIR:
                subdir = dirs[change.path] = _Dir(change.path, st)
                order.append(subdir)
            entry = self.entry(change.path, name, (name, path, st, node_type, target, link, subdir))
            entry.opaque = change.kind is ChangeKind.OPAQUE
            parent.entries.append(entry)
        # Children were listed after their parents: reversed, they come first.
        self.dirs.extend(reversed(order))
        self.dirs.append(dirs[""])
        return dirs[""]

    def settle(self) -> None:
        """After the walk, with the index loaded: a directory whose listing signature is
        the one the stat cache holds keeps its tree, and nothing in it is looked at again
        (the cache's manifest still exists, so everything the tree reaches is stored).
        The others get their entries; their files the cache knows keep their chunks if the
        index still has them all (garbage collection may have removed them), and all
        other files are read."""
        use_dirs, cached_dirs, index = self.use_dirs, self.cache.dirs, self.run.index
        for here in self.dirs:
            if here.found is None:
                continue  # an overlay's: its entries were made by the walk
            cached = cached_dirs.get(here.rel) if use_dirs else None
            if cached is not None and cached[0] == here.signature and cached[1] in index:
                here.tree, here.vouched = cached[1], True
                self.reused += sum(1 for f in here.found if f[3] is NodeType.FILE)
                continue
            prefix = f"{here.rel}/" if here.rel else ""
            here.entries = [self.entry(prefix + f[0], f[0], f) for f in here.found]
        has_all = index.has_all
        for entry in self.unverified:
            assert entry.content is not None
            if has_all(entry.content[0]):
                self.reused += 1
            else:
                entry.content = None
                self.to_read.append(entry)
        self.unverified = []

    # ---------------------------------------------------------------- trees
    def build_trees(self) -> None:
        """Phase 3: each directory's tree, children first."""
        for here in self.dirs:
            if here.vouched:
                continue
            if not here.signature:
                here.signature = self.signature(here)
            cached = self.cache.dirs.get(here.rel) if self.use_dirs else None
            if cached is not None and cached[0] == here.signature and cached[1] in self.run.index:
                here.tree = cached[1]
                continue
            self.rebuilt_dirs += 1
            entries = [self._node_json(e) for e in here.entries]
            here.tree = self.run.store_blob(TREE, encode_entries(entries))

    def signature(self, here: _Dir) -> bytes:
        return _signature(
            [
                _signature_row(
                    e.name,
                    e.node_type,
                    e.st,
                    e.target,
                    e.link,
                    e.opaque,
                    e.subdir.signature if e.subdir is not None else b"",
                )
                for e in here.entries
            ]
        )

    def _node_json(self, e: _Entry) -> dict[str, object]:
        if e.node_type is NodeType.DELETED:
            return node_json(e.name, NodeType.DELETED)
        st = e.st
        chunks, sparse = e.content if e.content is not None else ((), ())
        kind = e.node_type
        return node_json(
            e.name,
            kind,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
            st.st_gid,
            user_name(st.st_uid),
            group_name(st.st_gid),
            st.st_mtime_ns,
            st.st_size if kind is NodeType.FILE else 0,
            xattrs(e.where),
            chunks,
            sparse,
            e.target,
            st.st_rdev if kind is NodeType.CHAR or kind is NodeType.BLOCK else 0,
            e.link,
            e.subdir.tree if e.subdir is not None else b"",
            e.opaque,
        )

    def root_node(self) -> Node:
        root = self.dirs[-1]
        assert root.st is not None
        entry = _Entry("", root.st, NodeType.DIR, str(self.spec.path), subdir=root)
        return Node.from_json(self._node_json(entry))

    def new_cache(self, snapshot: str) -> statcache.StatCache:
        if self.use_dirs and not self.to_read and not self.rebuilt_dirs:
            # Nothing changed: the same cache, vouched for by the new manifest.
            return self.cache.vouched_by(snapshot)
        fresh = statcache.StatCache(snapshot=snapshot)
        for here in self.dirs:
            fresh.dirs[here.rel] = (here.signature, here.tree)
            prefix = f"{here.rel}/" if here.rel else ""
            if here.vouched:
                assert here.found is not None
                for name, _, _, node_type, *_ in here.found:
                    kept = self.cache.files.get(prefix + name)
                    if node_type is NodeType.FILE and kept is not None:
                        fresh.files[prefix + name] = kept
                continue
            for e in here.entries:
                if e.node_type is not NodeType.FILE:
                    continue
                chunks, sparse = e.content if e.content is not None else ((), ())
                fresh.files[prefix + e.name] = (statcache.file_signature(e.st), chunks, sparse)
        return fresh


@cycle_collector_paused()  # see collector.py
def create_snapshot(
    repository: Repository,
    sources: Sequence[SourceSpec],
    *,
    user: str,
    server: str = "",
    cache_dir: Path | None = None,
    tags: Sequence[str] = (),
    workers: int | None = None,
    compression_level: int = 3,
    on_progress: ProgressCallback | None = None,
    now: float | None = None,
) -> Manifest:
    """Snapshot ``sources`` for ``user``'s ``server``; the committed manifest."""
    started = time.monotonic()
    snapshot_id = new_snapshot_id(now)
    lock = repository.acquire_writer_lock(snapshot_id)
    try:
        run = _Run(
            repository, Index(), workers or os.cpu_count() or 2, compression_level, on_progress
        )
        walked, parent = _store_sources(run, sources, user, server, cache_dir)
        uploaded = run.uploaded
        if run.new_packs:
            _, size = repository.write_index(run.new_packs)
            uploaded += size
        manifest = Manifest(
            id=snapshot_id,
            project=repository.project,
            user=user,
            server=server,
            created_at=now if now is not None else time.time(),
            hostname=socket.gethostname(),
            sources=tuple(_manifest_source(w.walker) for w in walked),
            stats=_stats([w.walker for w in walked], run, uploaded, started),
            parent=parent.id if parent is not None else None,
            tags=tuple(tags),
        )
        repository.check_writer_lock(lock)
        manifest = _with_upload(manifest, repository.write_manifest(manifest) + uploaded)
        for w in walked:
            if w.cache_file is not None:
                statcache.save(w.cache_file, w.walker.new_cache(manifest.name))
        return manifest
    finally:
        repository.release_writer_lock(lock)


@dataclass(frozen=True)
class _Walked:
    walker: _Walker
    cache_file: Path | None  # where its stat cache is kept; None: no cache
    # Whether the snapshot its stat cache was written for still exists (None: the cache
    # names none): only then may the cache's trees stand for unread directories.
    alive: Future[bool] | None


def _store_sources(
    run: _Run,
    sources: Sequence[SourceSpec],
    user: str,
    server: str,
    cache_dir: Path | None,
) -> tuple[list[_Walked], SnapshotRef | None]:
    """Walk, read and store every source, trees included: the sources as walked, and
    the snapshot this one follows (the owner's latest, or None)."""
    repository = run.repository

    # Lock, tombstones, packs, index — in this order (see gc.py): what is left is stored
    # now, and stays stored until this run has committed or given up. Those requests go
    # on while the sources are walked; the walk needs none of them.
    def prepare() -> tuple[Index, SnapshotRef | None]:
        tombstoned = repository.tombstoned_packs()
        stored = {info.name for info in repository.list_packs()}
        index = repository.load_index()
        index.drop_packs(tombstoned | (set(index.packs) - stored))
        return index, repository.latest(user, server)

    preparing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snap-prepare")
    try:
        prepared = preparing.submit(prepare)
        walked = [_walk(run, spec, cache_dir, preparing) for spec in sources]
        run.index, parent = prepared.result()
        for w in walked:
            w.walker.use_dirs = w.alive is not None and w.alive.result()
            w.walker.settle()
        run.progress.phase = "read"
        run.read_all([e for w in walked for e in w.walker.to_read])
        run.progress.phase = "trees"
        for w in walked:
            w.walker.build_trees()
        run.progress.phase = "upload"
        run.flush()
    finally:
        preparing.shutdown(wait=True, cancel_futures=True)
        run.close()
    return walked, parent


def _walk(
    run: _Run, spec: SourceSpec, cache_dir: Path | None, preparing: ThreadPoolExecutor
) -> _Walked:
    """Phase 1 for one source, with the stat cache its last snapshot left."""
    repository = run.repository
    cache_file = (
        statcache.cache_path(cache_dir, repository.store.uri, repository.project, str(spec.path))
        if cache_dir is not None
        else None
    )
    cache = statcache.load(cache_file) if cache_file else statcache.StatCache()
    alive = preparing.submit(repository.has_manifest, cache.snapshot) if cache.snapshot else None
    walker = _Walker(run, spec, cache, use_dirs=False)
    if spec.kind is SourceKind.OVERLAY:
        walker.walk_overlay(spec.path, spec.merged)
    else:
        walker.walk_tree(spec.path)
    return _Walked(walker, cache_file, alive)


def _manifest_source(w: _Walker) -> Source:
    return Source(
        name=w.spec.name,
        path=str(w.spec.path),
        kind=w.spec.kind,
        tree=w.dirs[-1].tree,
        files=w.files,
        bytes=w.bytes,
        exclude=w.spec.exclude,
        spec=w.spec.spec,
        root=w.root_node(),
    )


def _stats(walkers: Sequence[_Walker], run: _Run, uploaded: int, started: float) -> Stats:
    return Stats(
        files=sum(w.files for w in walkers),
        dirs=sum(len(w.dirs) for w in walkers),
        bytes=sum(w.bytes for w in walkers),
        reused_files=sum(w.reused for w in walkers),
        reused_dirs=sum(len(w.dirs) - w.rebuilt_dirs for w in walkers),
        new_bytes=run.new_bytes,
        uploaded_bytes=uploaded,
        duration_s=round(time.monotonic() - started, 3),
    )


def _with_upload(manifest: Manifest, uploaded: int) -> Manifest:
    """The manifest as returned to the caller, its upload figure including itself (the
    stored one cannot count its own bytes)."""
    return replace(manifest, stats=replace(manifest.stats, uploaded_bytes=uploaded))
