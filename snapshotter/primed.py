"""The stat cache of a freshly restored tree, as if it had just been snapshotted.

``prime_cache`` writes, for a restored source, the restored files' new inodes and ctimes
with the chunks they were restored from, and every directory's listing signature with its
tree id, so the next snapshot of that tree reads nothing. The signatures must be those a
walk (``capture._Walker``) would compute: the tests check that a snapshot right after a
restore re-encodes no directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from operator import itemgetter
from pathlib import Path

from . import statcache
from .capture import SourceSpec, _Run, _signature, _Walker
from .index import Index
from .manifest import Source, SourceKind
from .repository import Repository
from .tree import Node, NodeType

# What a listing's signature and the stat cache read of an ``lstat``, as a plain tuple
# (``signature_fields``): what a restore's worker processes send back of each path (a whole
# ``os.stat_result`` costs eight times as much to pass between processes), in the order a
# signature row holds them (``capture._signature_row``).
StatSignature = tuple[int, ...]  # mode, uid, gid, size, mtime_ns, ctime_ns, ino


def signature_fields(st: os.stat_result) -> StatSignature:
    """An ``lstat``'s ``StatSignature``."""
    return (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _file_part(st: StatSignature) -> statcache.FileSignature:
    """What the stat cache keeps of a file's ``StatSignature`` (``statcache.file_signature``)."""
    return (st[6], st[3], st[4], st[5])  # inode, size, mtime, ctime


def prime_cache(
    repository: Repository,
    index: Index,
    source: Source,
    target: Path,
    nodes: dict[str, Node],
    cache_dir: Path,
    snapshot: str,
    stats: Mapping[str, StatSignature] | None = None,
) -> None:
    """The stat cache of a freshly restored ``target``, as if it had just been snapshotted:
    the restored files' new inodes and ctimes with the chunks they were restored from, and
    every directory's signature with its tree id, so the next snapshot reads nothing.

    Directory trees need each restored path's ``lstat`` (from ``stats``, by absolute path,
    where the restore took them): what else a walk would find is known from the manifest.
    Overlay sources are walked, as a snapshot of them would be."""
    stats = stats or {}
    run = _Run(repository, index, 1, 1, None)
    try:
        # An overlay walk finds its files in this cache, as unchanged.
        cache = statcache.StatCache()
        if source.kind is SourceKind.OVERLAY:
            for rel, node in nodes.items():
                if node.type is NodeType.FILE:
                    restored = os.path.join(target, rel)
                    got = stats.get(restored) or signature_fields(os.lstat(restored))
                    cache.files[rel] = (
                        _file_part(got),
                        tuple(node.chunks),
                        tuple(node.sparse),
                    )
        trees = {rel: node.subtree for rel, node in nodes.items() if node.type is NodeType.DIR}
        trees[""] = source.tree
        if source.kind is SourceKind.OVERLAY:
            spec = SourceSpec(source.name, target, source.kind, source.exclude)
            walker = _Walker(run, spec, cache, use_dirs=False)
            walker.walk_overlay(target, None)
            for here in walker.dirs:
                here.signature = walker.signature(here)
                here.tree = trees.get(here.rel, b"")
            cache = walker.new_cache(snapshot)
        else:
            cache = _restored_cache(target, nodes, stats, trees, snapshot)
        path = statcache.cache_path(
            cache_dir, repository.store.uri, repository.project, str(target)
        )
        statcache.save(path, cache)
    finally:
        run.close()


def _restored_cache(
    target: Path,
    nodes: dict[str, Node],
    stats: Mapping[str, StatSignature],
    trees: Mapping[str, bytes],
    snapshot: str,
) -> statcache.StatCache:
    """The stat cache a walk of a restored tree would leave: each directory's listing
    signed as ``_Walker._walk_dir`` signs it (children in name order, subdirectories'
    signatures within), from the restored paths' fresh ``lstat``."""
    prefix = f"{target}/"
    children: dict[str, list[tuple[str, str, Node]]] = {"": []}
    for rel, node in nodes.items():
        if node.type is NodeType.SOCKET:
            continue  # not restored: a walk will not find it
        if node.type is NodeType.DIR:
            children.setdefault(rel, [])
        parent, _, name = rel.rpartition("/")
        children.setdefault(parent, []).append((name, rel, node))
    cache = statcache.StatCache(snapshot=snapshot)
    files = cache.files
    signatures: dict[str, bytes] = {}
    directory, regular = NodeType.DIR, NodeType.FILE
    for rel in sorted(children, key=lambda r: -r.count("/") if r else 1):  # deepest first
        rows = []
        for name, child, node in sorted(children[rel], key=itemgetter(0)):
            path = prefix + child
            st = stats.get(path) or signature_fields(os.lstat(path))
            kind = node.type
            # capture._signature_row, from the plain fields (they are in its order).
            sub = signatures.get(child, b"") if kind is directory else b""
            rows.append((name, kind._value_, *st, node.target, node.link, node.opaque, sub))
            if kind is regular:
                files[child] = (
                    _file_part(st),
                    tuple(node.chunks),
                    tuple(node.sparse),
                )
        signatures[rel] = _signature(rows)
        cache.dirs[rel] = (signatures[rel], trees.get(rel, b""))
    return cache
