"""The manifest: what one snapshot is. Written last; a snapshot exists once it is stored.

Stored as ``snapshots/<user>/<server>/<id>`` (names quoted for the store), sealed as
``snapshot``: canonical JSON with the owner, when and where it was taken, its parent, per
source the path it came from (and goes back to), its kind, its root tree and, for
environment prefixes, the environment's spec, and the figures of the run. Ids sort by
time (``20261130T140512.123456Z-1a2b3c4d``), so the latest of an owner is the last name listed.
"""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from .tree import Node

FORMAT_VERSION = 1


class SourceKind(enum.StrEnum):
    DIR = "dir"  # a directory tree, e.g. the session's home
    PREFIX = "prefix"  # a conda environment or virtualenv, restored at the same prefix
    OVERLAY = "overlay"  # a container's filesystem changes: an overlay upper directory


@dataclass(frozen=True)
class Stats:
    files: int = 0
    dirs: int = 0
    bytes: int = 0  # file bytes the snapshot holds
    reused_files: int = 0  # found unchanged by the stat cache, not read again
    reused_dirs: int = 0  # whose tree the stat cache vouched for, not encoded again
    new_bytes: int = 0  # bytes of blobs this run stored for the first time (before zstd)
    uploaded_bytes: int = 0  # what this run sent to the store (packs, index, manifest)
    duration_s: float = 0.0


@dataclass(frozen=True)
class Source:
    name: str
    path: str  # absolute: where it was captured, and where a restore puts it back
    kind: SourceKind
    tree: bytes  # the id of its root directory's tree
    files: int = 0
    bytes: int = 0
    exclude: tuple[str, ...] = ()
    # Environment prefixes: "conda-explicit" (conda list --explicit) and "pip-freeze".
    spec: Mapping[str, str] = field(default_factory=dict)
    # The source directory's own mode, owner, mtime and attributes (its entries are in
    # its tree): a 0700 home comes back 0700 even where the restore creates it.
    root: Node | None = None


@dataclass(frozen=True)
class Manifest:
    id: str
    project: str
    user: str
    server: str
    created_at: float
    hostname: str
    sources: tuple[Source, ...]
    stats: Stats = Stats()
    parent: str | None = None
    tags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return manifest_name(self.user, self.server, self.id)

    def encode(self) -> bytes:
        raw: dict[str, Any] = asdict(self)
        raw["v"] = FORMAT_VERSION
        for source, original in zip(raw["sources"], self.sources, strict=True):
            source["tree"] = source["tree"].hex()
            source["root"] = original.root.to_json() if original.root is not None else None
        return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        if raw.pop("v", None) != FORMAT_VERSION:
            raise ValueError("unknown manifest format version")
        sources = tuple(
            Source(
                **{
                    **s,
                    "kind": SourceKind(s["kind"]),
                    "tree": bytes.fromhex(s["tree"]),
                    "exclude": tuple(s["exclude"]),
                    "root": Node.from_json(s["root"]) if s.get("root") else None,
                }
            )
            for s in raw.pop("sources")
        )
        return cls(
            **{
                **raw,
                "sources": sources,
                "stats": Stats(**raw["stats"]),
                "tags": tuple(raw["tags"]),
            }
        )


def new_snapshot_id(now: float | None = None) -> str:
    """``20261130T140512.123456Z-1a2b3c4d``: sorts by time to the microsecond."""
    at = now if now is not None else time.time()
    whole = int(at * 1_000_000)  # floor, so the second and its fraction agree
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(whole // 1_000_000))
    micros = whole % 1_000_000
    return f"{stamp}.{micros:06d}Z-{os.urandom(4).hex()}"


def owner_prefix(user: str, server: str) -> str:
    return f"snapshots/{quote(user, safe='')}/{quote(server or '-', safe='')}/"


def manifest_name(user: str, server: str, snapshot_id: str) -> str:
    return owner_prefix(user, server) + snapshot_id


def parse_manifest_name(name: str) -> tuple[str, str, str] | None:
    """(user, server, id) from ``snapshots/<user>/<server>/<id>``, or None."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "snapshots":
        return None
    server = unquote(parts[2])
    return unquote(parts[1]), "" if server == "-" else server, parts[3]
