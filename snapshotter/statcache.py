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
from pathlib import Path

import zstandard

# (inode, size, mtime_ns, ctime_ns)
FileSignature = tuple[int, int, int, int]

_VERSION = 2


def file_signature(st: os.stat_result) -> FileSignature:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


FileRecord = tuple[FileSignature, tuple[bytes, ...], tuple[tuple[int, int], ...]]


class StatCache:
    """``dirs``: path -> (listing signature, tree id); ``files``: path -> (stat signature,
    chunk ids, sparse data ranges). ``snapshot``: the manifest written with this cache;
    its directory shortcuts hold only while it exists (garbage collection never deletes
    what a manifest reaches)."""

    def __init__(
        self,
        files: dict[str, FileRecord] | None = None,
        dirs: dict[str, tuple[bytes, bytes]] | None = None,
        snapshot: str = "",
    ):
        self._files = files  # None until first needed, when loaded
        self.dirs = dirs if dirs is not None else {}
        self.snapshot = snapshot
        # The tables as stored, while unchanged: an unchanged snapshot writes them back as
        # they were, and never decodes the files of directories its cache vouches for.
        self._encoded_files: bytes | None = None
        self._encoded_dirs: bytes | None = None

    @property
    def files(self) -> dict[str, FileRecord]:
        if self._files is None:
            encoded = self._encoded_files
            self._files = (
                marshal.loads(zstandard.ZstdDecompressor().decompress(encoded)) if encoded else {}
            )
        return self._files

    def vouched_by(self, snapshot: str) -> StatCache:
        """The same cache, its shortcuts now held by ``snapshot``."""
        same = StatCache(self._files, self.dirs, snapshot)
        same._encoded_files, same._encoded_dirs = self._encoded_files, self._encoded_dirs
        return same

    def encode(self) -> bytes:
        # marshal: ten times faster than JSON both ways, which an unchanged snapshot of
        # 50,000 files feels. The cache is this machine's own file (never shared, never
        # from the store); one written by another Python version just fails to load.
        if self._encoded_files is None:
            compress = zstandard.ZstdCompressor(level=1).compress
            self._encoded_files = compress(marshal.dumps(self.files))
            self._encoded_dirs = compress(marshal.dumps(self.dirs))
        return marshal.dumps((_VERSION, self.snapshot, self._encoded_dirs, self._encoded_files))

    @classmethod
    def decode(cls, data: bytes) -> StatCache:
        version, snapshot, encoded_dirs, encoded_files = marshal.loads(data)
        if version != _VERSION:
            return cls()
        dirs = marshal.loads(zstandard.ZstdDecompressor().decompress(encoded_dirs))
        cache = cls(None, dirs, snapshot)
        cache._encoded_files, cache._encoded_dirs = encoded_files, encoded_dirs
        return cache


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
