"""Container filesystem changes against real overlay mounts, and the session sandbox for real.

Each test mounts its own overlay (lower, upper, work and merged directories in ``tmp_path``)
and unmounts it afterwards even when the test fails. The sandbox tests run real commands through
``sandbox_argv``: the host's /usr, /etc, /opt (and the rest of ``DEFAULT_ROOT``) are the lower
layers there, so they only delete what they created themselves, and check that the host is
unchanged. Root is needed (mounts).
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from gpufleet.snapshotter.baseline import diff_baseline, take_baseline
from gpufleet.snapshotter.errors import CaptureError
from gpufleet.snapshotter.overlay import Change, ChangeKind, read_upper
from gpufleet.snapshotter.sandbox import (
    SandboxMode,
    SandboxSupport,
    host_root,
    layer_dirs,
    probe,
    sandbox_argv,
)

PRESENT, DELETED, OPAQUE = ChangeKind.PRESENT, ChangeKind.DELETED, ChangeKind.OPAQUE


def _overlay_available() -> bool:
    try:
        return "overlay" in Path("/proc/filesystems").read_text()
    except OSError:
        return False


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="overlay mounts and the overlay sandbox need root here"
    ),
    pytest.mark.skipif(
        not _overlay_available(), reason="this kernel has no overlay file system (modprobe overlay)"
    ),
]


@dataclass(frozen=True)
class Overlay:
    lower: Path
    upper: Path
    work: Path
    merged: Path


class MountRefused(Exception):
    """The kernel refused the overlay mount (an option it does not support, a file system)."""


MakeOverlay = Callable[..., Overlay]


@pytest.fixture
def make_overlay(tmp_path: Path) -> Iterator[MakeOverlay]:
    """Mount overlays on demand: ``make_overlay(populate, options)``; all unmounted at the end."""
    mounted: list[Path] = []

    def make(populate: Callable[[Path], None], options: str = "", name: str = "ovl") -> Overlay:
        base = tmp_path / name
        o = Overlay(base / "lower", base / "upper", base / "work", base / "merged")
        for path in (o.lower, o.upper, o.work, o.merged):
            path.mkdir(parents=True)
        populate(o.lower)
        opts = f"lowerdir={o.lower},upperdir={o.upper},workdir={o.work}"
        if options:
            opts += "," + options
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(o.merged)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise MountRefused(done.stderr.strip() or f"mount exit status {done.returncode}")
        mounted.append(o.merged)
        return o

    try:
        yield make
    finally:
        for merged in reversed(mounted):
            if subprocess.run(["umount", str(merged)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(merged)], check=False)


def _mount_or_skip(make: MakeOverlay, populate: Callable[[Path], None], options: str) -> Overlay:
    try:
        return make(populate, options)
    except MountRefused as e:
        pytest.skip(f"this kernel refuses an overlay mounted with {options or 'defaults'}: {e}")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _lower_image(lower: Path) -> None:
    for rel in (
        "keep.txt",
        "modify.txt",
        "delete.txt",
        "mode.txt",
        "etc/conf",
        "etc/untouched",
        "tree/a/b.txt",
        "tree/c.txt",
        "recreate/old.txt",
    ):
        _write(lower / rel, f"lower {rel}\n")


def _new_dir_kind(upper: Path, rel: str, xattr: str = "trusted.overlay.opaque") -> ChangeKind:
    """How a directory created in a merged directory comes out.

    Kernels mark it opaque unless "offline changes" to the lower are allowed (no index,
    metacopy or redirects), and that policy changed across versions; it is the kernel's
    choice, so the expectation reads it back.
    """
    try:
        marked = os.getxattr(upper / rel, xattr) == b"y"
    except OSError:
        marked = False
    return OPAQUE if marked else PRESENT


def test_read_upper_reports_each_kind_of_change(make_overlay: MakeOverlay) -> None:
    o = _mount_or_skip(make_overlay, _lower_image, "")
    m = o.merged
    (m / "new.txt").write_text("new\n")
    (m / "newdir" / "inner").mkdir(parents=True)
    (m / "newdir" / "inner" / "f.txt").write_text("f\n")
    with (m / "modify.txt").open("a") as f:
        f.write("more\n")
    (m / "etc" / "conf").write_text("changed\n")
    (m / "delete.txt").unlink()
    shutil.rmtree(m / "tree")
    shutil.rmtree(m / "recreate")
    (m / "recreate").mkdir()
    (m / "recreate" / "new.txt").write_text("again\n")
    (m / "mode.txt").chmod(0o600)
    os.symlink("keep.txt", m / "link")
    os.mkfifo(m / "fifo")

    expected = [
        Change("delete.txt", DELETED),
        Change("etc", PRESENT),
        Change("etc/conf", PRESENT),
        Change("fifo", PRESENT),
        Change("link", PRESENT),
        Change("mode.txt", PRESENT),
        Change("modify.txt", PRESENT),
        Change("new.txt", PRESENT),
        Change("newdir", _new_dir_kind(o.upper, "newdir")),
        Change("newdir/inner", PRESENT),  # created inside a new directory: never opaque
        Change("newdir/inner/f.txt", PRESENT),
        Change("recreate", OPAQUE),  # created where a whiteout was: always opaque
        Change("recreate/new.txt", PRESENT),
        Change("tree", DELETED),  # the whole tree, once
    ]
    assert list(read_upper(o.upper, o.merged)) == expected
    # Mounted with the defaults here, the upper needs no merged view...
    assert list(read_upper(o.upper)) == expected
    subprocess.run(["umount", str(m)], check=True)
    # ...and reads the same once the mount is gone (a stopped session).
    assert list(read_upper(o.upper)) == expected
    assert stat.S_ISCHR(os.lstat(o.upper / "tree").st_mode)  # the kernel's whiteout, read as such


def test_userxattr_mount(make_overlay: MakeOverlay) -> None:
    o = _mount_or_skip(make_overlay, _lower_image, "userxattr")
    m = o.merged
    (m / "delete.txt").unlink()
    shutil.rmtree(m / "recreate")
    (m / "recreate").mkdir()
    (m / "etc" / "conf").write_text("changed\n")
    assert os.getxattr(o.upper / "recreate", "user.overlay.opaque") == b"y"
    assert list(read_upper(o.upper, o.merged)) == [
        Change("delete.txt", DELETED),
        Change("etc", PRESENT),
        Change("etc/conf", PRESENT),
        Change("recreate", OPAQUE),
    ]


def _renames_lower(lower: Path) -> None:
    for rel in ("d/keep", "d/gone", "d/sub/deep", "e/x", "top"):
        _write(lower / rel, f"lower {rel}\n")


def test_renamed_directories_come_whole_from_merged(make_overlay: MakeOverlay) -> None:
    o = _mount_or_skip(make_overlay, _renames_lower, "redirect_dir=on")
    m = o.merged
    os.rename(m / "d", m / "d2")  # a lower directory renamed in place
    (m / "d2" / "gone").unlink()
    (m / "d2" / "added").write_text("new\n")
    (m / "nd").mkdir()
    os.rename(m / "e", m / "nd" / "e2")  # moved into another directory: absolute redirect
    if not any(n.startswith("trusted.overlay.redirect") for n in os.listxattr(o.upper / "d2")):
        pytest.skip("the kernel renamed the directory without a redirect (copied it up)")

    assert list(read_upper(o.upper, o.merged)) == [
        Change("d", DELETED),  # the kernel's whiteout at the old path
        Change("d2", OPAQUE),
        Change("d2/added", PRESENT),
        Change("d2/keep", PRESENT),  # from the lower, read through merged
        Change("d2/sub", PRESENT),
        Change("d2/sub/deep", PRESENT),
        Change("e", DELETED),
        Change("nd", _new_dir_kind(o.upper, "nd")),
        Change("nd/e2", OPAQUE),
        Change("nd/e2/x", PRESENT),
    ]
    assert (m / "d2" / "keep").read_text() == "lower d/keep\n"
    with pytest.raises(CaptureError, match="renamed directory"):
        list(read_upper(o.upper))


def _big_lower(lower: Path) -> None:
    _write(lower / "big.bin", "data" * 4096)
    _write(lower / "other.bin", "other" * 100)


def test_metacopy_files_are_read_through_merged(make_overlay: MakeOverlay) -> None:
    o = _mount_or_skip(make_overlay, _big_lower, "redirect_dir=on,metacopy=on")
    m = o.merged
    (m / "big.bin").chmod(0o600)  # metadata only: the data stays below
    os.rename(m / "other.bin", m / "renamed.bin")
    if "trusted.overlay.metacopy" not in os.listxattr(o.upper / "big.bin"):
        pytest.skip("the kernel copied the data up despite metacopy=on")
    assert (o.upper / "big.bin").read_bytes() != b"data" * 4096  # the data is not in the upper

    assert list(read_upper(o.upper, o.merged)) == [
        Change("big.bin", PRESENT),
        Change("other.bin", DELETED),
        Change("renamed.bin", PRESENT),
    ]
    assert (m / "big.bin").read_text() == "data" * 4096  # what the capture reads
    assert (m / "renamed.bin").read_text() == "other" * 100
    with pytest.raises(CaptureError, match="metadata-only copy"):
        list(read_upper(o.upper))


def test_baseline_skips_mount_points(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for rel in ("etc/hosts", "data/old", "usr/bin/tool"):
        _write(root / rel, rel)
    baseline = take_baseline(root)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "volume", str(root / "data")], check=True
    )
    try:
        (root / "data" / "file").write_text("on the volume")
        assert list(diff_baseline(baseline, root)) == []  # neither deleted nor walked
        assert take_baseline(root).get("data") is None
        assert list(diff_baseline(baseline, root, cross_filesystems=True)) == [
            Change("data", PRESENT),  # the volume's root, not the image's directory
            Change("data/file", PRESENT),
            Change("data/old", DELETED),
        ]
    finally:
        subprocess.run(["umount", str(root / "data")], check=True)


# --------------------------------------------------------------------------- sandbox
@pytest.fixture
def support(tmp_path: Path) -> SandboxSupport:
    found = probe(tmp_path)
    if found.bwrap is None:
        pytest.skip(f"no bubblewrap here: {found.reason}")
    if not found.overlay:
        pytest.skip(f"no overlay sandbox on this machine: {found.reason}")
    return found


@dataclass(frozen=True)
class SessionDirs:
    upper: Path
    work: Path
    merged: Path
    home: Path


ROOT = host_root()
LAYERS = {entry.name for entry in ROOT if entry.link is None}


def _make_session_dirs(base: Path) -> SessionDirs:
    dirs = SessionDirs(*(base / n for n in ("upper", "work", "merged", "home")))
    for path in (dirs.upper, dirs.work, dirs.merged, dirs.home):
        path.mkdir(parents=True)
        if path != dirs.home:
            for layer in layer_dirs(path, ROOT):
                layer.mkdir()
    return dirs


def _changed(upper: Path) -> list[Change]:
    """What the sandbox changed in ``upper``: its changes without the bare layer directories
    (``usr``, ``etc``, ...) that hold them."""
    return [c for c in read_upper(upper) if not (c.path in LAYERS and c.kind is PRESENT)]


@pytest.fixture
def session(tmp_path: Path) -> SessionDirs:
    return _make_session_dirs(tmp_path / "session")


@pytest.fixture
def host_victim() -> Iterator[Path]:
    """A file in one of the host's directories the sandbox overlays (/opt), made for the test
    and removed afterwards."""
    where = Path("/opt") / f"gpufleet-sandbox-test-{secrets.token_hex(6)}"
    where.mkdir()
    victim = where / "victim.txt"
    victim.write_text("still here\n")
    try:
        yield victim
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL
    )


def _ancestors_made_for_binds(changes: list[Change], *binds: Path) -> list[Change]:
    """The changes without the mount-point directories bwrap creates for binds outside /tmp."""
    made = {str(p.relative_to("/")) for b in binds for p in b.parents if p != Path("/")}
    made |= {str(b.relative_to("/")) for b in binds}
    return [c for c in changes if not (c.kind is not DELETED and c.path in made)]


def test_sandbox_changes_land_in_the_upper_only(
    support: SandboxSupport, session: SessionDirs, host_victim: Path
) -> None:
    marker = Path("/etc") / f"gpufleet-test-{secrets.token_hex(6)}"
    script = f'echo x > {marker} && rm {host_victim} && echo home > "$0/h.txt" && id -u'
    argv = sandbox_argv(
        support,
        upper=session.upper,
        work=session.work,
        merged=session.merged,
        home=session.home,
        binds=(),
        env_prefix=None,
        root=ROOT,
        argv=["/bin/sh", "-c", script, str(session.home)],
    )
    done = _run(argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"

    assert not marker.exists()  # the host is unchanged
    assert host_victim.read_text() == "still here\n"
    assert (session.home / "h.txt").read_text() == "home\n"  # the home is the host's, writable

    victim_rel = host_victim.relative_to("/")
    changes = _ancestors_made_for_binds(_changed(session.upper), session.home)
    assert changes == [
        Change(f"etc/{marker.name}", PRESENT),
        Change(str(victim_rel.parent), PRESENT),
        Change(str(victim_rel), DELETED),
    ]
    assert (session.upper / "etc" / marker.name).read_text() == "x\n"


def test_sandbox_runs_as_another_user(support: SandboxSupport) -> None:
    # The user must be able to reach its home: pytest's own temporary tree is root's only.
    base = Path(tempfile.mkdtemp(prefix="gpufleet-sandbox-user-"))
    try:
        base.chmod(0o755)
        session = _make_session_dirs(base)
        os.chown(session.home, 65534, 65534)
        script = 'id -u > "$0/uid" && if touch /etc/not-allowed; then exit 3; fi'
        argv = sandbox_argv(
            support,
            upper=session.upper,
            work=session.work,
            merged=session.merged,
            home=session.home,
            binds=(),
            env_prefix=None,
            root=ROOT,
            argv=["/bin/sh", "-c", script, str(session.home)],
            user=(65534, 65534),
        )
        done = _run(argv)
        assert done.returncode == 0, done.stderr
        assert (session.home / "uid").read_text() == "65534\n"
        assert "Permission denied" in done.stderr  # an ordinary user's rights on /etc
        assert _changed(session.upper) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_killing_the_sandbox_kills_its_whole_tree(
    support: SandboxSupport, session: SessionDirs
) -> None:
    argv = sandbox_argv(
        support,
        upper=session.upper,
        work=session.work,
        merged=session.merged,
        home=session.home,
        binds=(),
        env_prefix=None,
        root=ROOT,
        argv=["/bin/sh", "-c", "sleep 1000 & echo $!; wait"],
    )
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        inner_pid = int(proc.stdout.readline())  # the background child exists once this is read
        grandchild = _host_pid(inner_pid, below=proc.pid)
        pidfd = os.pidfd_open(grandchild)
        proc.send_signal(signal.SIGKILL)  # the process the spawner started, nothing else
        proc.wait(timeout=30)
        readable, _, _ = select.select([pidfd], [], [], 30)
        os.close(pidfd)
        assert readable, "the grandchild outlived the sandbox"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _host_pid(inner_pid: int, below: int) -> int:
    """The host pid of the process that is ``inner_pid`` in a pid namespace under ``below``."""
    found = []
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        if _status(pid).get("NSpid", "").split()[1:][-1:] != [str(inner_pid)]:
            continue  # not in a nested pid namespace as inner_pid
        ancestor = pid
        while ancestor > 1 and ancestor != below:
            ancestor = int(_status(ancestor).get("PPid", "0"))
        if ancestor == below:
            found.append(pid)
    assert len(found) == 1, f"expected one process {inner_pid} in the sandbox, found {found}"
    return found[0]


def test_readonly_fallback_keeps_the_home_writable(
    support: SandboxSupport, session: SessionDirs, tmp_path: Path
) -> None:
    readonly = replace(support, mode=SandboxMode.READONLY)
    prefix = tmp_path / "env"
    prefix.mkdir()
    marker = Path("/etc") / f"gpufleet-test-{secrets.token_hex(6)}"
    script = (
        'echo home > "$0/h.txt" && echo env > "$1/e.txt" && '
        f"if echo x > {marker} 2>/dev/null; then echo wrote-host; else echo refused; fi"
    )
    argv = sandbox_argv(
        readonly,
        upper=session.upper,
        work=session.work,
        merged=session.merged,
        home=session.home,
        binds=(),
        env_prefix=prefix,
        root=ROOT,
        argv=["/bin/sh", "-c", script, str(session.home), str(prefix)],
    )
    done = _run(argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"
    assert not marker.exists()
    assert (session.home / "h.txt").read_text() == "home\n"
    assert (prefix / "e.txt").read_text() == "env\n"
    assert _changed(session.upper) == []  # no overlay: nothing to snapshot there

    plain = sandbox_argv(
        replace(support, mode=SandboxMode.NONE),
        upper=session.upper,
        work=session.work,
        merged=session.merged,
        home=session.home,
        binds=(),
        env_prefix=prefix,
        root=ROOT,
        argv=["/bin/sh", "-c", 'echo plain > "$0/p.txt"', str(session.home)],
    )
    assert plain[0] == "/bin/sh"
    assert _run(plain).returncode == 0
    assert (session.home / "p.txt").read_text() == "plain\n"
