"""What damage to a repository shows, and what still works beside it: a pack whose own
table or name is wrong is found by ``check --read-data``; a damaged index file costs no
snapshot (the packs' tables stand in, and ``rebuild-index`` makes the index whole); a
damaged manifest hides no other snapshot from ``list``; a damaged key file is damage
(exit 4), a wrong master key is a setting (exit 2). Each on a LocalStore in a temporary
directory, the command run through its ``main``."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gpufleet.cli import main
from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.crypto import ProjectKeys, key_check, new_master_key, seal
from gpufleet.snapshotter.errors import (
    CorruptObject,
    DamagedKey,
    KeyUnavailable,
    SnapshotNotFound,
)
from gpufleet.snapshotter.gc import check, rebuild_index
from gpufleet.snapshotter.manifest import Manifest
from gpufleet.snapshotter.pack import (
    DATA,
    FinishedPack,
    PackAssembler,
    pack_name,
    seal_segment,
    verify_pack,
)
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.restore import restore_snapshot
from gpufleet.snapshotter.store import LocalStore

MASTER = new_master_key()
KEYS = ProjectKeys.generate()


# ------------------------------------------------------------------ helpers
def _flip(store: LocalStore, name: str, at: int) -> None:
    data = bytearray(store.get(name))
    data[at] ^= 0x01
    store.put(name, bytes(data))


def _home(root: Path, seed: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(f"a of {seed}\n")
    (root / "sub" / "b.bin").write_bytes(seed.encode() * 5000)
    return root


def _snap(repo: Repository, home: Path, user: str) -> Manifest:
    return create_snapshot(repo, [SourceSpec("home", home)], user=user)


def _restored(repo: Repository, manifest: Manifest, out: Path) -> dict[str, bytes]:
    restore_snapshot(repo, manifest, targets={"home": out}, workers=1)
    return {
        os.path.relpath(os.path.join(d, f), out): Path(d, f).read_bytes()
        for d, _, files in os.walk(out)
        for f in files
    }


def _files(home: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), home): Path(d, f).read_bytes()
        for d, _, files in os.walk(home)
        for f in files
    }


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def repo(store: LocalStore) -> Repository:
    return Repository.open(store, "vision", MASTER)


@pytest.fixture
def cli(store: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> Any:
    """``gpufleet snapshot --project vision ARGS...`` in this process: (exit code, stdout,
    stderr)."""
    key_file = tmp_path / "master.key"
    key_file.write_text(base64.b64encode(MASTER).decode())
    monkeypatch.setenv("COLUMNS", "250")  # the table's ids whole

    def run(*args: str, key: Path = key_file) -> tuple[int, str, str]:
        capsys.readouterr()
        where = ["--store", str(store.root), "--key-file", str(key), "--project", "vision"]
        code = main(["snapshot", *where, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


# ----------------------------------------------------------- packs, pure
def _pack() -> FinishedPack:
    import zstandard

    shipped: list[FinishedPack] = []
    assembler = PackAssembler(KEYS, shipped.append)
    compressor = zstandard.ZstdCompressor()
    for n in range(3):
        blob = f"blob {n} ".encode() * 100
        assembler.add(seal_segment(KEYS, compressor, [(KEYS.content_id(blob), DATA, blob)]))
    assembler.flush()
    (pack,) = shipped
    return pack


def test_a_whole_pack_has_no_problems() -> None:
    pack = _pack()
    assert verify_pack(KEYS, pack.pack_id, pack.data, "p") == []
    assert verify_pack(KEYS, pack.pack_id, pack.data, "p", pack.segments) == []


def test_a_flipped_table_tag_is_reported_and_the_segments_still_checked() -> None:
    pack = _pack()
    data = bytearray(pack.data)
    data[-5] ^= 0x01  # the last byte of the table's AES-GCM tag (before its u32 length)
    alone = verify_pack(KEYS, pack.pack_id, bytes(data), "p")
    assert any("do not hash to its name" in p for p in alone)
    assert any("own table does not open" in p for p in alone)
    indexed = verify_pack(KEYS, pack.pack_id, bytes(data), "p", pack.segments)
    assert len(indexed) == 2  # the name and the table; every segment still opens


def test_a_pack_under_another_name_and_a_damaged_segment_are_reported() -> None:
    pack = _pack()
    assert verify_pack(KEYS, "00" * 32, pack.data, "p") == [
        "its bytes do not hash to its name (changed or truncated)"
    ]
    data = bytearray(pack.data)
    data[pack.segments[1].offset + 20] ^= 0x01
    found = verify_pack(KEYS, pack.pack_id, bytes(data), "p")
    assert any("1 of its 3 segments do not open" in p for p in found)


def test_the_index_lists_other_segments_than_the_pack() -> None:
    pack = _pack()
    found = verify_pack(KEYS, pack.pack_id, pack.data, "p", pack.segments[:1])
    assert found == ["the index lists other segments for it than its own table"]


# ------------------------------------------------------- check --read-data
def test_check_read_data_reports_a_pack_whose_table_tag_is_flipped(
    store: LocalStore, repo: Repository, tmp_path: Path, cli: Any
) -> None:
    _snap(repo, _home(tmp_path / "home", "ann"), "ann")
    assert check(repo, read_data=True).problems == []
    packs = sorted(info.name for info in repo.list_packs())
    _flip(store, repo.name(pack_name(packs[0])), -5)

    report = check(repo, read_data=True)
    assert report.damaged_packs == [packs[0]]
    assert report.packs_read == len(packs)
    (problem,) = report.problems
    assert problem.startswith(f"pack {packs[0]}: ") and "own table does not open" in problem
    assert check(repo).problems == []  # without --read-data no pack is read

    code, out, _ = cli("check", "--read-data")
    assert code == 4 and packs[0] in out and "own table does not open" in out
    code, out, _ = cli("check", "--read-data", "--json")
    result = json.loads(out)
    assert code == 4 and result["damaged_packs"] == [packs[0]]


def test_check_read_data_reads_packs_no_index_lists(
    store: LocalStore, repo: Repository, tmp_path: Path
) -> None:
    _snap(repo, _home(tmp_path / "home", "ann"), "ann")
    (pack,) = [info.name for info in repo.list_packs()][:1]
    stray = "ab" * 32
    store.put(repo.name(pack_name(stray)), repo.read_pack(pack))
    report = check(repo, read_data=True)
    assert report.damaged_packs == [stray]
    assert "do not hash to its name" in report.problems[0]


# ------------------------------------------------------------ index files
def _two_snapshots(repo: Repository, tmp_path: Path) -> tuple[Manifest, Manifest]:
    """Two snapshots of the project, each with its own packs and index file."""
    first = _snap(repo, _home(tmp_path / "ann", "ann"), "ann")
    second = _snap(repo, _home(tmp_path / "bob", "bob"), "bob")
    assert len(repo.list_index_files()) == 2
    return first, second


def test_a_damaged_index_file_costs_no_snapshot(
    store: LocalStore,
    repo: Repository,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, second = _two_snapshots(repo, tmp_path)
    damaged = repo.list_index_files()[0].name
    _flip(store, damaged, 30)

    with caplog.at_level(logging.WARNING, "gpufleet.snapshotter.repository"):
        index = repo.load_index()
    assert list(index.damaged_files) == [damaged]
    assert damaged in caplog.text and "rebuild-index" in caplog.text
    assert index.tables_read >= 1 and not index.unreadable_packs
    assert set(index.packs) == {info.name for info in repo.list_packs()}
    for manifest, who in ((first, "ann"), (second, "bob")):
        assert _restored(repo, manifest, tmp_path / f"out-{who}") == _files(tmp_path / who)

    report = check(repo)
    assert report.damaged_index_files == [damaged]
    assert any(damaged in p and "rebuild-index" in p for p in report.problems)
    assert len(report.problems) == 1  # every snapshot found its blobs all the same


def test_rebuild_index_makes_the_index_whole_again(
    store: LocalStore, repo: Repository, tmp_path: Path
) -> None:
    _, second = _two_snapshots(repo, tmp_path)
    before = [info.name for info in repo.list_index_files()]
    _flip(store, before[1], 40)

    report = rebuild_index(repo)
    assert report.damaged_files == [before[1]]
    assert sorted(report.replaced) == sorted(before)
    assert report.packs == len(list(repo.list_packs())) and not report.unreadable_packs
    assert [info.name for info in repo.list_index_files()] == [report.written]
    index = repo.load_index()
    assert not index.damaged_files and index.tables_read == 0
    assert check(repo, read_data=True).problems == []
    assert _restored(repo, second, tmp_path / "out") == _files(tmp_path / "bob")


def test_rebuild_index_finds_the_packs_of_a_deleted_index_file(
    store: LocalStore, repo: Repository, tmp_path: Path
) -> None:
    first, _ = _two_snapshots(repo, tmp_path)
    index = repo.load_index()
    lost = {index.blobs[s.tree].pack_id for s in first.sources}
    for info in repo.list_index_files():
        store.delete(info.name)
    assert check(repo).problems  # nothing lists the packs now
    report = rebuild_index(repo)
    assert report.tables_read == len(list(repo.list_packs())) and lost <= set(
        repo.load_index().packs
    )
    assert check(repo).problems == []


def test_the_commands_on_a_damaged_index_file(
    store: LocalStore, repo: Repository, tmp_path: Path, cli: Any
) -> None:
    first, _ = _two_snapshots(repo, tmp_path)
    damaged = repo.list_index_files()[1].name
    _flip(store, damaged, 30)
    code, out, _ = cli("check")
    assert code == 4 and damaged in out
    out_dir = tmp_path / "out"
    code, _, err = cli(
        "restore",
        first.id,
        "--target",
        f"home={out_dir}",
        "--workers",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert code == 0, err
    assert (out_dir / "a.txt").read_text() == "a of ann\n"
    code, out, err = cli("rebuild-index")
    assert code == 0 and "1 of them damaged" in out, err
    assert damaged not in {info.name for info in repo.list_index_files()}
    code, out, _ = cli("check")
    assert code == 0 and "no problems" in out


# --------------------------------------------------------------- manifests
def test_list_shows_the_good_snapshots_beside_a_damaged_one(
    store: LocalStore, repo: Repository, tmp_path: Path, cli: Any
) -> None:
    good, bad = _two_snapshots(repo, tmp_path)
    _flip(store, repo.name(bad.name), 25)

    code, out, err = cli("list")
    assert code == 4
    assert good.id in out and bad.id in out and "damaged" in out
    good_row = next(line for line in out.splitlines() if good.id in line)
    assert "ann" in good_row and "damaged" not in good_row
    assert bad.id in err and repo.name(bad.name) in err

    for args in (("list", "--json"), ("--json", "list")):
        code, out, _ = cli(*args)
        assert code == 4
        (line,) = out.splitlines()  # one JSON line
        listed = {s["id"]: s for s in json.loads(line)["snapshots"]}
        assert listed[good.id]["damaged"] is False
        assert listed[good.id]["user"] == "ann" and listed[good.id]["stats"]["files"] == 2
        assert listed[good.id]["sources"][0]["path"] == str(tmp_path / "ann")
        assert listed[bad.id]["damaged"] is True and listed[bad.id]["user"] == "bob"
        assert repo.name(bad.name) in listed[bad.id]["error"]

    code, out, _ = cli("list", "--user", "ann", "--json")
    assert code == 0 and [s["id"] for s in json.loads(out)["snapshots"]] == [good.id]
    assert check(repo).damaged_manifests == [bad.id]


def test_a_manifest_that_opens_but_does_not_parse_is_corrupt(
    store: LocalStore, repo: Repository, tmp_path: Path
) -> None:
    manifest = _snap(repo, _home(tmp_path / "home", "ann"), "ann")
    name = repo.name(manifest.name)
    store.put(name, seal(repo.keys.seal_key, b"snapshot", b'{"v": 1, "id": "x"}'))
    with pytest.raises(CorruptObject, match="does not parse as a manifest"):
        repo.read_manifest(repo.snapshots()[0])


# -------------------------------------------------------------------- keys
def test_a_damaged_key_file_is_damage_and_a_wrong_master_key_is_not(
    store: LocalStore, repo: Repository, tmp_path: Path, cli: Any
) -> None:
    _snap(repo, _home(tmp_path / "home", "ann"), "ann")
    key_name = repo.name("keys/data")
    assert store.get(repo.name("keys/check")) == key_check(MASTER, "vision")

    wrong = tmp_path / "wrong.key"
    wrong.write_text(base64.b64encode(new_master_key()).decode())
    with pytest.raises(KeyUnavailable, match="not the master key"):
        Repository.open(store, "vision", base64.b64decode(wrong.read_text()), create=False)
    code, _, err = cli("list", key=wrong)
    assert code == 2 and "not the master key" in err

    _flip(store, key_name, 40)  # inside the sealed key: its tag fails
    with pytest.raises(DamagedKey, match="matches keys/check"):
        Repository.open(store, "vision", MASTER, create=False)
    code, _, err = cli("list")
    assert code == 4 and "keys/data" in err and "backup" in err
    code, _, err = cli("list", key=wrong)
    assert code == 2  # a wrong master key stays a wrong master key


def test_a_truncated_key_file_is_damage_even_without_a_key_check(
    store: LocalStore, repo: Repository
) -> None:
    key_name = repo.name("keys/data")
    store.delete(repo.name("keys/check"))
    store.put(key_name, store.get(key_name)[:-3])
    with pytest.raises(DamagedKey, match="not a sealed data key"):
        Repository.open(store, "vision", MASTER, create=False)


def test_without_a_key_check_a_failed_key_says_it_cannot_tell_and_a_writer_adds_one(
    store: LocalStore, repo: Repository
) -> None:
    check_name = repo.name("keys/check")
    store.delete(check_name)  # a repository from before keys/check
    Repository.open(store, "vision", MASTER, create=False)
    assert store.stat(check_name) is None  # readers write nothing
    Repository.open(store, "vision", MASTER)  # a writer does
    assert store.get(check_name) == key_check(MASTER, "vision")

    store.delete(check_name)
    _flip(store, repo.name("keys/data"), 40)
    with pytest.raises(KeyUnavailable, match="cannot tell the two apart"):
        Repository.open(store, "vision", MASTER, create=False)


def test_a_missing_key_file_beside_snapshots_is_damage_and_no_new_key_is_made(
    store: LocalStore, repo: Repository, tmp_path: Path, cli: Any
) -> None:
    _snap(repo, _home(tmp_path / "home", "ann"), "ann")
    key_name = repo.name("keys/data")
    store.delete(key_name)
    for create in (False, True):
        with pytest.raises(DamagedKey, match="missing"):
            Repository.open(store, "vision", MASTER, create=create)
    assert store.stat(key_name) is None
    code, _, err = cli(
        "create", str(tmp_path / "home"), "--user", "ann", "--cache-dir", str(tmp_path / "c")
    )
    assert code == 4 and "keys/data" in err and store.stat(key_name) is None
    with pytest.raises(SnapshotNotFound):  # a project without a repository is not damage
        Repository.open(store, "nlp", MASTER, create=False)


def test_a_damaged_config_is_damage(store: LocalStore, repo: Repository, cli: Any) -> None:
    store.put(repo.name("config"), b"{not json")
    code, _, err = cli("list")
    assert code == 4 and "config" in err
