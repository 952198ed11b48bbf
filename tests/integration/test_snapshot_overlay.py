"""A container's filesystem changes, snapshotted and restored through real overlay mounts.

The session's root is an overlay: the image below, its changes in an upper directory. The
snapshot holds only the changes (deletions as whiteouts, replaced directories as opaque);
restored into a fresh upper directory and mounted over the same image, the session sees
exactly what it saw before. Root is needed (mounts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.crypto import new_master_key
from gpufleet.snapshotter.manifest import SourceKind
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.restore import restore_snapshot
from gpufleet.snapshotter.store import LocalStore

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root"),
]


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    mounted: list[Path] = []
    yield mounted
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def _mount(mounted: list[Path], lower: Path, upper: Path, work: Path, merged: Path) -> None:
    for path in (upper, work, merged):
        path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={lower},upperdir={upper},workdir={work}",
            str(merged),
        ],
        check=True,
    )
    mounted.append(merged)


def _image(lower: Path) -> None:
    for rel, text in {
        "etc/config": "setting = 1\n",
        "opt/tool/bin/tool": "#!/bin/sh\necho tool\n",
        "var/data/a": "a\n",
        "var/data/b": "b\n",
        "usr/lib/doomed/x.so": "x" * 5000,
        "usr/lib/doomed/deeper/y.so": "y" * 5000,
        "usr/lib/kept.so": "kept",
    }.items():
        path = lower / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    os.chmod(lower / "opt/tool/bin/tool", 0o755)


def _view(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            content: object = None
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            out[os.path.relpath(path, root)] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                mtime,
                content,
            )
    return out


def test_container_changes_come_back_over_the_same_image(
    tmp_path: Path, mounts: list[Path]
) -> None:
    lower, merged = tmp_path / "lower", tmp_path / "merged"
    _image(lower)
    _mount(mounts, lower, tmp_path / "upper", tmp_path / "work", merged)
    # What a session does to its root: edit, add, delete, replace a directory, chmod.
    (merged / "etc/config").write_text("setting = 2\n")
    (merged / "etc/new.conf").write_text("new\n")
    os.makedirs(merged / "opt/conda/envs/x/bin")
    (merged / "opt/conda/envs/x/bin/python").write_bytes(os.urandom(600_000))
    (merged / "var/data/a").unlink()
    shutil.rmtree(merged / "usr/lib/doomed")
    shutil.rmtree(merged / "var/data")
    os.makedirs(merged / "var/data")
    (merged / "var/data/fresh").write_text("only this now\n")
    os.chmod(merged / "opt/tool/bin/tool", 0o700)
    os.chown(merged / "etc/new.conf", 1001, 1001)
    os.symlink("../etc/config", merged / "opt/config-link")
    before = _view(merged)

    repository = Repository.open(LocalStore(tmp_path / "store"), "vision", new_master_key())
    source = SourceSpec("rootfs", tmp_path / "upper", SourceKind.OVERLAY, merged=merged)
    manifest = create_snapshot(repository, [source], user="ann")
    # Only the changes are stored: not the image's untouched files.
    assert manifest.stats.bytes < 700_000
    subprocess.run(["umount", str(merged)], check=True)
    mounts.remove(merged)

    restored_upper = tmp_path / "upper2"
    restore_snapshot(repository, manifest, targets={"rootfs": restored_upper})
    whiteout = os.lstat(restored_upper / "usr/lib/doomed")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(restored_upper / "var/data", "trusted.overlay.opaque") == b"y"
    merged2 = tmp_path / "merged2"
    _mount(mounts, lower, restored_upper, tmp_path / "work2", merged2)
    assert _view(merged2) == before
    assert not (merged2 / "var/data/b").exists()
    assert (merged2 / "usr/lib/kept.so").read_text() == "kept"
