"""The repository index: where each blob lives (pack, segment, offset).

Each snapshot run writes one index file for the packs it wrote, after the packs and before
the manifest: ``index/<blake3 of its bytes>``, sealed as ``index``. Its plaintext is a
pack count, then per pack its id (32 raw bytes) and its table (``pack.encode_table``).
Loading the index is the union of all index files; a blob found in several packs (two
writers of the same project racing) is read from the pack whose id sorts first, which
every reader agrees on. Index files are never edited: garbage collection writes a new
one without the deleted packs, then deletes the ones it replaced.

An index file that does not open costs no snapshot: the packs carry the same tables, so
loading reads the tables of the packs no whole index file lists instead, and
``gc.rebuild_index`` writes a whole index from them for good.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from .errors import CorruptObject
from .pack import BlobEntry, FinishedPack, Segment, decode_table, encode_table

_COUNT = struct.Struct("<I")


class Location(NamedTuple):
    pack_id: str
    segment_offset: int
    segment_length: int
    offset: int  # in the segment's plaintext
    length: int
    blob_type: int


def encode_index(packs: Iterable[tuple[str, Iterable[Segment]]]) -> bytes:
    listed = [(pack_id, list(segments)) for pack_id, segments in packs]
    parts = [_COUNT.pack(len(listed))]
    for pack_id, segments in listed:
        parts.append(bytes.fromhex(pack_id))
        parts.append(encode_table(segments))
    return b"".join(parts)


def decode_index(data: bytes, name: str) -> Iterator[tuple[str, list[Segment]]]:
    if len(data) < _COUNT.size:
        raise CorruptObject(name, "shorter than its pack count")
    (count,) = _COUNT.unpack_from(data, 0)
    at = _COUNT.size
    for _ in range(count):
        if at + 32 > len(data):
            raise CorruptObject(name, "its table is truncated")
        pack_id = data[at : at + 32].hex()
        segments, at = decode_table(data, name, at + 32)
        yield pack_id, segments


class Index:
    """Blob id -> location, over every index file loaded (and packs written since)."""

    def __init__(self) -> None:
        self.blobs: dict[bytes, Location] = {}
        self.packs: dict[str, list[Segment]] = {}
        # What loading it found (``Repository.load_index``): the index files it was read
        # from (damaged ones included), those that did not open (name -> why), how many
        # packs' own tables were read because no whole index file lists them, and those
        # of them whose table did not open either (pack id -> why): their blobs are lost.
        self.files: list[str] = []
        self.damaged_files: dict[str, str] = {}
        self.tables_read = 0
        self.unreadable_packs: dict[str, str] = {}

    def __contains__(self, blob_id: bytes) -> bool:
        return blob_id in self.blobs

    def __len__(self) -> int:
        return len(self.blobs)

    def add_pack(self, pack_id: str, segments: Iterable[Segment]) -> None:
        listed = self.packs.setdefault(pack_id, [])
        blobs = self.blobs
        for segment in segments:  # 50,000 blobs for a 1.7 GB environment: kept tight
            listed.append(segment)
            at, size = segment.offset, segment.length
            for blob_id, blob_type, offset, length in segment.blobs:
                known = blobs.get(blob_id)
                if known is None or pack_id < known.pack_id:
                    blobs[blob_id] = Location(pack_id, at, size, offset, length, blob_type)

    def add_finished(self, pack: FinishedPack) -> None:
        self.add_pack(pack.pack_id, pack.segments)

    def drop_packs(self, pack_ids: Iterable[str]) -> None:
        """Forget packs (deleted, tombstoned): their blobs count as absent from now on,
        unless another pack holds them too."""
        gone = set(pack_ids)
        if not gone & self.packs.keys():
            return
        for pack_id in gone:
            self.packs.pop(pack_id, None)
        self.blobs = {}
        for pack_id in sorted(self.packs):
            for segment in self.packs[pack_id]:
                for entry in segment.blobs:
                    self.blobs.setdefault(entry.blob_id, _location(pack_id, segment, entry))

    def has_all(self, blob_ids: Sequence[bytes]) -> bool:
        blobs = self.blobs
        if len(blob_ids) == 1:  # most files: asked 50,000 times by an unchanged snapshot
            return blob_ids[0] in blobs
        return all(blob_id in blobs for blob_id in blob_ids)

    def get(self, blob_id: bytes) -> Location | None:
        return self.blobs.get(blob_id)


def _location(pack_id: str, segment: Segment, entry: BlobEntry) -> Location:
    return Location(
        pack_id, segment.offset, segment.length, entry.offset, entry.length, entry.blob_type
    )
