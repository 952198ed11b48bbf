"""``LocalStore``, a store in a local directory, and ``open_store``, which opens a store by
its URI; what every store guarantees is in ``objects.py``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from .errors import ObjectMissing, StoreConfigError, StoreFull, StoreRefused, StoreUnreachable
from .objects import ObjectInfo, Store

__all__ = ["LocalStore", "ObjectInfo", "Store", "open_store"]


class LocalStore:
    """A store in a local directory: one file per object, written to a temporary file in
    the same directory, flushed to disk, then linked (``if_absent``) or renamed into place."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _mapped(e, str(self.root)) from e

    @property
    def uri(self) -> str:
        return f"file://{self.root}"

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") for p in parts):
            raise StoreConfigError(f"object name {name!r} is not a relative a/b/c path")
        return self.root.joinpath(*parts)

    def put(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        path = self._path(name)
        if if_absent and path.exists():
            return False
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)  # fails if the name exists: never replaces
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, path)
                tmp = None
            _fsync_dir(path.parent)
            return True
        except OSError as e:
            raise _mapped(e, name) from e
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(name) from None
        except OSError as e:
            raise _mapped(e, name) from e

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # Walk only the folder the prefix names, then filter by the rest of it.
        folder, _, _ = prefix.rpartition("/")
        start = self._path(folder) if folder else self.root
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            for filename in filenames:
                if filename.startswith(".tmp-"):
                    continue
                full = os.path.join(dirpath, filename)
                name = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not name.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue  # deleted while listing
                found.append(ObjectInfo(name, st.st_size, st.st_mtime))
        found.sort()
        yield from found

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as e:
            raise _mapped(e, name) from e

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            st = self._path(name).stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _mapped(e, name) from e
        return ObjectInfo(name, st.st_size, st.st_mtime)

    def reopen(self) -> LocalStore:
        return self  # no connections: plain files

    def clean_abandoned(self, prefix: str, older_than: float) -> int:
        folder = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        removed = 0
        for dirpath, _, filenames in os.walk(folder):
            for filename in filenames:
                if not filename.startswith(".tmp-"):
                    continue
                path = os.path.join(dirpath, filename)
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path).st_mtime < older_than:
                        os.unlink(path)
                        removed += 1
        return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mapped(error: OSError, name: str) -> Exception:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"no space left to write {name!r} in the local store: free some space")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoreRefused(f"the local store may not write {name!r}: {error.strerror}")
    return StoreUnreachable(f"the local store failed on {name!r}: {error}")


def open_store(uri: str, **options: object) -> Store:
    """A store from a URI: ``s3://bucket/prefix`` (options go to ``S3Store``), or a
    ``file://`` URI or plain path of a local directory."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from .s3 import S3Store  # boto3 is imported only when S3 is used

        return S3Store.from_uri(uri, **options)
    if parsed.scheme in ("", "file"):
        if options:
            raise StoreConfigError(f"a local store takes no options, got {sorted(options)}")
        return LocalStore(parsed.path if parsed.scheme else uri)
    raise StoreConfigError(
        f"snapshot store {uri!r}: use s3://bucket/prefix or a local directory path"
    )
