"""Restoring a snapshot: files first, metadata last, every chunk checked against its id.

``restore_snapshot(repository, manifest, ...)``:
1. reads the trees and plans every path; refuses a non-empty target unless ``overwrite``
   (an overwrite replaces what the snapshot has and leaves the rest alone); checks that
   every pack it needs is in the store before it writes anything, and otherwise names the
   files that cannot be restored;
2. creates directories, symlinks, special files and empty files;
3. fetches the packs in parallel; each worker opens (decrypts, decompresses) the segments
   it needs, checks each blob's content id and writes it wherever it belongs (``pwrite``,
   so a file's chunks may arrive from several packs in any order; sparse files keep their
   holes);
4. hard links; then owners, modes, extended attributes and mtimes — directories last,
   deepest first, so writing into them did not disturb their own mtimes;
5. writes the stat cache afresh for the restored tree (``capture.prime_cache``).

A chunk that fails its check, or a pack that cannot be read, does not stop the others: the
restore finishes what it can and then raises ``DamagedSnapshot`` naming the files affected.
Overlay sources come back as an upper directory: deletions as whiteouts (character devices
0/0) and opaque directories with ``trusted.overlay.opaque=y``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CorruptObject, DamagedSnapshot, ObjectMissing, RestoreRefused, StoreError
from .index import Index, Location
from .manifest import Manifest, Source, SourceKind
from .pack import open_segment, pack_name
from .repository import Repository
from .tree import Node, NodeType, decode_tree


@dataclass
class RestoreProgress:
    phase: str = "plan"
    bytes_total: int = 0
    bytes_done: int = 0
    files_total: int = 0


@dataclass(frozen=True)
class RestoreResult:
    files: int
    bytes: int
    packs: int


@dataclass
class _Planned:
    path: str  # absolute target path
    rel: str
    node: Node


@dataclass
class _Plan:
    entries: list[_Planned] = field(default_factory=list)  # pre-order
    # pack -> segment offset -> blob id -> [(target path, offset in file)]
    writes: dict[str, dict[int, dict[bytes, list[tuple[str, int]]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    )
    locations: dict[bytes, Location] = field(default_factory=dict)
    files_of_blob: dict[bytes, set[str]] = field(default_factory=lambda: defaultdict(set))
    bytes: int = 0
    files: int = 0


def _is_empty(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def read_tree(
    repository: Repository, index: Index, tree: bytes, base: str = ""
) -> list[tuple[str, Node]]:
    """Every (relative path, node) under a tree, parents before children."""
    out: list[tuple[str, Node]] = []
    stack = [(base, tree)]
    while stack:
        rel, tree_id = stack.pop()
        nodes = decode_tree(repository.read_blob(index, tree_id))
        for node in nodes:
            child = f"{rel}/{node.name}" if rel else node.name
            out.append((child, node))
        for node in reversed(nodes):
            if node.type is NodeType.DIR:
                stack.append((f"{rel}/{node.name}" if rel else node.name, node.subtree))
    # Depth-first with explicit stack lists a directory before its children, but siblings'
    # subtrees after all siblings: sort so parents come first and order is stable.
    out.sort(key=lambda item: item[0].split("/"))
    return out


def restore_snapshot(
    repository: Repository,
    manifest: Manifest,
    *,
    targets: Mapping[str, Path] | None = None,
    overwrite: bool = False,
    workers: int = 8,
    cache_dir: Path | None = None,
    on_progress: Callable[[RestoreProgress], None] | None = None,
) -> RestoreResult:
    """Restore every source of ``manifest`` to its own path, or to ``targets[source]``."""
    index = repository.load_index()
    progress = RestoreProgress()
    plan = _Plan()
    placed: list[tuple[Source, Path]] = []
    for source in manifest.sources:
        target = (
            Path(targets[source.name]) if targets and source.name in targets else Path(source.path)
        )
        if not overwrite and not _is_empty(target):
            raise RestoreRefused(
                f"{target} is not empty: restore into an empty directory, or pass "
                f"--overwrite to replace what the snapshot holds there"
            )
        placed.append((source, target))
    for source, target in placed:
        _plan_source(repository, index, source, target, plan)
    missing = _missing(repository, plan)
    if missing:
        raise DamagedSnapshot(manifest.id, "data is missing from the store", sorted(missing))
    progress.phase, progress.bytes_total, progress.files_total = "files", plan.bytes, plan.files
    for _, target in placed:
        target.mkdir(parents=True, exist_ok=True)
    _create(plan)
    progress.phase = "data"
    damaged = _fetch_and_write(repository, plan, workers, progress, on_progress)
    for path in damaged:  # absent rather than half written: the error names them
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    _link(plan, damaged)
    progress.phase = "metadata"
    _apply_metadata(plan, placed, damaged)
    if damaged:
        raise DamagedSnapshot(manifest.id, "some data failed its integrity check", sorted(damaged))
    if cache_dir is not None:
        from .capture import prime_cache

        for source, target in placed:
            nodes = plan_for(plan, target)
            prime_cache(repository, index, source, target, nodes, cache_dir, manifest.name)
    return RestoreResult(plan.files, plan.bytes, len(plan.writes))


def plan_for(plan: _Plan, target: Path) -> dict[str, Node]:
    prefix = str(target).rstrip("/") + "/"
    return {p.rel: p.node for p in plan.entries if p.path.startswith(prefix)}


def _plan_source(
    repository: Repository, index: Index, source: Source, target: Path, plan: _Plan
) -> None:
    for rel, node in read_tree(repository, index, source.tree):
        path = os.path.join(target, rel)
        plan.entries.append(_Planned(path, rel, node))
        if node.type is not NodeType.FILE:
            continue
        plan.files += 1
        plan.bytes += node.size
        offsets = _offsets(node, index)
        for blob_id, offset in zip(node.chunks, offsets, strict=True):
            plan.files_of_blob[blob_id].add(path)
            location = index.get(blob_id)
            if location is None:
                continue
            plan.locations[blob_id] = location
            plan.writes[location.pack_id][location.segment_offset][blob_id].append((path, offset))


def _offsets(node: Node, index: Index) -> list[int]:
    """The file offset of each chunk: back to back, or filling the sparse data ranges in
    order (a chunk never spans two ranges: each range was chunked on its own)."""
    lengths = [loc.length if (loc := index.get(c)) is not None else 0 for c in node.chunks]
    offsets = []
    if not node.sparse:
        at = 0
        for length in lengths:
            offsets.append(at)
            at += length
        return offsets
    ranges = iter(node.sparse)
    start, left = next(ranges, (0, 0))
    at = start
    for length in lengths:
        while left <= 0:
            start, left = next(ranges)
            at = start
        offsets.append(at)
        at += length
        left -= length
    return offsets


def _missing(repository: Repository, plan: _Plan) -> set[str]:
    present = {info.name for info in repository.list_packs()}
    affected: set[str] = set()
    for blob_id, paths in plan.files_of_blob.items():
        location = plan.locations.get(blob_id)
        if location is None or location.pack_id not in present:
            affected |= paths
    return affected


def _create(plan: _Plan) -> None:
    for entry in plan.entries:
        node, path = entry.node, entry.path
        kind = node.type
        if kind is NodeType.DIR:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not os.path.isdir(path) or os.path.islink(path):
                    _remove(path)
                    os.mkdir(path, 0o700)
            continue
        if os.path.lexists(path):
            _remove(path)
        if kind is NodeType.FILE:
            if node.chunks and not node.sparse:
                continue  # created by the writer of its first chunk (one open, not two)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, node.size)
            finally:
                os.close(fd)
        elif kind is NodeType.SYMLINK:
            os.symlink(node.target, path)
        elif kind is NodeType.FIFO:
            os.mkfifo(path, 0o600)
        elif kind in (NodeType.CHAR, NodeType.BLOCK):
            flag = stat.S_IFCHR if kind is NodeType.CHAR else stat.S_IFBLK
            os.mknod(path, flag | 0o600, node.rdev)
        elif kind is NodeType.DELETED:
            os.mknod(path, stat.S_IFCHR | 0o000, 0)  # an overlay whiteout
        elif kind is NodeType.SOCKET:
            continue  # a socket belongs to the process that listened on it: not restored


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _fetch_and_write(
    repository: Repository,
    plan: _Plan,
    workers: int,
    progress: RestoreProgress,
    on_progress: Callable[[RestoreProgress], None] | None,
) -> set[str]:
    damaged: set[str] = set()
    lock = threading.Lock()
    keys = repository.keys

    def fetch(pack_id: str) -> tuple[str, bytes | None]:
        slots.acquire()  # released once the pack is written: bounds the packs in memory
        try:
            return pack_id, repository.read_pack(pack_id)
        except (ObjectMissing, StoreError):
            return pack_id, None

    def write(pack_id: str, data: bytes | None) -> None:
        try:
            write_pack(pack_id, data)
        finally:
            slots.release()

    def write_pack(pack_id: str, fetched: bytes | None) -> None:
        segments = plan.writes[pack_id]
        name = repository.name(pack_name(pack_id))
        if fetched is None:
            with lock:
                for blobs in segments.values():
                    for blob_id in blobs:
                        damaged.update(plan.files_of_blob[blob_id])
            return
        data = memoryview(fetched)
        written = 0
        for segment_offset, blobs in segments.items():
            first = plan.locations[next(iter(blobs))]
            try:
                plain = open_segment(
                    keys, data[segment_offset : segment_offset + first.segment_length], name
                )
            except CorruptObject:
                with lock:
                    for blob_id in blobs:
                        damaged.update(plan.files_of_blob[blob_id])
                continue
            view = memoryview(plain)
            for blob_id, targets in blobs.items():
                location = plan.locations[blob_id]
                blob = view[location.offset : location.offset + location.length]
                if keys.content_id(blob) != blob_id:
                    with lock:
                        damaged.update(plan.files_of_blob[blob_id])
                    continue
                for path, offset in targets:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                    try:
                        os.pwrite(fd, blob, offset)
                    finally:
                        os.close(fd)
                    written += len(blob)
        with lock:
            progress.bytes_done += written
            if on_progress is not None:
                on_progress(progress)

    # Fetching waits on the store, so many at once; writing is CPU and small system calls
    # under the GIL, where more threads than cores only contend.
    slots = threading.BoundedSemaphore(workers)
    writers = max(1, min(workers, os.cpu_count() or 1))
    with (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch") as fetching,
        ThreadPoolExecutor(max_workers=writers, thread_name_prefix="write") as writing,
    ):
        fetched = [fetching.submit(fetch, p) for p in plan.writes]
        written = [writing.submit(write, *f.result()) for f in as_completed(fetched)]
        for future in written:
            future.result()
    return damaged


def _link(plan: _Plan, damaged: set[str]) -> None:
    """Hard links to their first path; a link to a damaged file is damaged too."""
    for entry in plan.entries:
        if entry.node.type is not NodeType.HARDLINK:
            continue
        root = entry.path[: len(entry.path) - len(entry.rel)]
        first = os.path.join(root, entry.node.link)
        if first in damaged:
            damaged.add(entry.path)
            continue
        os.link(first, entry.path)


_NO_METADATA = (NodeType.HARDLINK, NodeType.DELETED, NodeType.SOCKET)


def _apply_metadata(plan: _Plan, placed: list[tuple[Source, Path]], damaged: set[str]) -> None:
    overlay_roots = {str(t) for s, t in placed if s.kind is SourceKind.OVERLAY}
    dirs = []
    for entry in plan.entries:
        node = entry.node
        if node.type is NodeType.DIR:
            dirs.append(entry)
        elif node.type not in _NO_METADATA and entry.path not in damaged:
            _set_metadata(entry.path, node)
    for entry in reversed(dirs):
        _set_metadata(entry.path, entry.node)
        if entry.node.opaque and any(entry.path.startswith(r) for r in overlay_roots):
            os.setxattr(entry.path, "trusted.overlay.opaque", b"y")
    for source, target in placed:  # the sources' own directories, last of all
        if source.root is not None:
            _set_metadata(str(target), source.root)


def _set_metadata(path: str, node: Node) -> None:
    symlink = node.type is NodeType.SYMLINK
    # Not root: files stay the restoring user's, as with a non-root tar -x. (Always set:
    # a setgid directory above the target gives new files its group, not ours.)
    with contextlib.suppress(PermissionError):
        os.chown(path, node.uid, node.gid, follow_symlinks=False)
    if not symlink:
        os.chmod(path, node.mode)
    for name, value in node.xattrs.items():
        try:
            os.setxattr(path, name, value, follow_symlinks=False)
        except OSError:
            continue  # the target file system does not take this namespace
    os.utime(path, ns=(node.mtime_ns, node.mtime_ns), follow_symlinks=False)
