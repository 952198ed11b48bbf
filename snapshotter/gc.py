"""Garbage collection, checking and repair: mark from the manifests, sweep in two steps;
``check`` reports what is damaged; ``rebuild_index`` writes a whole index from the packs.

A pack may be deleted only when no manifest needs it — now, or later by a snapshot run that
is still going. Runs of ``collect_garbage`` work in two steps, so that neither a snapshot
in progress nor a concurrent collection ever loses a pack a live manifest needs:

1. **mark**: every blob reachable from every manifest (all trees walked); a pack is live
   when the index places a live blob in it. A manifest whose trees cannot be read stops
   the run before anything is written: what it refers to is unknown.
2. **tombstone**: packs that are not live and older than ``margin_s`` are written to a
   tombstone. Snapshot runs that start after the tombstone never reuse its packs (they
   read the tombstones before the index, ``capture.py``).
3. **sweep** a tombstone older than ``margin_s``, unless a snapshot run that started
   before it still holds its writer lock (younger than ``repository.MAX_WRITER_S``): that
   run may have reused one of its packs. The packs the fresh mark still finds unused are
   deleted: first a new index without them is written, then the packs, then the index
   files it replaces (only those read at the start), then the tombstone.

Two collections at once only repeat each other's work: each marks afresh before it
deletes, and deleting twice is not an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import CorruptObject, ObjectMissing, RepositoryError, SnapshotNotFound, StoreError
from .index import Index
from .manifest import Manifest
from .pack import pack_name, verify_pack
from .repository import MAX_WRITER_S, Repository, SnapshotRef
from .restore import read_tree
from .store import ObjectInfo
from .tree import NodeType

CLOCK_SLACK_S = 2.0  # object times have a one-second resolution on S3
# A temporary file or an unfinished multipart upload this old belongs to a dead writer.
ABANDONED_AFTER_S = 3600.0


@dataclass
class GcReport:
    snapshots: int = 0
    live_packs: int = 0
    tombstoned: int = 0  # packs put on a new tombstone by this run
    deleted_packs: int = 0
    deleted_bytes: int = 0
    waiting_for: list[str] = field(default_factory=list)  # writer locks a sweep waits for
    abandoned: int = 0  # temporary files or unfinished uploads of killed writers removed


@dataclass
class CheckReport:
    snapshots: int = 0
    blobs: int = 0
    packs_read: int = 0
    problems: list[str] = field(default_factory=list)  # one line each, for people
    damaged_packs: list[str] = field(default_factory=list)  # pack ids
    damaged_index_files: list[str] = field(default_factory=list)  # object names
    damaged_manifests: list[str] = field(default_factory=list)  # snapshot ids


def mark(repository: Repository, index: Index, refs: Iterable[SnapshotRef]) -> set[bytes]:
    """Every blob id a manifest reaches (trees and chunks)."""
    live: set[bytes] = set()
    for ref in refs:
        try:
            manifest = repository.read_manifest(ref)
        except SnapshotNotFound:
            continue  # deleted since it was listed: what it reached is no longer needed
        _reach(repository, index, manifest, live)
    return live


def _reach(repository: Repository, index: Index, manifest: Manifest, live: set[bytes]) -> None:
    for source in manifest.sources:
        if source.tree in live:
            continue
        live.add(source.tree)
        for _, node in read_tree(repository, index, source.tree):
            if node.type is NodeType.DIR:
                live.add(node.subtree)
            elif node.type is NodeType.FILE:
                live.update(node.chunks)


def collect_garbage(
    repository: Repository, margin_s: float = 3600.0, now: float | None = None
) -> GcReport:
    now = time.time() if now is None else now
    report = GcReport()
    # Locks and tombstones, then manifests, index files and packs — the reverse of a
    # writer's order (packs, index, manifest, lock released): a writer whose lock is gone
    # here has its manifest in the listing below, every manifest listed finds its blobs
    # in the index read after it, and every pack of that index is in the listing after.
    locks = repository.writer_locks()
    tombstones = repository.tombstones()
    refs = repository.snapshots()
    report.snapshots = len(refs)
    index_files = repository.list_index_files()
    index = repository.load_index()
    stored = {info.name: info for info in repository.list_packs()}
    try:
        live_blobs = mark(repository, index, refs)
    except (ObjectMissing, CorruptObject, ValueError) as e:
        raise RepositoryError(
            f"garbage collection stopped before deleting anything: a snapshot's trees cannot "
            f"be read ({e}); run `gpufleet snapshot check` to find it"
        ) from e
    live_packs = {index.blobs[b].pack_id for b in live_blobs if b in index.blobs}
    report.live_packs = len(live_packs)
    # An index entry for a pack that is gone (deleted by a concurrent collection) must not
    # come back in the index this run writes.
    index.drop_packs(set(index.packs) - stored.keys())

    due: list[ObjectInfo] = []
    doomed: set[str] = set()
    for tomb, packs in tombstones:
        if now - tomb.modified < margin_s:
            continue
        blocking = [
            lock.name
            for lock in locks
            if lock.modified <= tomb.modified + CLOCK_SLACK_S and now - lock.modified < MAX_WRITER_S
        ]
        if blocking:
            report.waiting_for.extend(blocking)
            continue
        due.append(tomb)
        doomed.update(p for p in packs if p not in live_packs)
    # All due tombstones in one sweep: one new index replaces the ones read at the start.
    _sweep(repository, index, doomed, stored, index_files, report)
    for tomb in due:
        repository.store.delete(tomb.name)

    abandoned_before = now - max(margin_s, ABANDONED_AFTER_S)
    report.abandoned = repository.store.clean_abandoned(repository.prefix, abandoned_before)
    already = {p for _, packs in tombstones for p in packs}
    candidates = [
        name
        for name, info in stored.items()
        if name not in live_packs and name not in already and now - info.modified >= margin_s
    ]
    if candidates:
        repository.write_tombstone(candidates)
        report.tombstoned = len(candidates)
    return report


def _sweep(
    repository: Repository,
    index: Index,
    doomed: set[str],
    stored: dict[str, ObjectInfo],
    index_files: list[ObjectInfo],
    report: GcReport,
) -> None:
    if not doomed:
        return
    index.drop_packs(doomed)
    if index_files:
        repository.write_index((p, segments) for p, segments in sorted(index.packs.items()))
    for pack_id in sorted(doomed):
        info = stored.get(pack_id)
        try:
            repository.delete_pack(pack_id)
        except StoreError:
            continue  # left for the next run: it is still unused
        report.deleted_packs += 1
        report.deleted_bytes += info.size if info is not None else 0
    for info in index_files:
        repository.store.delete(info.name)


def check(repository: Repository, read_data: bool = False) -> CheckReport:
    """Every manifest opens, its trees are readable and every chunk is in a pack that
    exists; every index file opens. With ``read_data``, every stored pack is read whole
    and verified (``pack.verify_pack``): its name, its own table, every blob's id."""
    report = CheckReport()
    refs = repository.snapshots()  # before the index and packs: see collect_garbage
    report.snapshots = len(refs)
    index = repository.load_index()
    for name, why in index.damaged_files.items():
        report.damaged_index_files.append(name)
        report.problems.append(
            f"index file {name} is damaged ({why}); what it listed was read from the packs' "
            f"own tables: `gpufleet snapshot rebuild-index` writes a whole index"
        )
    damaged_packs: dict[str, list[str]] = {
        pack_id: [f"its own table does not open ({why}) and no index file lists it"]
        for pack_id, why in index.unreadable_packs.items()
    }
    stored = {info.name for info in repository.list_packs()}
    for ref in refs:
        try:
            manifest = repository.read_manifest(ref)
        except SnapshotNotFound:
            continue  # deleted since it was listed
        except CorruptObject as e:
            report.damaged_manifests.append(ref.id)
            report.problems.append(f"snapshot {ref.id}: its manifest is damaged: {e}")
            continue
        live: set[bytes] = set()
        try:
            _reach(repository, index, manifest, live)
        except (ObjectMissing, CorruptObject, ValueError) as e:
            report.problems.append(f"snapshot {ref.id}: its trees cannot be read: {e}")
            continue
        report.blobs += len(live)
        missing = [b for b in live if b not in index.blobs]
        if missing:
            report.problems.append(f"snapshot {ref.id}: {len(missing)} blob(s) in no pack")
        gone = {index.blobs[b].pack_id for b in live if b in index.blobs} - stored
        for pack_id in sorted(gone):
            report.problems.append(f"snapshot {ref.id}: pack {pack_id} is missing")
    if read_data:
        for pack_id in sorted(stored):
            try:
                data = repository.read_pack(pack_id)
            except ObjectMissing:
                continue  # deleted since it was listed (garbage collection)
            report.packs_read += 1
            name = repository.name(pack_name(pack_id))
            found = verify_pack(repository.keys, pack_id, data, name, index.packs.get(pack_id))
            if found:
                damaged_packs[pack_id] = found
    for pack_id, found in sorted(damaged_packs.items()):
        report.damaged_packs.append(pack_id)
        report.problems.append(f"pack {pack_id}: " + "; ".join(found))
    return report


@dataclass
class RebuildReport:
    packs: int = 0  # packs the new index lists
    tables_read: int = 0  # packs whose own table was read: those no whole index file listed
    written: str | None = None  # the new index file (None: no pack to list)
    replaced: list[str] = field(default_factory=list)  # index files it replaced, deleted
    damaged_files: list[str] = field(default_factory=list)  # of those, the damaged ones
    unreadable_packs: dict[str, str] = field(default_factory=dict)  # pack id -> why


def rebuild_index(repository: Repository, workers: int = 8) -> RebuildReport:
    """One whole index file, from every index file that opens and, for every stored pack
    none of them lists, the pack's own table; then the index files it replaces (damaged
    ones included) are deleted. Safe beside snapshot runs and garbage collection: an index
    file written after the listing is neither read nor deleted, and every pack a listed
    file names was stored before it, so the new file lists it. A pack whose own table
    does not open and that no index file lists cannot be indexed: it is reported."""
    index = repository.load_index(workers, complete=True)
    stored = {info.name for info in repository.list_packs()}
    index.drop_packs(set(index.packs) - stored)  # deleted by a collection meanwhile
    report = RebuildReport(
        packs=len(index.packs),
        tables_read=index.tables_read,
        damaged_files=sorted(index.damaged_files),
        unreadable_packs=dict(index.unreadable_packs),
    )
    if index.packs:
        report.written, _ = repository.write_index(sorted(index.packs.items()))
    for name in index.files:
        if name != report.written:
            repository.store.delete(name)
            report.replaced.append(name)
    return report
