"""The manifest's body: one ``TREE`` blob per directory, listing its entries by name.

A snapshot's manifest (``manifest.py``) names a root tree per source; each directory entry
names its own tree by content id, so an unchanged directory is the same blob in every
snapshot and is stored once — a snapshot after one ``pip install`` writes the trees of
the directories that changed and their parents, not a list of every path again.

An entry (``Node``) records what a restore needs to bring the path back exactly: type,
mode bits, numeric owner and group (names too, for people), mtime in nanoseconds, size,
extended attributes, and per type: a file's chunks (content ids in order) and, for a
sparse file, its data ranges; a symlink's target; a device's number; a hard link's first
path (relative to the source root); a directory's tree id. Two kinds come from overlay
upper directories: ``DELETED`` (a whiteout: the path is gone) and a directory's
``opaque`` flag (it hides what the image had under it).

Names are file-system bytes decoded with ``surrogateescape``, so any name round-trips.
The encoding is canonical JSON (sorted keys, no spaces): identical directories give
identical bytes and therefore identical ids.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1


class NodeType(enum.StrEnum):
    FILE = "f"
    DIR = "d"
    SYMLINK = "l"
    HARDLINK = "h"
    CHAR = "c"
    BLOCK = "b"
    FIFO = "p"
    SOCKET = "s"
    DELETED = "x"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    type: NodeType
    mode: int = 0
    uid: int = 0
    gid: int = 0
    user: str = ""
    group: str = ""
    mtime_ns: int = 0
    size: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=dict)
    chunks: Sequence[bytes] = ()  # FILE: content ids, in order
    sparse: Sequence[tuple[int, int]] = ()  # FILE: (offset, length) data ranges if sparse
    target: str = ""  # SYMLINK
    rdev: int = 0  # CHAR, BLOCK
    link: str = ""  # HARDLINK: the first path of the inode, relative to the source root
    subtree: bytes = b""  # DIR: the id of its own tree
    opaque: bool = False  # DIR from an overlay upper dir: hides the image's content

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"n": self.name, "t": self.type.value}
        if self.type is NodeType.DELETED:
            return out
        out.update(m=self.mode, u=self.uid, g=self.gid, mt=self.mtime_ns)
        if self.user:
            out["un"] = self.user
        if self.group:
            out["gn"] = self.group
        if self.xattrs:
            out["xa"] = {k: base64.b64encode(v).decode() for k, v in self.xattrs.items()}
        if self.type is NodeType.FILE:
            out["s"] = self.size
            out["c"] = [c.hex() for c in self.chunks]
            if self.sparse:
                out["sp"] = [list(r) for r in self.sparse]
        elif self.type is NodeType.SYMLINK:
            out["l"] = self.target
        elif self.type in (NodeType.CHAR, NodeType.BLOCK):
            out["r"] = self.rdev
        elif self.type is NodeType.HARDLINK:
            out["h"] = self.link
        elif self.type is NodeType.DIR:
            out["st"] = self.subtree.hex()
            if self.opaque:
                out["o"] = 1
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Node:
        # A restore decodes every entry of the snapshot (50,000 for an environment): no
        # conversions for what JSON already typed, and nothing for absent fields.
        get = raw.get
        xattrs = get("xa")
        chunks = get("c")
        sparse = get("sp")
        subtree = get("st")
        return cls(
            raw["n"],
            _TYPES[raw["t"]],
            get("m", 0),
            get("u", 0),
            get("g", 0),
            get("un", ""),
            get("gn", ""),
            get("mt", 0),
            get("s", 0),
            {k: base64.b64decode(v) for k, v in xattrs.items()} if xattrs else {},
            tuple(map(bytes.fromhex, chunks)) if chunks else (),
            tuple(map(tuple, sparse)) if sparse else (),
            get("l", ""),
            get("r", 0),
            get("h", ""),
            bytes.fromhex(subtree) if subtree else b"",
            bool(get("o", 0)),
        )


_TYPES = {t.value: t for t in NodeType}


def encode_tree(nodes: Sequence[Node]) -> bytes:
    """Canonical bytes of a directory's entries (sorted by name)."""
    entries = [n.to_json() for n in sorted(nodes, key=lambda n: n.name)]
    return json.dumps(
        {"v": FORMAT_VERSION, "e": entries}, sort_keys=True, separators=(",", ":")
    ).encode()


def decode_tree(data: bytes) -> list[Node]:
    raw = json.loads(data)
    if raw.get("v") != FORMAT_VERSION:
        raise ValueError(f"tree format version {raw.get('v')} is not {FORMAT_VERSION}")
    return [Node.from_json(e) for e in raw["e"]]
