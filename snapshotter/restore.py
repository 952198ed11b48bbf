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
   deepest first, so writing into them did not disturb their own mtimes (a file made by
   one write, most of them, gets its metadata from the worker that wrote it, through the
   open descriptor);
5. writes the stat cache afresh for the restored tree (``capture.prime_cache``).

A chunk that fails its check, or a pack that cannot be read, does not stop the others: the
restore finishes what it can and then raises ``DamagedSnapshot`` naming the files affected.
Overlay sources come back as an upper directory: deletions as whiteouts (character devices
0/0) and opaque directories with ``trusted.overlay.opaque=y``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import stat
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .collector import cycle_collector_paused
from .errors import CorruptObject, DamagedSnapshot, ObjectMissing, RestoreRefused, StoreError
from .index import Index, Location
from .manifest import Manifest, Source, SourceKind
from .pack import open_segment, pack_name
from .primed import StatSignature, prime_cache, signature_fields
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


@dataclass(slots=True)
class _Planned:
    path: str  # absolute target path
    rel: str
    node: Node


# A blob's writes: (target path, offset in the file, the file's node if this write is all
# of it) for every place it belongs.
_Targets = list[tuple[str, int, Node | None]]


@dataclass
class _Plan:
    entries: list[_Planned] = field(default_factory=list)  # parents before children
    dirs: list[_Planned] = field(default_factory=list)  # the same order
    links: list[_Planned] = field(default_factory=list)  # hard links
    # pack -> segment offset -> blob id -> where it is written
    writes: dict[str, dict[int, dict[bytes, _Targets]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict))
    )
    locations: dict[bytes, Location] = field(default_factory=dict)
    unlocated: set[str] = field(default_factory=set)  # files with a chunk no index lists
    bytes: int = 0
    files: int = 0


def _files_of(plan: _Plan, pack_id: str, blob_ids: Iterable[bytes] | None = None) -> set[str]:
    """The files that need ``blob_ids`` (all of the pack's when None) from a pack."""
    paths: set[str] = set()
    for blobs in plan.writes[pack_id].values():
        for blob_id, targets in blobs.items():
            if blob_ids is None or blob_id in blob_ids:
                paths.update(path for path, _, _ in targets)
    return paths


def _is_empty(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def walk_trees(
    repository: Repository, index: Index, tree: bytes, base: str = ""
) -> Iterator[tuple[str, Node]]:
    """Every (relative path, node) under a tree, depth first: a directory before what it
    holds, siblings in name order."""
    stack = [(base, tree)]
    while stack:
        rel, tree_id = stack.pop()
        prefix = f"{rel}/" if rel else ""
        nodes = decode_tree(repository.read_blob(index, tree_id))
        subdirs = []
        for node in nodes:
            yield prefix + node.name, node
            if node.type is NodeType.DIR:
                subdirs.append((prefix + node.name, node.subtree))
        stack.extend(reversed(subdirs))


def read_tree(
    repository: Repository, index: Index, tree: bytes, base: str = ""
) -> list[tuple[str, Node]]:
    """Every (relative path, node) under a tree, sorted by path components."""
    return sorted(walk_trees(repository, index, tree, base), key=lambda item: item[0].split("/"))


@cycle_collector_paused()  # see collector.py
def restore_snapshot(
    repository: Repository,
    manifest: Manifest,
    *,
    targets: Mapping[str, Path] | None = None,
    only: Collection[str] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    cache_dir: Path | None = None,
    on_progress: Callable[[RestoreProgress], None] | None = None,
) -> RestoreResult:
    """Restore every source of ``manifest`` (or those named in ``only``) to its own path,
    or to ``targets[source]``.

    ``workers``: processes that fetch, check and write the data and set the files'
    metadata (default: two per core, so one waits on the store while the other works);
    1 does everything in this process."""
    index = repository.load_index()
    progress = RestoreProgress()
    plan = _Plan()
    placed: list[tuple[Source, Path]] = []
    unknown = set(only or ()) - {s.name for s in manifest.sources}
    if unknown:
        raise RestoreRefused(
            f"snapshot {manifest.id} has no source {', '.join(sorted(unknown))}; it has "
            f"{', '.join(s.name for s in manifest.sources)}"
        )
    for source in manifest.sources:
        if only is not None and source.name not in only:
            continue
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
    _create(plan, overwrite)
    progress.phase = "data"
    processes = workers or 2 * (os.cpu_count() or 1)
    stats: dict[str, StatSignature] = {}
    with _workers(repository, plan, processes) as pool:
        damaged = _write_data(pool, plan, progress, on_progress, stats)
        for path in damaged:  # absent rather than half written: the error names them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        _link(plan, damaged)
        progress.phase = "metadata"
        _apply_metadata(pool, processes, plan, placed, damaged, stats)
    if damaged:
        raise DamagedSnapshot(manifest.id, "some data failed its integrity check", sorted(damaged))
    if cache_dir is not None:
        for source, target in placed:
            nodes = plan_for(plan, target)
            prime_cache(repository, index, source, target, nodes, cache_dir, manifest.name, stats)
    return RestoreResult(plan.files, plan.bytes, len(plan.writes))


def plan_for(plan: _Plan, target: Path) -> dict[str, Node]:
    prefix = str(target).rstrip("/") + "/"
    return {p.rel: p.node for p in plan.entries if p.path.startswith(prefix)}


def _plan_source(
    repository: Repository, index: Index, source: Source, target: Path, plan: _Plan
) -> None:
    prefix = str(target).rstrip("/") + "/"
    entries, writes, locations = plan.entries, plan.writes, plan.locations
    get = index.blobs.get
    regular, directory, hardlink = NodeType.FILE, NodeType.DIR, NodeType.HARDLINK
    # Written for speed: it runs once per path of the snapshot (50,000 for an environment).
    for rel, node in walk_trees(repository, index, source.tree):
        path = prefix + rel
        planned = _Planned(path, rel, node)
        entries.append(planned)
        kind = node.type
        if kind is not regular:
            if kind is directory:
                plan.dirs.append(planned)
            elif kind is hardlink:
                plan.links.append(planned)
            continue
        plan.files += 1
        plan.bytes += node.size
        if _written_whole(node):  # most files: one chunk, made by one write
            whole: Node | None = node
            pieces: Iterable[tuple[bytes, int]] = ((node.chunks[0], 0),)
        else:
            whole, pieces = None, _chunk_offsets(node, get)
        for blob_id, offset in pieces:
            location = get(blob_id)
            if location is None:
                plan.unlocated.add(path)
                continue
            locations[blob_id] = location
            blobs = writes[location.pack_id][location.segment_offset]
            targets = blobs.get(blob_id)
            if targets is None:
                blobs[blob_id] = [(path, offset, whole)]
            else:
                targets.append((path, offset, whole))


def _written_whole(node: Node) -> bool:
    """Whether one write makes the file (one chunk, no holes): the worker that writes it
    then sets its metadata through the open descriptor (``_finish``), and the metadata
    phase leaves it alone."""
    return len(node.chunks) == 1 and not node.sparse


def _chunk_offsets(
    node: Node, get: Callable[[bytes], Location | None]
) -> Iterator[tuple[bytes, int]]:
    """Each chunk with its offset in the file: back to back, or filling the sparse data
    ranges in order (a chunk never spans two ranges: each range was chunked on its own).
    A chunk the index does not list counts as empty here; the plan marks its file."""
    ranges = iter(node.sparse) if node.sparse else None
    at, left = 0, -1
    if ranges is not None:
        at, left = next(ranges, (0, 0))
    for blob_id in node.chunks:
        location = get(blob_id)
        length = location.length if location is not None else 0
        if ranges is not None:
            while left <= 0:
                at, left = next(ranges)
            left -= length
        yield blob_id, at
        at += length


def _missing(repository: Repository, plan: _Plan) -> set[str]:
    present = {info.name for info in repository.list_packs()}
    affected = set(plan.unlocated)
    for pack_id in plan.writes:
        if pack_id not in present:
            affected |= _files_of(plan, pack_id)
    return affected


def _create(plan: _Plan, overwrite: bool) -> None:
    """Directories, symlinks, special files, empty and sparse files. A file with data is
    created by the first write of its data (one open, not two)."""
    for entry in plan.entries:
        node, path = entry.node, entry.path
        kind = node.type
        if kind is NodeType.DIR:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:  # overwriting, or made for a source restored inside
                if not os.path.isdir(path) or os.path.islink(path):
                    _remove(path)
                    os.mkdir(path, 0o700)
            continue
        if overwrite and os.path.lexists(path):  # (an empty target has nothing to remove)
            _remove(path)
        if kind is NodeType.FILE:
            if node.chunks and not node.sparse:
                continue
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


# ------------------------------------------------------------------ workers
# What forked worker processes inherit: a restore's repository and plan, set just before
# they fork and never changed while they live. Each file is written by plain system calls
# from many processes at once: in threads they would queue for one interpreter lock.
_inherited: tuple[Repository, _Plan] | None = None
_T = TypeVar("_T")


class _InProcess(Executor):
    """The same tasks, run here: for ``workers=1`` and where ``fork`` is not available."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 -- as a worker's: raised by future.result()
            future.set_exception(e)
        return future


@contextlib.contextmanager
def _workers(repository: Repository, plan: _Plan, processes: int) -> Iterator[Executor]:
    global _inherited
    _inherited = (repository, plan)
    try:
        if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            yield _InProcess()
            return
        with ProcessPoolExecutor(
            max_workers=processes,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_reopen_store,
        ) as pool:
            yield pool
    finally:
        _inherited = None


def _reopen_store() -> None:
    """A forked worker's own connections to the store (a client's open connections must
    not be shared across processes)."""
    assert _inherited is not None
    repository = _inherited[0]
    repository.store = repository.store.reopen()


def _write_data(
    pool: Executor,
    plan: _Plan,
    progress: RestoreProgress,
    on_progress: Callable[[RestoreProgress], None] | None,
    stats: dict[str, StatSignature],
) -> set[str]:
    """Every pack fetched and written, a task each; the files that could not be. Adds
    the ``lstat`` of each file finished by its write to ``stats``."""
    damaged: set[str] = set()
    futures = {pool.submit(_write_pack, pack_id): pack_id for pack_id in plan.writes}
    for future in as_completed(futures):
        pack_id = futures[future]
        written, bad_blobs, finished = future.result()
        stats.update(finished)
        if bad_blobs is None:
            damaged |= _files_of(plan, pack_id)
        elif bad_blobs:
            damaged |= _files_of(plan, pack_id, bad_blobs)
        progress.bytes_done += written
        if on_progress is not None:
            on_progress(progress)
    return damaged


_Finished = list[tuple[str, StatSignature]]  # path, ``signature_fields`` of its lstat


def _write_pack(pack_id: str) -> tuple[int, set[bytes] | None, _Finished]:
    """In a worker: one pack's blobs, each checked against its id, written wherever they
    belong (``pwrite``: a file's chunks may come from several packs, in any order). The
    bytes written, the blobs that failed (None: the pack could not be read), and the
    files made by one write, finished (``_finish``) with their ``lstat``."""
    assert _inherited is not None
    repository, plan = _inherited
    finished: _Finished = []
    try:
        data = memoryview(repository.read_pack(pack_id))
    except (ObjectMissing, StoreError):
        return 0, None, finished
    keys, name = repository.keys, repository.name(pack_name(pack_id))
    locations = plan.locations
    bad: set[bytes] = set()
    written = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
    for segment_offset, blobs in plan.writes[pack_id].items():
        first = locations[next(iter(blobs))]
        try:
            plain = open_segment(
                keys, data[segment_offset : segment_offset + first.segment_length], name
            )
        except CorruptObject:
            bad.update(blobs)
            continue
        view = memoryview(plain)
        for blob_id, targets in blobs.items():
            location = locations[blob_id]
            blob = view[location.offset : location.offset + location.length]
            if keys.content_id(blob) != blob_id:
                bad.add(blob_id)
                continue
            for path, offset, whole in targets:
                # A file written whole is made with its permissions (``_finish``); a file
                # of several chunks gets them in the metadata phase.
                fd = os.open(path, flags, 0o600 if whole is None else whole.mode & 0o777)
                try:
                    os.pwrite(fd, blob, offset)
                    if whole is not None:
                        finished.append((path, _finish(fd, whole)))
                finally:
                    os.close(fd)
                written += len(blob)
    return written, bad, finished


def _finish(fd: int, node: Node) -> StatSignature:
    """``_set_metadata`` for a file written whole, through its descriptor (no path
    lookups); its ``signature_fields`` after. The file was made with its permission bits
    (``_write_pack``), and the owner is the restoring user's: mode and owner are changed
    only where they differ (the umask took a bit, set-id bits, a restore by another user,
    a set-group-id directory above): for nearly every file, no chmod and no chown."""
    _set_xattrs_and_mtime(fd, node)
    st = os.fstat(fd)
    if st.st_uid != node.uid or st.st_gid != node.gid:
        # chown clears set-id bits and file capabilities: everything else again after it.
        with contextlib.suppress(PermissionError):
            os.fchown(fd, node.uid, node.gid)
        _set_by_descriptor(fd, node)
        st = os.fstat(fd)
    elif st.st_mode & 0o7777 != node.mode & 0o7777:
        os.fchmod(fd, node.mode)  # moves the ctime, not the mtime
        st = os.fstat(fd)
    return signature_fields(st)


def _set_by_descriptor(fd: int, node: Node) -> None:
    os.fchmod(fd, node.mode)
    _set_xattrs_and_mtime(fd, node)


def _set_xattrs_and_mtime(fd: int, node: Node) -> None:
    for name, value in node.xattrs.items():
        try:
            os.setxattr(fd, name, value)
        except OSError:
            continue  # the target file system does not take this namespace
    os.utime(fd, ns=(node.mtime_ns, node.mtime_ns))


def _link(plan: _Plan, damaged: set[str]) -> None:
    """Hard links to their first path; a link to a damaged file is damaged too."""
    for entry in plan.links:
        root = entry.path[: len(entry.path) - len(entry.rel)]
        first = os.path.join(root, entry.node.link)
        if first in damaged:
            damaged.add(entry.path)
            continue
        os.link(first, entry.path)


# Not set by the workers: directories (after them, deepest first), hard links (their
# inode is their first path's) and sockets (not restored).
_NOT_HERE = (NodeType.DIR, NodeType.HARDLINK, NodeType.SOCKET)


def _apply_metadata(
    pool: Executor,
    processes: int,
    plan: _Plan,
    placed: list[tuple[Source, Path]],
    damaged: set[str],
    stats: dict[str, StatSignature],
) -> None:
    """Owners, modes, extended attributes and mtimes: everything but directories and the
    files finished by their write in the workers, and directories here, deepest first
    (writing into a directory moves its mtime; setting its children's metadata does not).
    Adds each restored path's ``lstat`` afterwards to ``stats``, for the stat cache.

    Directories are done while the workers do the files, unless a directory is to lose its
    owner's search permission and this is not root: then a worker could no longer reach
    the files below it, and directories wait for the files."""
    count = len(plan.entries)
    step = max(1024, -(-count // (4 * processes)))
    futures = [
        pool.submit(_file_metadata, start, min(start + step, count), damaged)
        for start in range(0, count, step)
    ]
    searchable = os.geteuid() == 0 or all(e.node.mode & stat.S_IXUSR for e in plan.dirs)
    if searchable:
        _directory_metadata(plan, placed, stats)
    for future in futures:
        stats.update(future.result())
    for entry in plan.links:  # their inode's metadata is set with its first path's
        if entry.path not in damaged:
            stats[entry.path] = signature_fields(os.lstat(entry.path))
            # Linking moved the inode's ctime after a worker took its first path's lstat.
            root = entry.path[: len(entry.path) - len(entry.rel)]
            first = os.path.join(root, entry.node.link)
            if first in stats:
                stats[first] = stats[entry.path]
    if not searchable:
        _directory_metadata(plan, placed, stats)
    for source, target in placed:  # the sources' own directories, last of all
        if source.root is not None:
            _set_metadata(str(target), source.root)
        stats[str(target)] = signature_fields(os.lstat(target))


def _directory_metadata(
    plan: _Plan, placed: list[tuple[Source, Path]], stats: dict[str, StatSignature]
) -> None:
    overlay_roots = tuple(str(t) for s, t in placed if s.kind is SourceKind.OVERLAY)
    for entry in reversed(plan.dirs):
        _set_metadata(entry.path, entry.node)
        if entry.node.opaque and overlay_roots and entry.path.startswith(overlay_roots):
            os.setxattr(entry.path, "trusted.overlay.opaque", b"y")
        stats[entry.path] = signature_fields(os.lstat(entry.path))


def _file_metadata(start: int, stop: int, damaged: set[str]) -> _Finished:
    """In a worker: metadata of the entries ``start:stop`` that are not directories, and
    what the stat cache needs of every such path's ``lstat`` afterwards (``StatSignature``
    as a plain tuple: the cheapest to send back)."""
    assert _inherited is not None
    stats: _Finished = []
    for entry in _inherited[1].entries[start:stop]:
        node, path = entry.node, entry.path
        kind = node.type
        if kind in _NOT_HERE or path in damaged:
            continue
        if kind is NodeType.FILE and _written_whole(node):
            continue  # finished by the worker that wrote it
        if kind is not NodeType.DELETED:
            _set_metadata(path, node)
        stats.append((path, signature_fields(os.lstat(path))))
    return stats


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
