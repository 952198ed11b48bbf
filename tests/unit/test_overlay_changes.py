"""The pure parts of the container-filesystem-changes readers and of the session sandbox.

Overlay entries are classified from literal ``(mode, rdev, size, xattrs)``; an upper directory
built by hand with ``user.overlay.*`` xattrs (settable without root) checks the walk; the
baseline diff runs on a small temporary tree; the sandbox command lines are compared with
literal lists. No mounts and no root needed (the real mounts are in
``tests/integration/test_overlay.py``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpufleet.snapshotter.baseline import Baseline, Meta, diff_baseline, take_baseline
from gpufleet.snapshotter.errors import CaptureError
from gpufleet.snapshotter.overlay import (
    Change,
    ChangeKind,
    EntryKind,
    classify,
    is_overlay_xattr,
    marks_xwhiteouts,
    merged_xattr_name,
    read_upper,
)
from gpufleet.snapshotter.sandbox import (
    RootEntry,
    SandboxMode,
    SandboxSupport,
    candidate_modes,
    host_root,
    layer_dirs,
    sandbox_argv,
)

PRESENT, DELETED, OPAQUE = ChangeKind.PRESENT, ChangeKind.DELETED, ChangeKind.OPAQUE
REG, DIR, CHR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFCHR
T, U = "trusted.overlay.", "user.overlay."


# ------------------------------------------------------------------ classification
@pytest.mark.parametrize(
    ("mode", "rdev", "size", "xattrs", "xwhiteouts", "expected"),
    [
        # a character device 0/0 is a whiteout, whatever its permissions
        (CHR | 0o000, 0, 0, {}, False, EntryKind.WHITEOUT),
        (CHR | 0o644, 0, 0, {}, False, EntryKind.WHITEOUT),
        # any other device is a device the session made
        (CHR | 0o666, os.makedev(1, 3), 0, {}, False, EntryKind.PLAIN),
        (stat.S_IFBLK | 0o660, 0, 0, {}, False, EntryKind.PLAIN),
        # xwhiteout: zero-size regular file with overlay.whiteout, where marked opaque=x
        (REG, 0, 0, {T + "whiteout": b""}, True, EntryKind.WHITEOUT),
        (REG, 0, 0, {U + "whiteout": b""}, True, EntryKind.WHITEOUT),
        (REG, 0, 0, {T + "whiteout": b""}, False, EntryKind.PLAIN),  # parent not marked
        (REG, 5, 5, {T + "whiteout": b""}, True, EntryKind.PLAIN),  # not empty
        # opaque directories; "x" only marks xwhiteouts and is not opaque
        (DIR, 0, 4096, {T + "opaque": b"y"}, False, EntryKind.OPAQUE_DIR),
        (DIR, 0, 4096, {U + "opaque": b"y"}, False, EntryKind.OPAQUE_DIR),
        (DIR, 0, 4096, {T + "opaque": b"x"}, False, EntryKind.MERGE_DIR),
        (DIR, 0, 4096, {T + "opaque": b"n"}, False, EntryKind.MERGE_DIR),
        # renamed directories; opaque wins (the kernel does not look below an opaque dir)
        (DIR, 0, 4096, {T + "redirect": b"d"}, False, EntryKind.REDIRECT_DIR),
        (DIR, 0, 4096, {U + "redirect": b"/a/d"}, False, EntryKind.REDIRECT_DIR),
        (DIR, 0, 4096, {T + "redirect": b"d", T + "opaque": b"y"}, False, EntryKind.OPAQUE_DIR),
        # metadata-only copy-up, renamed or not
        (REG, 0, 1 << 20, {T + "metacopy": b""}, False, EntryKind.METACOPY),
        (REG, 0, 9, {T + "metacopy": b"", T + "redirect": b"/big"}, False, EntryKind.METACOPY),
        # ordinary entries; the overlay's bookkeeping does not change what they are
        (REG, 0, 3, {}, False, EntryKind.PLAIN),
        (REG, 0, 3, {T + "origin": b"\0\1", "user.mine": b"v"}, False, EntryKind.PLAIN),
        (DIR, 0, 4096, {T + "origin": b"\0", T + "impure": b"y"}, False, EntryKind.MERGE_DIR),
        (stat.S_IFLNK | 0o777, 0, 8, {}, False, EntryKind.PLAIN),
        (stat.S_IFIFO | 0o644, 0, 0, {}, False, EntryKind.PLAIN),
        (stat.S_IFSOCK | 0o755, 0, 0, {}, False, EntryKind.PLAIN),
    ],
)
def test_classify(
    mode: int, rdev: int, size: int, xattrs: dict[str, bytes], xwhiteouts: bool, expected: EntryKind
) -> None:
    assert classify(mode, rdev, size, xattrs, xwhiteouts=xwhiteouts) is expected


def test_xwhiteout_marker() -> None:
    assert marks_xwhiteouts({T + "opaque": b"x"})
    assert marks_xwhiteouts({U + "opaque": b"x"})
    assert not marks_xwhiteouts({T + "opaque": b"y"})
    assert not marks_xwhiteouts({})


@pytest.mark.parametrize(
    ("name", "seen_as"),
    [
        ("trusted.overlay.opaque", None),
        ("trusted.overlay.metacopy", None),
        ("trusted.overlay.origin", None),
        ("user.overlay.redirect", None),
        ("trusted.overlay.overlay.opaque", "trusted.overlay.opaque"),  # escaped: a real one
        ("user.overlay.overlay.whiteout", "user.overlay.whiteout"),
        ("trusted.overlay.overlay.", None),  # nothing after the escape: bookkeeping
        ("user.mime_type", "user.mime_type"),
        ("security.capability", "security.capability"),
        ("trusted.overlayish", "trusted.overlayish"),
    ],
)
def test_overlay_xattr_names(name: str, seen_as: str | None) -> None:
    assert merged_xattr_name(name) == seen_as
    assert is_overlay_xattr(name) is (seen_as is None)


# ------------------------------------------------ the walk, on an upper made by hand
def _user_xattrs_work(where: Path) -> bool:
    probe = where / ".xattr-probe"
    probe.touch()
    try:
        os.setxattr(probe, "user.overlay.probe", b"1")
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.fixture
def hand_upper(tmp_path: Path) -> Path:
    """An upper directory in the user.overlay namespace (userxattr), without whiteout devices."""
    if not _user_xattrs_work(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses user.* xattrs")
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "app.conf").write_text("changed")
    (upper / "opt" / "new").mkdir(parents=True)
    os.setxattr(upper / "opt", "user.overlay.opaque", b"y")
    (upper / "opt" / "new" / "bin").write_text("#!")
    os.symlink("app.conf", upper / "etc" / "link")
    return upper


def test_read_upper_walks_in_path_order(hand_upper: Path) -> None:
    (hand_upper / "etc" / "a-b").write_text("")  # '-' sorts before '/' children of 'etc/a'
    (hand_upper / "etc" / "a").mkdir()
    (hand_upper / "etc" / "a" / "z").write_text("")
    assert list(read_upper(hand_upper)) == [
        Change("etc", PRESENT),
        Change("etc/a", PRESENT),
        Change("etc/a/z", PRESENT),
        Change("etc/a-b", PRESENT),
        Change("etc/app.conf", PRESENT),
        Change("etc/link", PRESENT),
        Change("opt", OPAQUE),
        Change("opt/new", PRESENT),
        Change("opt/new/bin", PRESENT),
    ]


def test_xwhiteouts_count_only_where_root_and_parent_are_marked(hand_upper: Path) -> None:
    for name in ("gone", "kept"):
        (hand_upper / "etc" / name).touch()
        os.setxattr(hand_upper / "etc" / name, "user.overlay.whiteout", b"")
    os.setxattr(hand_upper / "etc", "user.overlay.opaque", b"x")
    # The layer root is not marked yet: the kernel would not look for xwhiteouts at all.
    assert Change("etc/gone", PRESENT) in list(read_upper(hand_upper))
    os.setxattr(hand_upper, "user.overlay.opaque", b"x")
    changes = list(read_upper(hand_upper))
    assert Change("etc", PRESENT) in changes  # opaque=x is no opaque directory
    assert Change("etc/gone", DELETED) in changes
    assert Change("etc/kept", DELETED) in changes


def test_redirect_reads_the_whole_directory_from_merged(hand_upper: Path, tmp_path: Path) -> None:
    moved = hand_upper / "srv" / "data2"
    moved.mkdir(parents=True)
    os.setxattr(moved, "user.overlay.redirect", b"data")
    (moved / "changed").write_text("upper")
    merged = tmp_path / "merged"  # a stand-in for the mounted view
    (merged / "srv" / "data2" / "sub").mkdir(parents=True)
    for name in ("changed", "from-lower", "sub/deep"):
        (merged / "srv" / "data2" / name).write_text("x")
    changes = [c for c in read_upper(hand_upper, merged) if c.path.startswith("srv")]
    assert changes == [
        Change("srv", PRESENT),
        Change("srv/data2", OPAQUE),
        Change("srv/data2/changed", PRESENT),
        Change("srv/data2/from-lower", PRESENT),
        Change("srv/data2/sub", PRESENT),
        Change("srv/data2/sub/deep", PRESENT),
    ]
    with pytest.raises(CaptureError, match=r"renamed directory.*merged="):
        list(read_upper(hand_upper))


def test_metacopy_needs_merged(hand_upper: Path, tmp_path: Path) -> None:
    os.setxattr(hand_upper / "etc" / "app.conf", "user.overlay.metacopy", b"")
    with pytest.raises(CaptureError, match=r"metadata-only copy.*merged="):
        list(read_upper(hand_upper))
    assert Change("etc/app.conf", PRESENT) in list(read_upper(hand_upper, tmp_path))


def test_read_upper_refuses_what_is_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="not a directory"):
        read_upper(tmp_path / "missing")
    with pytest.raises(CaptureError, match="merged overlay path"):
        read_upper(tmp_path, tmp_path / "missing")


# --------------------------------------------------------------------- baseline
@pytest.fixture
def image(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for d in ("etc", "usr/lib/pkg", "usr/bin", "var/log", "proc", "home/ann/.cache/pip/x"):
        (root / d).mkdir(parents=True)
    files = {
        "etc/hosts": "127.0.0.1 localhost\n",
        "etc/app.conf": "a=1\n",
        "usr/bin/tool": "#!/bin/sh\n",
        "usr/lib/pkg/a.py": "A\n",
        "usr/lib/pkg/b.py": "B\n",
        "var/log/old.log": "old\n",
        "home/ann/.cache/pip/x/wheel": "w",
        "home/ann/notes": "n",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    os.symlink("tool", root / "usr/bin/alias")
    return root


EXCLUDE = ("proc", "/tmp/", "home/*/.cache/pip")


def _touch_later(path: Path) -> None:
    """Give ``path`` an mtime that differs from the baseline's (no sleep needed)."""
    st = path.lstat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000), follow_symlinks=False)


def test_baseline_diff_reports_new_changed_and_deleted(image: Path) -> None:
    baseline = take_baseline(image, EXCLUDE)
    assert baseline.get("proc") is None and baseline.get("home/ann/.cache/pip") is None
    assert baseline.get("usr/bin/alias") == Meta(
        "l", len("tool"), *_times_mode_owner(image / "usr/bin/alias"), "tool"
    )

    (image / "etc/app.conf").write_text("a=2, longer\n")  # size changes
    (image / "etc/hosts").chmod(0o600)  # mode only
    _touch_later(image / "usr/bin/tool")  # mtime only
    (image / "usr/bin/alias").unlink()
    os.symlink("other", image / "usr/bin/alias")  # target changes
    (image / "var/log/old.log").unlink()
    for name in ("a.py", "b.py"):
        (image / "usr/lib/pkg" / name).unlink()
    (image / "usr/lib/pkg").rmdir()  # a deleted directory is one change
    (image / "usr/lib").rmdir()
    (image / "opt/new").mkdir(parents=True)
    (image / "opt/new/file").write_text("new")
    (image / "home/ann/.cache/pip/x/wheel").unlink()  # excluded: never reported
    (image / "proc/self").mkdir()  # excluded
    for d in ("etc", "usr/bin", "var/log", "usr"):
        _touch_later(image / d)  # the directories' mtimes all move on, whatever the clock

    changes = list(diff_baseline(baseline, image, EXCLUDE))
    assert changes == [
        Change("etc", PRESENT),
        Change("etc/app.conf", PRESENT),
        Change("etc/hosts", PRESENT),
        Change("opt", PRESENT),
        Change("opt/new", PRESENT),
        Change("opt/new/file", PRESENT),
        Change("usr", PRESENT),
        Change("usr/bin", PRESENT),
        Change("usr/bin/alias", PRESENT),
        Change("usr/bin/tool", PRESENT),
        Change("usr/lib", DELETED),
        Change("var/log", PRESENT),
        Change("var/log/old.log", DELETED),
    ]


def _times_mode_owner(path: Path) -> tuple[int, int, int, int]:
    st = path.lstat()
    return st.st_mtime_ns, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_baseline_unchanged_tree_has_no_changes(image: Path) -> None:
    baseline = take_baseline(image, EXCLUDE)
    assert list(diff_baseline(baseline, image, EXCLUDE)) == []
    # Without the exclusions the excluded paths are new; the pip cache comes out whole.
    assert [c.path for c in diff_baseline(baseline, image) if c.path.startswith("home")] == [
        "home/ann/.cache/pip",
        "home/ann/.cache/pip/x",
        "home/ann/.cache/pip/x/wheel",
    ]


def test_baseline_type_changes_are_present(image: Path) -> None:
    baseline = take_baseline(image)
    (image / "etc/hosts").unlink()
    (image / "etc/hosts").mkdir()  # file -> directory: everything under it is new
    (image / "etc/hosts/inner").write_text("")
    for name in ("a.py", "b.py"):
        (image / "usr/lib/pkg" / name).unlink()
    (image / "usr/lib/pkg").rmdir()
    (image / "usr/lib/pkg").write_text("a file now")  # directory -> file
    for d in ("etc", "usr/lib"):
        _touch_later(image / d)
    assert list(diff_baseline(baseline, image)) == [
        Change("etc", PRESENT),
        Change("etc/hosts", PRESENT),
        Change("etc/hosts/inner", PRESENT),
        Change("usr/lib", PRESENT),
        Change("usr/lib/pkg", PRESENT),
    ]


def test_baseline_dump_load_round_trip(image: Path) -> None:
    odd = os.fsdecode(b"caf\xe9-latin1")  # not UTF-8: kept through surrogateescape
    (image / "etc" / odd).write_text("x")
    baseline = take_baseline(image, EXCLUDE)
    data = baseline.dump()
    loaded = Baseline.load(data)
    assert loaded == baseline
    assert loaded.exclude == EXCLUDE
    assert loaded.get(f"etc/{odd}") is not None
    assert list(diff_baseline(loaded, image, EXCLUDE)) == []
    assert [p for p, _ in loaded.paths()][:3] == ["etc", "etc/app.conf", f"etc/{odd}"]


def test_baseline_load_refuses_garbage() -> None:
    with pytest.raises(CaptureError, match="not a gpufleet baseline"):
        Baseline.load(b"not zstd at all")
    import zstandard

    wrong = zstandard.ZstdCompressor().compress(b'{"format": "other", "version": 1}\n')
    with pytest.raises(CaptureError, match="take a new one"):
        Baseline.load(wrong)
    missing = zstandard.ZstdCompressor().compress(
        b'{"format": "gpufleet-baseline", "version": 1}\n["", [["d", "d", 0, 1, 493, 0, 0, null]]]'
    )
    with pytest.raises(CaptureError, match="without a listing"):
        Baseline.load(missing)


def test_take_baseline_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(CaptureError, match="not a directory"):
        take_baseline(tmp_path / "f")
    with pytest.raises(CaptureError, match="cannot read"):
        take_baseline(tmp_path / "missing")


# ----------------------------------------------------------------- sandbox argv
ROOT_08 = SandboxSupport(
    SandboxMode.OVERLAY_MOUNT,
    "",
    bwrap="/usr/bin/bwrap",
    bwrap_version=(0, 8, 0),
    unshare="/usr/bin/unshare",
    is_root=True,
    gpu_devices=("/dev/nvidia0", "/dev/nvidiactl"),
)
S = Path("/srv/s")
COMMON: dict[str, Any] = dict(
    upper=S / "upper",
    work=S / "work",
    merged=S / "merged",
    home=Path("/home/ann"),
    binds=[(Path("/data/shared"), Path("/data"))],
    env_prefix=Path("/envs/ann"),
    argv=["jupyter", "lab"],
    # Two directories of the host's root and one symlink: nothing else of it is there.
    root=(RootEntry("usr"), RootEntry("etc"), RootEntry("bin", "usr/bin")),
)
TAIL = [
    "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm",
    "--dev-bind", "/dev/nvidia0", "/dev/nvidia0", "--dev-bind", "/dev/nvidiactl", "/dev/nvidiactl",
    "--perms", "1777", "--tmpfs", "/tmp",
    "--perms", "0755", "--dir", "/home",
    "--perms", "0755", "--dir", "/envs",  # mount points' parents, made traversable
    "--bind", "/home/ann", "/home/ann",
    "--bind", "/envs/ann", "/envs/ann",
    "--bind", "/data/shared", "/data",
    "--unshare-pid", "--die-with-parent", "--new-session",
]  # fmt: skip


def build(support: SandboxSupport, **overrides: Any) -> list[str]:
    """``sandbox_argv`` with the COMMON arguments, some replaced."""
    return sandbox_argv(support, **{**COMMON, **overrides})


def test_argv_overlay_mount() -> None:
    assert build(ROOT_08) == [
        "/usr/bin/unshare", "-m", "--", "/bin/sh", "-c",
        "mount --make-rprivate / && "
        'while [ "$1" != -- ]; do mount -t overlay overlay -o '
        '"lowerdir=$1,upperdir=$2,workdir=$3,redirect_dir=off,metacopy=off,index=off" "$4" '
        '|| exit 1; shift 4; done; shift && exec "$@"',
        "sh",
        "/usr", "/srv/s/upper/usr", "/srv/s/work/usr", "/srv/s/merged/usr",
        "/etc", "/srv/s/upper/etc", "/srv/s/work/etc", "/srv/s/merged/etc",
        "--",
        "/usr/bin/bwrap", "--bind", "/srv/s/merged/usr", "/usr",
        "--bind", "/srv/s/merged/etc", "/etc", "--symlink", "usr/bin", "/bin",
        "--ro-bind", "/sys", "/sys",
        *TAIL, "--", "jupyter", "lab",
    ]  # fmt: skip


def test_argv_overlay_bwrap_and_readonly_and_none() -> None:
    native = SandboxSupport(
        SandboxMode.OVERLAY_BWRAP, "", bwrap="/bin/bwrap", bwrap_version=(0, 9, 0), uid=1000,
        gid=1000, gpu_devices=("/dev/nvidia0", "/dev/nvidiactl"),
    )  # fmt: skip
    assert build(native) == [
        "/bin/bwrap",
        "--overlay-src", "/usr", "--overlay", "/srv/s/upper/usr", "/srv/s/work/usr", "/usr",
        "--overlay-src", "/etc", "--overlay", "/srv/s/upper/etc", "/srv/s/work/etc", "/etc",
        "--symlink", "usr/bin", "/bin", "--ro-bind", "/sys", "/sys",
        *TAIL, "--", "jupyter", "lab",
    ]  # fmt: skip
    readonly = SandboxSupport(
        SandboxMode.READONLY, "", bwrap="/bin/bwrap", gpu_devices=ROOT_08.gpu_devices
    )
    assert build(readonly) == [
        "/bin/bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc",
        "--symlink", "usr/bin", "/bin", "--ro-bind", "/sys", "/sys",
        *TAIL, "--", "jupyter", "lab",
    ]  # fmt: skip
    assert build(SandboxSupport(SandboxMode.NONE, "")) == ["jupyter", "lab"]


def test_argv_user_tmp_and_devices() -> None:
    argv = build(ROOT_08, tmp=S / "tmp", devices=[Path("/dev/nvidia1")], user=(1000, 100))
    tail = argv[argv.index("--proc") :]
    assert tail == [
        "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm",
        "--dev-bind", "/dev/nvidia1", "/dev/nvidia1",
        "--bind", "/srv/s/tmp", "/tmp",
        "--perms", "0755", "--dir", "/home",
        "--perms", "0755", "--dir", "/envs",
        "--bind", "/home/ann", "/home/ann",
        "--bind", "/envs/ann", "/envs/ann",
        "--bind", "/data/shared", "/data",
        "--unshare-pid", "--die-with-parent", "--new-session",
        "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
        "--", "setpriv", "--reuid=1000", "--regid=100", "--clear-groups", "--", "jupyter", "lab",
    ]  # fmt: skip


def test_argv_userns_maps_the_caller_back() -> None:
    support = SandboxSupport(
        SandboxMode.OVERLAY_USERNS, "", bwrap="/bin/bwrap", unshare="/bin/unshare", uid=1000,
        gid=1000,
    )  # fmt: skip
    argv = build(support)
    assert argv[:6] == ["/bin/unshare", "-U", "-r", "-m", "--", "/bin/sh"]
    assert "userxattr" in argv[7] and "--make-rprivate" not in argv[7]
    bwrap_at = argv.index("/bin/bwrap")
    assert argv[bwrap_at : bwrap_at + 9] == [
        "/bin/bwrap", "--unshare-user", "--uid", "1000", "--gid", "1000",
        "--bind", "/srv/s/merged/usr", "/usr",
    ]  # fmt: skip


def test_argv_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="argv is empty"):
        build(ROOT_08, argv=[])
    with pytest.raises(ValueError, match="cannot carry"):
        build(ROOT_08, upper=Path("/srv/a,b/upper"))
    with pytest.raises(ValueError, match="absolute"):
        build(ROOT_08, work=Path("work"))
    user_support = SandboxSupport(SandboxMode.READONLY, "", bwrap="/bin/bwrap", uid=1000, gid=1000)
    with pytest.raises(ValueError, match="needs root"):
        build(user_support, user=(0, 0))
    # Asking for the user one already is needs nothing.
    assert "setpriv" not in build(user_support, user=(1000, 1000))
    with pytest.raises(ValueError, match="needs bwrap"):
        build(SandboxSupport(SandboxMode.READONLY, ""))


@pytest.mark.parametrize(
    ("version", "root", "unshare", "self_contained", "expected"),
    [
        ((0, 8, 0), True, True, True, ["overlay-mount", "readonly"]),
        ((0, 8, 0), False, True, True, ["overlay-userns", "readonly"]),
        ((0, 8, 0), True, False, True, ["readonly"]),
        ((0, 9, 0), True, True, True, ["overlay-bwrap", "overlay-mount", "readonly"]),
        ((0, 11, 0), False, True, False, ["overlay-userns", "overlay-bwrap", "readonly"]),
        (None, True, True, True, ["overlay-mount", "readonly"]),
    ],
)
def test_candidate_modes(
    version: tuple[int, ...] | None,
    root: bool,
    unshare: bool,
    self_contained: bool,
    expected: list[str],
) -> None:
    facts = SandboxSupport(
        SandboxMode.NONE,
        "",
        bwrap="/bin/bwrap",
        bwrap_version=version,
        unshare="/bin/unshare" if unshare else None,
        is_root=root,
    )
    assert [m.value for m in candidate_modes(facts, self_contained)] == expected
    assert candidate_modes(SandboxSupport(SandboxMode.NONE, ""), True) == [SandboxMode.NONE]


def test_argv_read_only_binds_come_last_and_pids_are_private() -> None:
    argv = build(ROOT_08, read_only=[(Path("/opt/base"), Path("/opt/base"))])
    tail = argv[argv.index("--bind", argv.index("--proc")) :]
    assert tail[: tail.index("--unshare-pid")][-3:] == ["--ro-bind", "/opt/base", "/opt/base"]
    assert "--unshare-pid" in argv
    assert "--unshare-pid" not in build(ROOT_08, share_pids=True)


def test_host_root_shows_symlinks_as_symlinks_and_skips_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "lib").symlink_to("usr/lib")
    (tmp_path / "secret").mkdir()
    assert host_root(("usr", "etc", "lib", "lib32"), root=tmp_path) == (
        RootEntry("usr"),
        RootEntry("etc"),
        RootEntry("lib", "usr/lib"),
    )
    assert [p.name for p in layer_dirs(tmp_path / "upper", host_root(root=tmp_path))] == [
        "usr",
        "etc",
    ]


def test_argv_stacks_lower_layers_above_the_hosts_directories() -> None:
    argv = build(ROOT_08, lowers=[Path("/jobs/7/env")])
    assert argv[argv.index("sh") + 1 : argv.index("sh") + 5] == [
        "/jobs/7/env/usr:/usr", "/srv/s/upper/usr", "/srv/s/work/usr", "/srv/s/merged/usr",
    ]  # fmt: skip
    native = SandboxSupport(
        SandboxMode.OVERLAY_BWRAP, "", bwrap="/bin/bwrap", bwrap_version=(0, 9, 0)
    )
    argv = build(native, lowers=[Path("/jobs/7/env")])
    assert argv[1:5] == ["--overlay-src", "/jobs/7/env/usr", "--overlay-src", "/usr"]
