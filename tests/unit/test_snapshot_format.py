"""The snapshot format's pure parts: sealing, segments, tables, index, trees, manifests, ids
and retention, with literal inputs."""

from __future__ import annotations

import os

import pytest
import zstandard

from gpufleet.snapshotter.crypto import ProjectKeys, new_master_key, seal, unseal
from gpufleet.snapshotter.errors import CorruptObject, KeyUnavailable
from gpufleet.snapshotter.index import Index, decode_index, encode_index
from gpufleet.snapshotter.manifest import (
    Manifest,
    Source,
    SourceKind,
    Stats,
    manifest_name,
    new_snapshot_id,
    parse_manifest_name,
)
from gpufleet.snapshotter.pack import (
    DATA,
    TREE,
    BlobEntry,
    FinishedPack,
    PackAssembler,
    Segment,
    decode_table,
    encode_table,
    open_segment,
    read_pack_table,
    seal_segment,
)
from gpufleet.snapshotter.retention import Dated, RetentionPolicy, decide
from gpufleet.snapshotter.tree import Node, NodeType, decode_tree, encode_tree

KEYS = ProjectKeys(b"i" * 32, b"s" * 32)
DAY = 86400.0


def test_content_ids_are_keyed_per_project() -> None:
    other = ProjectKeys(b"j" * 32, b"s" * 32)
    assert KEYS.content_id(b"same") == KEYS.content_id(b"same")
    assert KEYS.content_id(b"same") != other.content_id(b"same")  # no dedup across projects


def test_sealed_objects_refuse_tampering_another_kind_and_another_key() -> None:
    sealed = seal(KEYS.seal_key, b"index", b"payload")
    assert unseal(KEYS.seal_key, b"index", sealed, "x") == b"payload"
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    for key, kind, data in [
        (KEYS.seal_key, b"index", bytes(flipped)),
        (KEYS.seal_key, b"snapshot", sealed),
        (b"t" * 32, b"index", sealed),
        (KEYS.seal_key, b"index", sealed[:10]),
    ]:
        with pytest.raises(CorruptObject):
            unseal(key, kind, data, "x")


def test_project_key_opens_only_with_its_master_key_and_project() -> None:
    master = new_master_key()
    wrapped = KEYS.wrap(master, "vision")
    assert ProjectKeys.unwrap(master, "vision", wrapped) == KEYS
    with pytest.raises(KeyUnavailable, match="master key"):
        ProjectKeys.unwrap(new_master_key(), "vision", wrapped)
    with pytest.raises(KeyUnavailable):
        ProjectKeys.unwrap(master, "nlp", wrapped)  # a key file copied to another project


def test_segments_compress_what_compresses_and_keep_the_rest_raw() -> None:
    compressor = zstandard.ZstdCompressor(level=3)
    text = b"import numpy as np\n" * 1000
    noise = os.urandom(50_000)
    for blobs in ([(b"a" * 32, DATA, text)], [(b"b" * 32, DATA, noise)]):
        sealed = seal_segment(KEYS, compressor, blobs)
        assert open_segment(KEYS, sealed.data, "p") == blobs[0][2]
    small = seal_segment(KEYS, compressor, [(b"a" * 32, DATA, text)])
    raw = seal_segment(KEYS, compressor, [(b"b" * 32, DATA, noise)])
    assert len(small.data) < len(text) // 10
    assert len(raw.data) < len(noise) + 64  # no growth beyond the seal's overhead


def test_a_bundle_of_small_blobs_is_one_segment_with_offsets() -> None:
    blobs = [(bytes([i]) * 32, DATA if i else TREE, f"file {i}\n".encode() * i) for i in range(4)]
    sealed = seal_segment(KEYS, zstandard.ZstdCompressor(), blobs)
    plain = open_segment(KEYS, sealed.data, "p")
    assert [plain[e.offset : e.offset + e.length] for e in sealed.blobs] == [b[2] for b in blobs]
    assert [e.blob_type for e in sealed.blobs] == [TREE, DATA, DATA, DATA]


def test_tables_and_index_files_round_trip() -> None:
    segments = [
        Segment(0, 100, (BlobEntry(b"a" * 32, DATA, 0, 60), BlobEntry(b"b" * 32, TREE, 60, 40))),
        Segment(100, 50, (BlobEntry(b"c" * 32, DATA, 0, 50),)),
    ]
    table = encode_table(segments)
    assert decode_table(table, "t") == (segments, len(table))
    with pytest.raises(CorruptObject, match="truncated"):
        decode_table(table[:-5], "t")
    pack_a, pack_b = "aa" * 32, "bb" * 32
    encoded = encode_index([(pack_a, segments), (pack_b, segments[1:])])
    assert list(decode_index(encoded, "i")) == [(pack_a, segments), (pack_b, segments[1:])]


def test_index_places_a_blob_in_the_first_pack_by_id_and_forgets_dropped_packs() -> None:
    segment = Segment(0, 10, (BlobEntry(b"x" * 32, DATA, 0, 10),))
    index = Index()
    index.add_pack("bb" * 32, [segment])
    index.add_pack("aa" * 32, [segment])  # the same blob written by a racing writer
    location = index.get(b"x" * 32)
    assert location is not None and location.pack_id == "aa" * 32
    index.drop_packs(["aa" * 32])
    location = index.get(b"x" * 32)
    assert location is not None and location.pack_id == "bb" * 32
    index.drop_packs(["bb" * 32])
    assert b"x" * 32 not in index


def test_packs_carry_their_own_table_and_are_named_by_content() -> None:
    shipped: list[FinishedPack] = []
    assembler = PackAssembler(KEYS, shipped.append, target=1000)
    compressor = zstandard.ZstdCompressor()
    for i in range(5):
        assembler.add(seal_segment(KEYS, compressor, [(bytes([i]) * 32, DATA, os.urandom(400))]))
    assembler.flush()
    # ~430 bytes a segment: the first pack is sealed at its third, the flush seals the rest
    assert [len(p.segments) for p in shipped] == [3, 2]
    for pack in shipped:
        assert read_pack_table(KEYS, pack.data, "p") == list(pack.segments)
        assert len(pack.pack_id) == 64
    assert len({p.pack_id for p in shipped}) == 2


def test_trees_are_canonical_and_keep_every_kind_of_entry() -> None:
    nodes = [
        Node(
            "b.txt",
            NodeType.FILE,
            0o640,
            1001,
            1002,
            "ann",
            "lab",
            123,
            5,
            {"user.k": b"\x00v"},
            chunks=(b"c" * 32,),
        ),
        Node("a", NodeType.DIR, 0o755, subtree=b"t" * 32, opaque=True),
        Node("sparse", NodeType.FILE, size=1 << 30, chunks=(b"d" * 32,), sparse=((4096, 10),)),
        Node("link", NodeType.SYMLINK, 0o777, target="../nowhere"),
        Node("hard", NodeType.HARDLINK, link="b.txt"),
        Node("null", NodeType.CHAR, 0o666, rdev=os.makedev(1, 3)),
        Node("fifo", NodeType.FIFO, 0o600),
        Node("gone", NodeType.DELETED),
        Node(os.fsdecode(b"caf\xe9"), NodeType.FILE),  # not UTF-8 on disk
    ]
    encoded = encode_tree(nodes)
    assert encode_tree(list(reversed(nodes))) == encoded
    decoded = decode_tree(encoded)
    assert sorted(decoded, key=lambda n: n.name) == sorted(nodes, key=lambda n: n.name)
    assert os.fsencode(decoded[-1].name) == b"caf\xe9" or any(
        os.fsencode(n.name) == b"caf\xe9" for n in decoded
    )


def test_manifests_round_trip_and_ids_sort_by_time() -> None:
    manifest = Manifest(
        id=new_snapshot_id(1_764_500_000.25),
        project="vision",
        user="ann@example.org",
        server="gpu/1",
        created_at=1_764_500_000.25,
        hostname="node-1",
        sources=(
            Source("home", "/home/ann", SourceKind.DIR, b"t" * 32, files=3, bytes=10),
            Source(
                "env:/opt/e",
                "/opt/e",
                SourceKind.PREFIX,
                b"u" * 32,
                spec={"pip-freeze": "numpy==2.1\n"},
            ),
        ),
        stats=Stats(files=3, bytes=10),
        parent="20261130T000000.000000Z-00000000",
        tags=("idle",),
    )
    assert Manifest.decode(manifest.encode()) == manifest
    assert parse_manifest_name(manifest.name) == ("ann@example.org", "gpu/1", manifest.id)
    assert manifest_name("ann", "", "x") == "snapshots/ann/-/x"
    assert parse_manifest_name("snapshots/ann/-/x") == ("ann", "", "x")
    ids = [new_snapshot_id(t) for t in (1_764_500_000.999999, 1_764_500_001.0, 1_764_500_001.5)]
    assert ids == sorted(ids)
    assert ids[0].startswith("20251130T") and ".999999Z-" in ids[0]


def _dated(owner: str, *ages_days: float, now: float) -> list[Dated]:
    return [Dated((owner, ""), f"{owner}-{age}", now - age * DAY) for age in ages_days]


def test_retention_keeps_the_last_n_and_one_a_day() -> None:
    now = 1_764_504_000.0  # 2025-11-30 12:00 UTC
    snapshots = _dated("ann", 0.01, 0.02, 0.03, 0.04, 1.1, 1.2, 2.5, 9.0, now=now)
    decision = decide(snapshots, RetentionPolicy(keep_last=2, keep_daily=3), now)
    assert sorted(decision.keep) == ["ann-0.01", "ann-0.02", "ann-1.1", "ann-2.5"]
    assert decision.keep["ann-0.01"] == ("last 2", "daily 2025-11-30")
    assert decision.keep["ann-1.1"] == ("daily 2025-11-29",)
    assert decision.forget == ("ann-0.03", "ann-0.04", "ann-1.2", "ann-9.0")


def test_retention_is_per_owner_and_always_keeps_the_latest() -> None:
    now = 1_764_504_000.0
    snapshots = _dated("ann", 30.0, 31.0, now=now) + _dated("bob", 40.0, now=now)
    decision = decide(snapshots, RetentionPolicy(keep_last=1, keep_daily=0), now)
    assert sorted(decision.keep) == ["ann-30.0", "bob-40.0"]
    assert decision.forget == ("ann-31.0",)
    with pytest.raises(ValueError, match="latest snapshot is always kept"):
        RetentionPolicy(keep_last=0)
