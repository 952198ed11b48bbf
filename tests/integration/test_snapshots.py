"""Snapshots end to end on real stores: a local directory and a real S3 server (SeaweedFS).

Round trips are compared byte for byte and stat field by stat field: several owners, modes,
mtimes to the nanosecond, extended attributes, symlinks, hard links, sparse files, special
files and names that are not UTF-8. Then what goes wrong: damaged data, a writer killed
mid-upload, a full disk, an unreachable store, garbage collection racing two writers.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.crypto import new_master_key
from gpufleet.snapshotter.errors import (
    DamagedSnapshot,
    RestoreRefused,
    SnapshotError,
    StoreFull,
    StoreUnreachable,
)
from gpufleet.snapshotter.gc import check, collect_garbage
from gpufleet.snapshotter.manifest import Manifest
from gpufleet.snapshotter.pack import pack_name
from gpufleet.snapshotter.repository import MAX_WRITER_S, Repository
from gpufleet.snapshotter.restore import restore_snapshot
from gpufleet.snapshotter.store import LocalStore, Store

pytestmark = pytest.mark.integration
ROOT = os.geteuid() == 0
MASTER = new_master_key()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    s3: Store = request.getfixturevalue("s3_store")
    return s3


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def _write(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime_ns: int | None = None,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    if owner is not None and ROOT:
        os.chown(path, *owner)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def make_rich_tree(root: Path) -> None:
    """Everything a home or an environment holds that a restore must get exactly right."""
    root.mkdir(parents=True)
    _write(root / "notes.md", b"# notes\n" * 100, 0o640, (1001, 1001), 1_700_000_000_123_456_789)
    _write(root / ".ssh" / "id_ed25519", b"-----BEGIN KEY-----\nsecret\n", 0o600, (1001, 1001))
    os.chmod(root / ".ssh", 0o700)
    _write(root / "shared" / "data.bin", os.urandom(3 << 20), 0o664, (1002, 1003))  # chunked
    _write(root / "shared" / "repeat.bin", b"0123456789abcdef" * (400 << 10), 0o644)
    _write(root / "bin" / "tool", b"#!/bin/sh\necho ok\n", 0o4755, (0, 0))
    _write(root / "shared" / "team.txt", b"group-writable\n", 0o664)  # beyond a 022 umask
    _write(root / "shared" / "frozen.txt", b"read-only\n", 0o444)
    _write(root / "empty", b"")
    (root / "empty-dir").mkdir()
    (root / "deep" / "a" / "b" / "c").mkdir(parents=True)
    _write(root / "deep" / "a" / "b" / "c" / "leaf", b"leaf")
    os.symlink("notes.md", root / "link-to-notes")
    os.symlink("/nowhere/at/all", root / "dangling")
    os.link(root / "notes.md", root / "deep" / "hardlink-to-notes")
    os.link(root / "notes.md", root / "hardlink-2")
    (root / os.fsdecode(b"caf\xe9-latin1")).write_bytes(b"not utf-8 name")
    with open(root / "sparse.img", "wb") as f:  # 256 MiB apparent, two small data ranges
        f.seek(64 << 20)
        f.write(b"middle" * 1000)
        f.seek((256 << 20) - 5)
        f.write(b"end!\n")
    os.setxattr(root / "notes.md", "user.origin", b"\x00binary\xff")
    os.setxattr(root / "shared", "user.project", b"vision")
    if ROOT:
        os.setxattr(root / "bin" / "tool", "trusted.gpufleet", b"t")
        os.mknod(root / "null-device", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(root / "pipe", 0o620)
    os.utime(root / "deep", ns=(1_600_000_000_000_000_001, 1_600_000_000_000_000_001))


def describe(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path's type, metadata and content digest; hard links as shared groups."""
    out: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            xattrs = {
                x: os.getxattr(path, x, follow_symlinks=False)
                for x in os.listxattr(path, follow_symlinks=False)
            }
            kind = stat.S_IFMT(st.st_mode)
            content: Any = None
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                if st.st_nlink > 1:
                    content = (content, inodes.setdefault(st.st_ino, rel))
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            elif stat.S_ISCHR(st.st_mode):
                content = st.st_rdev
            mtime = st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) or rel != "." else None
            out[rel] = (
                kind,
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                mtime,
                st.st_size if not stat.S_ISDIR(st.st_mode) else None,
                xattrs,
                content,
            )
    return out


def _repo(store: Store, project: str = "vision") -> Repository:
    return Repository.open(store, project, MASTER)


def _snap(
    repo: Repository, root: Path, user: str = "ann", cache: Path | None = None, **kwargs: Any
) -> Manifest:
    return create_snapshot(repo, [SourceSpec("home", root)], user=user, cache_dir=cache, **kwargs)


@pytest.mark.parametrize("workers", [None, 1], ids=["worker-processes", "in-process"])
def test_round_trip_is_exact(store: Store, tmp_path: Path, workers: int | None) -> None:
    home = tmp_path / "home"
    make_rich_tree(home)
    repo = _repo(store)
    manifest = _snap(repo, home)
    assert (
        manifest.stats.files
        == len([p for p in home.rglob("*") if p.is_file() and not p.is_symlink()]) - 2
    )  # two extra links
    out = tmp_path / "out"
    result = restore_snapshot(_repo(store), manifest, targets={"home": out}, workers=workers)
    assert describe(out) == describe(home)
    assert result.files == manifest.stats.files
    # Holes stay holes: the 256 MiB file takes a few blocks, as the original does.
    assert os.stat(out / "sparse.img").st_blocks * 512 < 1 << 20


def test_unchanged_and_restored_trees_are_not_read_again(
    local_store: LocalStore, tmp_path: Path
) -> None:
    home, cache = tmp_path / "home", tmp_path / "cache"
    make_rich_tree(home)
    repo = _repo(local_store)
    first = _snap(repo, home, cache=cache)
    again = _snap(repo, home, cache=cache)
    assert (again.stats.reused_files, again.stats.new_bytes) == (first.stats.files, 0)
    assert again.stats.reused_dirs == again.stats.dirs  # no tree encoded again
    assert again.stats.uploaded_bytes < 2048  # the manifest alone
    assert again.sources[0].tree == first.sources[0].tree
    (home / "notes2.md").write_bytes(b"one more file")
    third = _snap(repo, home, cache=cache)
    assert third.stats.reused_files == first.stats.files
    assert third.stats.reused_dirs == third.stats.dirs - 1  # the root's tree only
    assert third.stats.new_bytes < 64 << 10  # the new file and the root's tree
    assert third.parent == again.id

    out = tmp_path / "out"
    restore_snapshot(repo, third, targets={"home": out}, cache_dir=cache)
    after_restore = create_snapshot(repo, [SourceSpec("home", out)], user="ann", cache_dir=cache)
    assert after_restore.stats.reused_files == after_restore.stats.files
    # The restore signed each directory as a walk does: no tree is encoded again.
    assert after_restore.stats.reused_dirs == after_restore.stats.dirs
    assert after_restore.stats.new_bytes == 0
    # A new file in the restored root: the root's other files are vouched for by the
    # records the restore wrote for them (inode, size, mtime, ctime), not read again.
    (out / "later.txt").write_bytes(b"written after the restore")
    changed = create_snapshot(repo, [SourceSpec("home", out)], user="ann", cache_dir=cache)
    assert changed.stats.reused_files == changed.stats.files - 1


def test_the_cycle_collector_is_paused_only_while_a_run_lasts(
    local_store: LocalStore, tmp_path: Path
) -> None:
    """Snapshots and restores pause Python's cycle collector (``collector.py``) and leave
    it as they found it, whether they succeed or refuse: a service that runs them would
    otherwise stop freeing its cyclic garbage for good."""
    home = tmp_path / "home"
    _write(home / "a.txt", b"a")
    repo = _repo(local_store)
    seen: list[bool] = []
    manifest = create_snapshot(
        repo,
        [SourceSpec("home", home)],
        user="ann",
        on_progress=lambda _: seen.append(gc.isenabled()),
    )
    assert seen and not any(seen) and gc.isenabled()
    restore_snapshot(repo, manifest, targets={"home": tmp_path / "out"})
    assert gc.isenabled()
    with pytest.raises(RestoreRefused):
        restore_snapshot(repo, manifest, targets={"home": home})  # not empty
    assert gc.isenabled()
    gc.disable()
    try:
        restore_snapshot(repo, manifest, targets={"home": tmp_path / "again"})
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_a_non_empty_target_is_refused_unless_asked(
    local_store: LocalStore, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _write(home / "a.txt", b"from the snapshot")
    _write(home / "sub" / "b.txt", b"b")
    repo = _repo(local_store)
    manifest = _snap(repo, home)
    out = tmp_path / "out"
    _write(out / "a.txt", b"local edit")
    _write(out / "keep.txt", b"not in the snapshot")
    with pytest.raises(RestoreRefused, match="not empty"):
        restore_snapshot(repo, manifest, targets={"home": out})
    assert (out / "a.txt").read_bytes() == b"local edit"
    restore_snapshot(repo, manifest, targets={"home": out}, overwrite=True)
    assert (out / "a.txt").read_bytes() == b"from the snapshot"
    assert (out / "sub" / "b.txt").read_bytes() == b"b"
    assert (out / "keep.txt").read_bytes() == b"not in the snapshot"


def test_deduplication_inside_a_project_and_never_across(store: Store, tmp_path: Path) -> None:
    ann = tmp_path / "ann"
    _write(ann / "model.bin", os.urandom(2 << 20))
    _write(ann / "env" / "lib.so", os.urandom(1 << 20))
    bob = tmp_path / "bob"
    subprocess.run(["cp", "-a", str(ann), str(bob)], check=True)
    _write(bob / "own.txt", b"bob's")
    first = _snap(_repo(store), ann, user="ann")
    second = _snap(_repo(store), bob, user="bob")
    assert second.stats.new_bytes < 64 << 10  # bob's file and two trees
    other_project = _snap(_repo(store, "nlp"), bob, user="bob")
    assert other_project.stats.new_bytes >= first.stats.new_bytes


def _damage(store: Store, repo: Repository, manifest: Manifest, how: str) -> set[str]:
    """Damage the pack holding shared/data.bin; the paths whose data lives in it."""
    from gpufleet.snapshotter.restore import read_tree

    index = repo.load_index()
    nodes = dict(read_tree(repo, index, manifest.sources[0].tree))
    location = index.get(nodes["shared/data.bin"].chunks[0])
    assert location is not None
    # A missing pack takes every file with data in it; a corrupt byte, the files with data
    # in the one segment it falls in (each segment is checked on its own).
    same = (
        (lambda loc: loc.pack_id == location.pack_id)
        if how == "missing"
        else (lambda loc: loc[:2] == location[:2])
    )
    affected = {
        rel
        for rel, node in nodes.items()
        if any((loc := index.get(c)) is not None and same(loc) for c in node.chunks)
    }
    name = repo.name(pack_name(location.pack_id))
    if how == "missing":
        store.delete(name)
    else:
        data = bytearray(store.get(name))
        data[location.segment_offset + 40] ^= 0xFF
        store.put(name, bytes(data))
    return affected


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_damaged_data_names_the_files_it_affects(
    local_store: LocalStore, tmp_path: Path, how: str
) -> None:
    home = tmp_path / "home"
    _write(home / "shared" / "data.bin", os.urandom(3 << 20))
    _write(home / "other.txt", b"fine")
    repo = _repo(local_store)
    manifest = _snap(repo, home)
    affected = _damage(local_store, repo, manifest, how)
    assert "shared/data.bin" in affected
    out = tmp_path / "out"
    with pytest.raises(DamagedSnapshot) as raised:
        restore_snapshot(_repo(local_store), manifest, targets={"home": out})
    assert {os.path.relpath(p, out) for p in raised.value.paths} == affected
    assert "shared/data.bin" in str(raised.value)
    for rel in affected:  # absent, not half written; everything else is there
        assert not (out / rel).exists()
    if how == "corrupt" and "other.txt" not in affected:
        assert (out / "other.txt").read_bytes() == b"fine"
    if how == "missing":
        assert not out.exists() or not any(out.iterdir())  # nothing written before the check
    report = check(_repo(local_store), read_data=True)
    assert report.problems


def test_a_snapshot_killed_mid_upload_never_becomes_the_latest(
    local_store: LocalStore, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _write(home / "small.txt", b"first version")
    repo = _repo(local_store)
    previous = _snap(repo, home)
    for i in range(6):  # several packs' worth, so the kill lands between two uploads
        _write(home / f"big{i}.bin", os.urandom(12 << 20))
    key = tmp_path / "key"
    key.write_text(__import__("base64").b64encode(MASTER).decode())
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.cli",
            "snapshot",
            "--store",
            str(local_store.root),
            "--key-file",
            str(key),
            "--project",
            "vision",
            "create",
            str(home),
            "--user",
            "ann",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    packs = local_store.root / "projects" / "vision" / "packs"

    def stored() -> set[str]:
        return {p.name for p in packs.rglob("*") if p.is_file()}

    before = stored()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(not name.startswith(".tmp-") for name in stored() - before):
            break
        assert child.poll() is None, "the snapshot finished before a pack was seen"
        time.sleep(0.01)  # polling the store for the first new pack
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    repo = _repo(local_store)
    latest = repo.latest("ann", "")
    assert latest is not None and latest.id == previous.id
    out = tmp_path / "out"
    restore_snapshot(repo, repo.read_manifest(latest), targets={"home": out})
    assert (out / "small.txt").read_bytes() == b"first version"
    assert not check(repo).problems
    orphans = stored() - before
    assert any(not name.startswith(".tmp-") for name in orphans)
    first = collect_garbage(repo, margin_s=0)
    assert first.tombstoned >= 1 and first.deleted_packs == 0
    # The killed writer's lock holds the sweep until it is older than a run may last.
    held = collect_garbage(repo, margin_s=0)
    assert held.waiting_for and held.deleted_packs == 0
    later = collect_garbage(repo, margin_s=0, now=time.time() + MAX_WRITER_S + 60)
    assert later.deleted_packs >= 1 and later.abandoned == len(
        [n for n in orphans if n.startswith(".tmp-")]
    )
    assert not (stored() & orphans)  # packs nothing refers to, and half-written ones
    assert not check(repo, read_data=True).problems


def test_an_unreachable_store_or_a_full_disk_fails_cleanly(tmp_path: Path) -> None:
    from gpufleet.snapshotter.s3 import S3Store

    home = tmp_path / "home"
    _write(home / "a.bin", os.urandom(3 << 20))
    closed = S3Store(
        "bucket",
        endpoint_url="http://127.0.0.1:9",
        access_key="k",
        secret_key="s",
        connect_timeout=1,
        max_attempts=1,
    )
    started = time.monotonic()
    with pytest.raises(StoreUnreachable):
        Repository.open(closed, "vision", MASTER)
    assert time.monotonic() - started < 30
    if not ROOT:
        pytest.skip("a small tmpfs needs root to mount")
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(full)], check=True)
    try:
        store = LocalStore(full)
        repo = _repo(store)
        _write(home / "small.txt", b"fits")
        (home / "a.bin").unlink()
        previous = _snap(repo, home)
        _write(home / "a.bin", os.urandom(3 << 20))
        with pytest.raises(StoreFull):
            _snap(repo, home)
        latest = repo.latest("ann", "")
        assert latest is not None and latest.id == previous.id
        assert not [p for p in full.rglob(".tmp-*")]
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_collection_racing_two_writers_never_loses_live_data(store: Store, tmp_path: Path) -> None:
    """Two users snapshot again and again (changing, adding and deleting files, and
    forgetting old snapshots) while garbage collection runs with no safety margin at all:
    only the writer locks and tombstones protect them. Every snapshot left must restore."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer(user: str) -> None:
        home = tmp_path / user
        try:
            for round_ in range(6):
                _write(home / f"r{round_}.bin", os.urandom(300 << 10))
                _write(home / "common.bin", os.urandom(200 << 10))  # replaced every time
                if round_ >= 2:
                    (home / f"r{round_ - 2}.bin").unlink()
                _snap(_repo(store), home, user=user, cache=tmp_path / f"cache-{user}")
                refs = _repo(store).snapshots(user)
                for old in refs[:-2]:
                    _repo(store).delete_manifest(old)
        except (SnapshotError, OSError) as e:  # reported by the test below
            failures.append(e)

    def collector() -> None:
        try:
            while not stop.is_set():
                collect_garbage(_repo(store), margin_s=0)
        except (SnapshotError, OSError) as e:
            failures.append(e)

    threads = [threading.Thread(target=writer, args=(u,)) for u in ("ann", "bob")]
    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    stop.set()
    gc_thread.join(timeout=120)
    assert not failures, failures
    repo = _repo(store)
    assert not check(repo, read_data=True).problems
    for ref in repo.snapshots():
        out = tmp_path / "restored" / ref.id
        restore_snapshot(repo, repo.read_manifest(ref), targets={"home": out})
        assert (out / "common.bin").stat().st_size == 200 << 10


@pytest.fixture
def cli_env(tmp_path: Path, local_store: LocalStore) -> Iterator[dict[str, str]]:
    key = tmp_path / "key"
    key.write_text(__import__("base64").b64encode(MASTER).decode())
    yield {
        **os.environ,
        "GPUFLEET_SNAPSHOT_STORE": str(local_store.root),
        "GPUFLEET_SNAPSHOT_KEY_FILE": str(key),
        "COLUMNS": "200",
    }


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "snapshot", "--project", "vision", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd="/",
    )


def test_cli_commands_and_exit_codes(cli_env: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write(home / "a.txt", b"a")
    created = _cli(
        cli_env, "create", str(home), "--user", "ann", "--cache-dir", str(tmp_path / "cache")
    )
    assert created.returncode == 0, created.stderr
    assert "restore it: gpufleet snapshot" in created.stdout
    listed = _cli(cli_env, "list")
    assert listed.returncode == 0 and "ann" in listed.stdout
    shown = _cli(cli_env, "show", "latest", "--user", "ann")
    assert shown.returncode == 0 and str(home) in shown.stdout
    out = tmp_path / "out"
    _write(out / "x", b"in the way")
    refused = _cli(cli_env, "restore", "latest", "--user", "ann", "--target", f"home={out}")
    assert refused.returncode == 2 and "not empty" in refused.stderr
    restored = _cli(
        cli_env, "restore", "latest", "--user", "ann", "--target", f"home={out}", "--overwrite"
    )
    assert restored.returncode == 0 and (out / "a.txt").read_bytes() == b"a"
    assert _cli(cli_env, "check", "--read-data").returncode == 0
    missing = _cli(cli_env, "show", "nonexistent-id")
    assert missing.returncode == 2 and "snapshot list" in missing.stderr
    no_key = _cli({**cli_env, "GPUFLEET_SNAPSHOT_KEY_FILE": str(tmp_path / "nope")}, "list")
    assert no_key.returncode == 2 and "openssl rand -base64 32" in no_key.stderr
