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
from operator import itemgetter
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


# Not frozen, though never changed after it is made: a restore makes one per path (50,000
# for an environment), and a frozen dataclass is made eight times slower.
@dataclass(slots=True)
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
        return node_json(
            self.name,
            self.type,
            self.mode,
            self.uid,
            self.gid,
            self.user,
            self.group,
            self.mtime_ns,
            self.size,
            self.xattrs,
            self.chunks,
            self.sparse,
            self.target,
            self.rdev,
            self.link,
            self.subtree,
            self.opaque,
        )

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


def node_json(
    name: str,
    node_type: NodeType,
    mode: int = 0,
    uid: int = 0,
    gid: int = 0,
    user: str = "",
    group: str = "",
    mtime_ns: int = 0,
    size: int = 0,
    xattrs: Mapping[str, bytes] | None = None,
    chunks: Sequence[bytes] = (),
    sparse: Sequence[tuple[int, int]] = (),
    target: str = "",
    rdev: int = 0,
    link: str = "",
    subtree: bytes = b"",
    opaque: bool = False,
) -> dict[str, object]:
    """A node's entry in its directory's tree: ``Node.to_json``, and what a snapshot writes
    without making a ``Node`` of each of 50,000 paths first."""
    out: dict[str, object] = {"n": name, "t": node_type._value_}
    if node_type is NodeType.DELETED:
        return out
    out.update(m=mode, u=uid, g=gid, mt=mtime_ns)
    if user:
        out["un"] = user
    if group:
        out["gn"] = group
    if xattrs:
        out["xa"] = {k: base64.b64encode(v).decode() for k, v in xattrs.items()}
    if node_type is NodeType.FILE:
        out["s"] = size
        out["c"] = [c.hex() for c in chunks]
        if sparse:
            out["sp"] = [list(r) for r in sparse]
    elif node_type is NodeType.SYMLINK:
        out["l"] = target
    elif node_type is NodeType.CHAR or node_type is NodeType.BLOCK:
        out["r"] = rdev
    elif node_type is NodeType.HARDLINK:
        out["h"] = link
    elif node_type is NodeType.DIR:
        out["st"] = subtree.hex()
        if opaque:
            out["o"] = 1
    return out


def encode_tree(nodes: Sequence[Node]) -> bytes:
    """Canonical bytes of a directory's entries (sorted by name)."""
    return encode_entries([n.to_json() for n in nodes])


def encode_entries(entries: list[dict[str, object]]) -> bytes:
    """Canonical bytes of a directory's entries as ``node_json`` makes them."""
    entries.sort(key=itemgetter("n"))
    return json.dumps(
        {"v": FORMAT_VERSION, "e": entries}, sort_keys=True, separators=(",", ":")
    ).encode()


def decode_tree(data: bytes) -> list[Node]:
    raw = json.loads(data)
    if raw.get("v") != FORMAT_VERSION:
        raise ValueError(f"tree format version {raw.get('v')} is not {FORMAT_VERSION}")
    return [Node.from_json(e) for e in raw["e"]]
