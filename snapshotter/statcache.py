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
import marshal
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
        # marshal: ten times faster than JSON both ways, which an unchanged snapshot of
        # 50,000 files feels. The cache is this machine's own file (never shared, never
        # from the store); one written by another Python version just fails to load.
        payload = marshal.dumps((_VERSION, self.files, self.dirs, self.snapshot))
        return zstandard.ZstdCompressor(level=1).compress(payload)

    @classmethod
    def decode(cls, data: bytes) -> StatCache:
        version, files, dirs, snapshot = marshal.loads(
            zstandard.ZstdDecompressor().decompress(data)
        )
        if version != _VERSION:
            return cls()
        return cls(files, dirs, snapshot)


def cache_path(cache_dir: Path, store_uri: str, project: str, source_path: str) -> Path:
    key = hashlib.sha256(f"{store_uri}\0{project}\0{source_path}".encode()).hexdigest()[:32]
    return cache_dir / f"{key}.statcache"


def load(path: Path) -> StatCache:
    """The cache at ``path``; an empty one when there is none or it cannot be read (the
    snapshot then reads everything, which is slower but right)."""
    try:
        return StatCache.decode(path.read_bytes())
    except (OSError, ValueError, EOFError, TypeError, zstandard.ZstdError):
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
