"""Where snapshots go, declared once: ``c.SnapshotSettings`` in ``jupyterhub_config.py``.

The controller (its live passes, index and retention), the local spawner (final passes
and restores) and the node agents (Kubernetes sessions' passes and restores) must all
reach the same store with the same master key. Each reads :class:`SnapshotSettings` from
the one config file and resolves it against its own data directory into a
:class:`StoreAccess`, what the runner (``runner.py``) and the controller's index
(``listing.py``) are given.

The options' earlier names (``c.FleetController.snapshot_store``,
``c.NodeAgent.snapshot_key_file``, ``c.LocalGPUSpawner.snapshot_s3_endpoint``, ...) are
still read, with a warning in the log: :class:`RenamedSnapshotOptions` declares them on
each reader. Where one is set it wins over ``c.SnapshotSettings`` for its reader, as it
did before (it names that reader alone); docs/snapshots.md, "Settings".
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from traitlets import All, Unicode, observe
from traitlets.config import Configurable, LoggingConfigurable

if TYPE_CHECKING:
    from .store import Store

STORE_VARIABLE = "GPUFLEET_SNAPSHOT_STORE"
KEY_FILE_VARIABLE = "GPUFLEET_SNAPSHOT_KEY_FILE"
S3_ENDPOINT_VARIABLE = "GPUFLEET_S3_ENDPOINT"


class SnapshotSettings(Configurable):
    """Where session snapshots are kept, and the key that opens them: set as
    ``c.SnapshotSettings.<name>``, read by the controller, the spawners and the agents."""

    store = Unicode(
        "",
        help="Where session snapshots are kept: s3://bucket/prefix (any S3-compatible "
        "endpoint; credentials from the usual AWS_* variables) or a local directory. The "
        "controller, the spawners and the node agents all read it. Empty: "
        "$GPUFLEET_SNAPSHOT_STORE, else <data_dir>/snapshots (docs/snapshots.md).",
    ).tag(config=True)

    key_file = Unicode(
        "",
        help="The snapshot master key: 32 random bytes, base64 (`openssl rand -base64 32`). "
        "It seals every project's key; without it no snapshot can be read. Empty: "
        "$GPUFLEET_SNAPSHOT_KEY_FILE, else <data_dir>/snapshot-master.key, which the "
        "controller creates on its first start.",
    ).tag(config=True)

    s3_endpoint = Unicode(
        "",
        help="The S3 endpoint URL of an s3:// store that is not AWS itself. Empty: "
        "$GPUFLEET_S3_ENDPOINT, else AWS.",
    ).tag(config=True)

    cache_dir = Unicode(
        "",
        help="Where stat caches live (what the last pass read, so that the next reads only "
        "what changed); the spawners' final passes and the controller's live passes of a "
        "session share them. Empty: <data_dir>/statcache (a node agent's own data_dir).",
    ).tag(config=True)

    def access(self, data_dir: str, cache_dir: str = "") -> StoreAccess:
        """These settings with every default filled in: ``data_dir`` is the reader's data
        directory, ``cache_dir`` its own default for stat caches (else
        ``<data_dir>/statcache``). Environment variables are read now."""
        key_file = self.key_file or os.environ.get(KEY_FILE_VARIABLE, "")
        return StoreAccess(
            store=self.store
            or os.environ.get(STORE_VARIABLE, "")
            or os.path.join(data_dir, "snapshots"),
            key_file=key_file or os.path.join(data_dir, "snapshot-master.key"),
            s3_endpoint=self.s3_endpoint or os.environ.get(S3_ENDPOINT_VARIABLE, ""),
            cache_dir=self.cache_dir or cache_dir or os.path.join(data_dir, "statcache"),
            # Only the embedded default's key is made on first use: a key someone named
            # and that is missing is a mistake to report, never to paper over.
            create_key=not key_file,
        )


@dataclass(frozen=True)
class StoreAccess:
    """Resolved settings: where snapshots go, as the ``gpufleet snapshot`` command reads
    them (``env``) and as the controller opens them (``open``)."""

    store: str
    key_file: str
    s3_endpoint: str = ""
    cache_dir: str = ""
    create_key: bool = False
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The environment of a ``gpufleet snapshot`` process: this one's, with the
        store, the key and the endpoint set."""
        env = {**os.environ, **self.extra_env}
        env[STORE_VARIABLE] = self.store
        env[KEY_FILE_VARIABLE] = self.key_file
        if self.s3_endpoint:
            env[S3_ENDPOINT_VARIABLE] = self.s3_endpoint
        return env

    def open_store(self) -> Store:
        from .store import open_store

        is_s3 = self.store.startswith("s3://")
        options = {"endpoint_url": self.s3_endpoint} if is_s3 and self.s3_endpoint else {}
        return open_store(self.store, **options)

    def master_key(self) -> bytes:
        """The master key; the embedded default's is written first if there is none."""
        return master_key(self.key_file, create=self.create_key)

    def open(self) -> tuple[Store, bytes]:
        """The store and the master key; SnapshotError when either is unavailable."""
        return self.open_store(), self.master_key()


def master_key(path: str | os.PathLike[str], create: bool) -> bytes:
    """The master key in ``path``; with ``create``, a new one is written there first if
    there is none (mode 0600), for the embedded default."""
    from .crypto import new_master_key, read_master_key

    key_path = Path(path)
    if create and not key_path.exists():
        key_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(new_master_key()).decode() + "\n")
    return read_master_key(key_path)


# The options' earlier names, on the controller, the agent and the local spawner, and
# their names in SnapshotSettings.
RENAMED = {
    "snapshot_store": "store",
    "snapshot_key_file": "key_file",
    "snapshot_s3_endpoint": "s3_endpoint",
    "snapshot_cache_dir": "cache_dir",
}


def renamed_help(new: str) -> str:
    """The help of an earlier name of ``c.SnapshotSettings.<new>``."""
    return (
        f"Deprecated: set c.SnapshotSettings.{new}, which the controller, the spawners and "
        "the node agents all read. Still read here, with a warning; where set it wins over "
        f"c.SnapshotSettings.{new} for this class (docs/snapshots.md, 'Settings')."
    )


class RenamedOptions(LoggingConfigurable):
    """Options' earlier names, mixed into each class that had them. A subclass declares
    each earlier name as a trait whose value is None unless a config sets it, and says in
    ``renamed`` where the option lives now: {earlier name: ("Class.name", where to read
    more)}. Setting one logs a warning naming the new one; whoever owns the new option
    reads the earlier name's value (``RenamedSnapshotOptions.snapshot_settings``, the
    controller's components in hub/components.py)."""

    renamed: ClassVar[Mapping[str, tuple[str, str]]] = {}

    @observe(All)
    def _renamed_option_set(self, change: Any) -> None:
        # A config file's value arrives here as the instance is made, once per instance.
        moved = self.renamed_to(change.name)
        if moved is not None and change.new is not None:
            warn_renamed(self.log, type(self).__name__, change.name, *moved)

    @classmethod
    def renamed_to(cls, old: str) -> tuple[str, str] | None:
        """Where the option this class once called ``old`` lives now; None: nowhere."""
        for klass in cls.__mro__:
            moved: Mapping[str, tuple[str, str]] = vars(klass).get("renamed", {})
            if old in moved:
                return moved[old]
        return None


def warn_renamed(log: Any, section: str, old: str, new: str, more: str) -> None:
    log.warning("c.%s.%s is deprecated: set c.%s instead (%s)", section, old, new, more)


SNAPSHOT_READERS = "read by the controller, the spawners and the node agents; docs/snapshots.md"


class RenamedSnapshotOptions(RenamedOptions):
    """The snapshot options' earlier names, mixed into each class that read them."""

    renamed = {old: (f"SnapshotSettings.{new}", SNAPSHOT_READERS) for old, new in RENAMED.items()}

    snapshot_store = Unicode(None, allow_none=True, help=renamed_help("store")).tag(config=True)
    snapshot_key_file = Unicode(None, allow_none=True, help=renamed_help("key_file")).tag(
        config=True
    )
    snapshot_s3_endpoint = Unicode(None, allow_none=True, help=renamed_help("s3_endpoint")).tag(
        config=True
    )

    def snapshot_settings(self, also_from: Sequence[str] = ()) -> SnapshotSettings:
        """``c.SnapshotSettings``, with what this class's earlier names set over it, then
        what the earlier names of the config sections ``also_from`` set (a section's
        options this class did not set; warned about here)."""
        settings = SnapshotSettings(parent=self)
        for old, new in RENAMED.items():
            if self.has_trait(old) and getattr(self, old) is not None:
                setattr(settings, new, getattr(self, old))
                continue
            for section in also_from:
                value = self.config[section].get(old) if section in self.config else None
                if value is not None:
                    _warn(self.log, section, old)
                    setattr(settings, new, value)
                    break
        return settings


def _warn(log: Any, section: str, old: str) -> None:
    warn_renamed(log, section, old, *RenamedSnapshotOptions.renamed[old])
