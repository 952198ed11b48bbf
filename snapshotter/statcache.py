"""The stat cache: what an unchanged file or directory was stored as, so the next snapshot
of the same source does not read it again.

Per source (a path on this machine, in one project's repository) a file maps each path to
its stat signature — inode, size, mtime and ctime in nanoseconds (ctime moves on any
change of content, mode, owner or extended attributes) — and the chunk ids it was stored
as; and each directory to the signature of its whole listing and its tree id, so an
unchanged directory is not even re-encoded.

The cache is an accelerator and never the truth: a cached chunk is used only while the
repository's index still lists it (in a pack that exists and is not tombstoned), and
directory shortcuts only while the manifest written with the cache still exists — then
everything it reaches is still stored. Anything else is read again. A restore writes
the cache afresh from the restored files' new inodes and ctimes (``restore.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

# (inode, size, mtime_ns, ctime_ns)
FileSignature = tuple[int, int, int, int]

_VERSION = 1


def file_signature(st: os.stat_result) -> FileSignature:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class StatCache:
    files: dict[str, tuple[FileSignature, tuple[bytes, ...], tuple[tuple[int, int], ...]]] = field(
        default_factory=dict
    )
    dirs: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # path -> (sig, tree)
    # The manifest written with this cache: its directory shortcuts hold only while it
    # exists (garbage collection never deletes what a manifest reaches).
    snapshot: str = ""

    def encode(self) -> bytes:
        raw = {
            "v": _VERSION,
            "snapshot": self.snapshot,
            "f": {
                p: [list(sig), b"".join(chunks).hex(), [list(r) for r in sparse]]
                for p, (sig, chunks, sparse) in self.files.items()
            },
            "d": {p: [sig.hex(), tree.hex()] for p, (sig, tree) in self.dirs.items()},
        }
        return zstandard.ZstdCompressor(level=1).compress(json.dumps(raw).encode())

    @classmethod
    def decode(cls, data: bytes) -> StatCache:
        raw = json.loads(zstandard.ZstdDecompressor().decompress(data))
        if raw.get("v") != _VERSION:
            return cls()
        files = {}
        for path, (sig, chunks_hex, sparse) in raw["f"].items():
            joined = bytes.fromhex(chunks_hex)
            chunks = tuple(joined[i : i + 32] for i in range(0, len(joined), 32))
            files[path] = (tuple(sig), chunks, tuple(tuple(r) for r in sparse))
        dirs = {p: (bytes.fromhex(s), bytes.fromhex(t)) for p, (s, t) in raw["d"].items()}
        return cls(files, dirs, str(raw["snapshot"]))


def cache_path(cache_dir: Path, store_uri: str, project: str, source_path: str) -> Path:
    key = hashlib.sha256(f"{store_uri}\0{project}\0{source_path}".encode()).hexdigest()[:32]
    return cache_dir / f"{key}.statcache"


def load(path: Path) -> StatCache:
    """The cache at ``path``; an empty one when there is none or it cannot be read (the
    snapshot then reads everything, which is slower but right)."""
    try:
        return StatCache.decode(path.read_bytes())
    except (OSError, ValueError, KeyError, TypeError, zstandard.ZstdError):
        return StatCache()


def save(path: Path, cache: StatCache) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cache.encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
