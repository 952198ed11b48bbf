"""Where repositories live: an object store with a handful of operations, as a protocol.

Two implementations share one layout of names (``a/b/c`` keys): ``LocalStore`` (``store.py``, a
directory; the embedded default) and ``S3Store`` (``s3.py``; any S3-compatible endpoint).
The repository above them (``repository.py``) relies only on these guarantees:

- ``put`` is atomic: a reader sees the whole object or none of it, never a prefix;
- ``put(..., if_absent=True)`` writes only when no object has that name, and says whether
  it wrote (packs and indexes are named by their content, so a second writer of the same
  name wrote the same bytes: losing that race is success);
- ``list`` returns each object's size and last-modified time (garbage collection keeps what
  is younger than its safety margin);
- errors are the snapshotter's own (``errors.py``), mapped at this edge.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol


class ObjectInfo(NamedTuple):
    name: str
    size: int
    modified: float  # seconds since the epoch


class Store(Protocol):
    """An object store; see the module docstring for what callers may rely on."""

    @property
    def uri(self) -> str: ...

    def put(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Store ``data`` under ``name``; False when ``if_absent`` and it already existed."""
        ...

    def get(self, name: str) -> bytes:
        """The whole object; ``ObjectMissing`` when there is none."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``, in name order."""
        ...

    def delete(self, name: str) -> None:
        """Remove the object; a missing one is not an error."""
        ...

    def stat(self, name: str) -> ObjectInfo | None: ...

    def clean_abandoned(self, prefix: str, older_than: float) -> int:
        """Remove what writers killed mid-write left under ``prefix`` before ``older_than``
        (temporary files, unfinished multipart uploads); how many."""
        ...

    def reopen(self) -> Store:
        """The same store through connections of its own: what a forked process uses (a
        connection must never be shared by two processes)."""
        ...
