"""The snapshotter's exception tree. Every message says what happened and what to do.

``Transient`` errors (an unreachable store, a full disk) are the ones a retry may cure;
``retry.with_retries`` retries them and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence


class SnapshotError(Exception):
    """Base class for every error the snapshotter package raises."""


class Transient(SnapshotError):
    """A failure a later attempt may not meet (network, full disk, a busy store)."""


# ------------------------------------------------------------------ stores
class StoreError(SnapshotError):
    """Base class for problems talking to a snapshot store (S3 or a local directory)."""


class StoreUnreachable(StoreError, Transient):
    """The store did not answer (connection refused, time-out, 5xx)."""


class StoreFull(StoreError, Transient):
    """The store or the local disk has no room left for what was being written."""


class ObjectMissing(StoreError):
    """An object the repository needs is not in the store."""

    def __init__(self, name: str, message: str | None = None):
        super().__init__(message or f"object {name!r} is missing from the store")
        self.name = name


class StoreRefused(StoreError):
    """The store refused a request for a reason a retry will not cure (credentials, bucket,
    a bad checksum it computed differently); the message names the setting to check."""


class StoreConfigError(StoreError):
    """A store URI or option is malformed; the message says the accepted form."""


# -------------------------------------------------------------- repository
class RepositoryError(SnapshotError):
    """The repository's content is not what it should be."""


class KeyUnavailable(RepositoryError):
    """The project's key cannot be opened with the master key given: a wrong master key (a
    setting to fix), or, where the repository cannot tell, a damaged key file."""


class CorruptObject(RepositoryError):
    """An object failed its authentication or hash check: it was changed or truncated."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"object {name!r} is corrupt: {detail}")
        self.name = name
        self.detail = detail


class DamagedKey(CorruptObject):
    """The project's data key file (``keys/data``) is damaged or missing while the
    repository holds data: its snapshots cannot be read until it is restored from a
    backup. Told apart from a wrong master key by the file's structure and by
    ``keys/check`` (``crypto.py``)."""


class DamagedSnapshot(RepositoryError):
    """A snapshot cannot be restored whole: some of its data is missing or corrupt.

    ``paths`` names the files affected, so a person can decide whether they matter."""

    def __init__(self, snapshot: str, cause: str, paths: Sequence[str]):
        shown = ", ".join(paths[:10]) + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")
        super().__init__(
            f"snapshot {snapshot} is damaged ({cause}); files affected: {shown or 'none'}"
        )
        self.snapshot = snapshot
        self.paths = tuple(paths)


class SnapshotNotFound(RepositoryError):
    """No snapshot has that id (or the owner has none yet)."""


# ----------------------------------------------------------------- capture
class CaptureError(SnapshotError):
    """A source could not be read as asked (missing, not a directory, not an overlay)."""


class RestoreRefused(SnapshotError):
    """A restore would overwrite something: the target is not empty and overwriting was
    not asked for."""
