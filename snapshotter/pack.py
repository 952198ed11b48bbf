"""Packs: many blobs in one object, in sealed segments, with their own table at the end.

A **blob** is a chunk of file data (``DATA``) or one directory's encoded tree (``TREE``),
named by its content id (``crypto.ProjectKeys.content_id``).

A **segment** is one or more blobs, concatenated, compressed with zstd (kept raw when that
does not make it smaller) and sealed: ``seal(b"segment", flag || payload)`` with flag 0
(raw) or 1 (zstd). Large blobs get a segment each; small ones are bundled up to
``BUNDLE_BYTES`` so that a thousand small files of a package compress together, as a tar
would. A segment is the unit a restore reads and verifies.

A **pack** (16–32 MiB) is ``segment… || sealed table || table length (u32 LE)``, where the
table lists, per segment, its offset and length in the pack and, per blob, its id, type,
offset and length inside the segment's plaintext. The same table format makes the
repository's index files (``index.py``), so an index can be rebuilt from the packs alone.
A pack's name is the BLAKE3 hash of its bytes: writing it twice writes the same object.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import blake3
import zstandard

from .crypto import ID_BYTES, ProjectKeys, seal, unseal
from .errors import CorruptObject

DATA = 0
TREE = 1
BUNDLE_BYTES = 1 << 20  # blobs smaller than this share segments, up to this much each
PACK_TARGET_BYTES = 24 << 20  # a pack is sealed once it holds this much (16–32 MiB)

_RAW, _ZSTD = 0, 1
_SEGMENT = struct.Struct("<QII")  # offset in pack, length, blob count
_BLOB = struct.Struct(f"<{ID_BYTES}sBII")  # id, type, offset in plaintext, length
_LENGTH = struct.Struct("<I")


class BlobEntry(NamedTuple):
    blob_id: bytes
    blob_type: int
    offset: int  # in the segment's plaintext
    length: int


@dataclass(frozen=True)
class Segment:
    offset: int  # in the pack
    length: int
    blobs: tuple[BlobEntry, ...]


def pack_name(pack_id: str) -> str:
    return f"packs/{pack_id[:2]}/{pack_id}"


# ------------------------------------------------------------------ segments
class SealedSegment(NamedTuple):
    data: bytes
    blobs: tuple[BlobEntry, ...]
    raw_bytes: int


def seal_segment(
    keys: ProjectKeys,
    compressor: zstandard.ZstdCompressor,
    blobs: Sequence[tuple[bytes, int, bytes | memoryview]],
) -> SealedSegment:
    """Compress and seal blobs as one segment (CPU work: call it from worker threads, one
    compressor per thread — zstd compressors are not thread-safe)."""
    entries = []
    offset = 0
    for blob_id, blob_type, data in blobs:
        entries.append(BlobEntry(blob_id, blob_type, offset, len(data)))
        offset += len(data)
    plain = blobs[0][2] if len(blobs) == 1 else b"".join(b[2] for b in blobs)
    packed = compressor.compress(plain)
    compressed = len(packed) < offset  # else stored raw: already compressed content
    body = bytes((_ZSTD,)) + packed if compressed else bytes((_RAW,)) + bytes(plain)
    return SealedSegment(seal(keys.seal_key, b"segment", body), tuple(entries), offset)


# A decompression context per thread: making one per segment cost 8% of decompressing.
_decompressors = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    made: zstandard.ZstdDecompressor | None = getattr(_decompressors, "one", None)
    if made is None:
        made = _decompressors.one = zstandard.ZstdDecompressor()
    return made


def open_segment(keys: ProjectKeys, sealed: bytes | memoryview, name: str) -> bytes:
    body = unseal(keys.seal_key, b"segment", sealed, name)
    if not body:
        raise CorruptObject(name, "empty segment")
    if body[0] == _RAW:
        return body[1:]
    if body[0] == _ZSTD:
        try:
            return _decompressor().decompress(memoryview(body)[1:])
        except zstandard.ZstdError as e:
            raise CorruptObject(name, f"segment does not decompress: {e}") from None
    raise CorruptObject(name, f"unknown segment flag {body[0]}")


# --------------------------------------------------------------------- tables
def encode_table(segments: Sequence[Segment]) -> bytes:
    parts = [_LENGTH.pack(len(segments))]
    for segment in segments:
        parts.append(_SEGMENT.pack(segment.offset, segment.length, len(segment.blobs)))
        parts.extend(_BLOB.pack(*blob) for blob in segment.blobs)
    return b"".join(parts)


def decode_table(data: bytes | memoryview, name: str, at: int = 0) -> tuple[list[Segment], int]:
    """Segments from ``data[at:]``, and where the table ended."""
    view = memoryview(data)
    try:
        (count,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size
        segments = []
        for _ in range(count):
            offset, length, n = _SEGMENT.unpack_from(view, at)
            at += _SEGMENT.size
            end = at + n * _BLOB.size
            if end > len(view):
                raise struct.error("truncated")
            blobs = tuple(map(BlobEntry._make, _BLOB.iter_unpack(view[at:end])))
            at += n * _BLOB.size
            segments.append(Segment(offset, length, blobs))
    except struct.error:
        raise CorruptObject(name, "its table is truncated") from None
    return segments, at


def read_pack_table(keys: ProjectKeys, data: bytes, name: str) -> list[Segment]:
    """A pack's own table (for ``check`` and for rebuilding the index)."""
    if len(data) < _LENGTH.size:
        raise CorruptObject(name, "shorter than its table length")
    (length,) = _LENGTH.unpack_from(data, len(data) - _LENGTH.size)
    start = len(data) - _LENGTH.size - length
    if start < 0:
        raise CorruptObject(name, "its table length points outside the pack")
    table = unseal(keys.seal_key, b"pack-table", data[start : len(data) - _LENGTH.size], name)
    segments, _ = decode_table(table, name)
    return segments


def verify_pack(
    keys: ProjectKeys,
    pack_id: str,
    data: bytes,
    name: str,
    indexed: Sequence[Segment] | None = None,
) -> list[str]:
    """What is wrong with a pack read whole from the store under ``pack_id``; empty when it
    is whole. Checked: its bytes hash to its name; its own table opens (and, ``indexed``
    being the index's entry for it, lists what the index lists); every segment opens; every
    blob matches its id. Where its table does not open, the segments the index lists are
    checked instead, so the report says whether its data is still readable."""
    problems = []
    if blake3.blake3(data).hexdigest() != pack_id:
        problems.append("its bytes do not hash to its name (changed or truncated)")
    try:
        segments = read_pack_table(keys, data, name)
    except CorruptObject as e:
        problems.append(f"its own table does not open ({e.detail})")
        if indexed is None:
            return problems
        segments = list(indexed)
    else:
        if indexed is not None and list(indexed) != segments:
            problems.append("the index lists other segments for it than its own table")
    view = memoryview(data)
    bad_segments: list[str] = []
    bad_blobs: list[str] = []
    for segment in segments:
        try:
            plain = open_segment(keys, view[segment.offset : segment.offset + segment.length], name)
        except CorruptObject as e:
            bad_segments.append(f"at offset {segment.offset}: {e.detail}")
            continue
        for blob in segment.blobs:
            piece = plain[blob.offset : blob.offset + blob.length]
            if len(piece) != blob.length or keys.content_id(piece) != blob.blob_id:
                bad_blobs.append(blob.blob_id.hex())
    if bad_segments:
        problems.append(
            f"{len(bad_segments)} of its {len(segments)} segments do not open (the first "
            f"{bad_segments[0]})"
        )
    if bad_blobs:
        problems.append(f"{len(bad_blobs)} blobs do not match their ids (the first {bad_blobs[0]})")
    return problems


# -------------------------------------------------------------------- writing
@dataclass
class _OpenPack:
    parts: list[bytes] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    size: int = 0


class FinishedPack(NamedTuple):
    pack_id: str
    data: bytes
    segments: tuple[Segment, ...]


class PackAssembler:
    """Collects sealed segments from many threads into packs of about ``target`` bytes and
    hands each finished pack to ``ship`` (which uploads it), outside the lock."""

    def __init__(
        self,
        keys: ProjectKeys,
        ship: Callable[[FinishedPack], None],
        target: int = PACK_TARGET_BYTES,
    ):
        self.keys = keys
        self.ship = ship
        self.target = target
        self._lock = threading.Lock()
        self._open = _OpenPack()

    def add(self, segment: SealedSegment) -> None:
        full = None
        with self._lock:
            pack = self._open
            pack.segments.append(Segment(pack.size, len(segment.data), segment.blobs))
            pack.parts.append(segment.data)
            pack.size += len(segment.data)
            if pack.size >= self.target:
                full, self._open = pack, _OpenPack()
        if full is not None:
            self.ship(self._finish(full))

    def flush(self) -> None:
        with self._lock:
            pack, self._open = self._open, _OpenPack()
        if pack.segments:
            self.ship(self._finish(pack))

    def _finish(self, pack: _OpenPack) -> FinishedPack:
        table = seal(self.keys.seal_key, b"pack-table", encode_table(pack.segments))
        data = b"".join([*pack.parts, table, _LENGTH.pack(len(table))])
        return FinishedPack(blake3.blake3(data).hexdigest(), data, tuple(pack.segments))
