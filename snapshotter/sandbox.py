"""The local backend's session sandbox: a bubblewrap sandbox whose root is an overlay on the host.

On one machine a session is a local process. Where the machine allows, it runs in a bubblewrap
(``bwrap``) sandbox whose ``/`` is an overlay: the host's root file system read below, and the
session's own upper directory written above. Whatever the session changes outside its home and
environment prefix (``apt``/``pip`` into system paths, ``/etc``) lands in that upper directory
and nowhere else, and the snapshotter reads it with :func:`.overlay.read_upper` as it reads a
container's changes on Kubernetes. The host is never changed.

The modes, best first (:class:`SandboxMode`), as :func:`probe` finds this machine:

``overlay-bwrap``
    bubblewrap 0.9 or newer mounts the overlay itself (``--overlay-src / --overlay UPPER WORK
    /``). Chosen first only when the kernel's defaults leave ``redirect_dir`` and ``metacopy``
    off (bwrap does not take mount options), so the upper stays self-contained; otherwise it
    comes after the ``unshare`` modes.
``overlay-mount``
    As root with bubblewrap 0.8 (no ``--overlay``): ``unshare -m`` makes a private mount
    namespace, ``mount -t overlay`` builds the root at ``merged`` (lower ``/``, the session's
    upper and work directories, ``redirect_dir=off,metacopy=off,index=off``), and ``bwrap --bind
    merged /`` runs the session in it. The mount lives only in that namespace: it is gone, and
    nothing is left on the host, when the last process of the session exits.
``overlay-userns``
    The same without root, in a user namespace (``unshare -U -r -m``, ``userxattr``, bwrap
    maps the caller's uid back). Most kernels refuse it with the host's ``/`` as lower ("failed
    to clone lowerpath": the root has mounts locked under it), so :func:`probe` rarely finds
    it; where it works, the session can change only what its user could change on the host.
``readonly``
    No overlay is possible, but bwrap runs: the host's root read-only, the home, the
    environment prefix and the given binds writable. Changes outside them fail (EROFS) rather
    than touch the host; there is no upper directory to snapshot.
``none``
    bwrap cannot run here (missing, or no namespaces allowed): the command runs as is, with
    its own home and environment prefix only. :attr:`SandboxSupport.reason` says why, for the
    log.

What every sandbox keeps visible: a new ``/proc`` (of the sandbox's own pid namespace), a
minimal ``/dev`` with a writable ``/dev/shm`` tmpfs (data loaders need it), the GPU device nodes
(``/dev/nvidia*``, ``/dev/nvidia-caps``), ``/sys`` read-only, a private ``/tmp`` (a tmpfs, or the
session's own ``tmp`` directory), the home, the environment prefix and the given binds, all at
the same paths as on the host. Missing parents of those mount points are made with mode 0755
(bwrap started as root would make them 0700, closed to a session run as another user). The
overlay root holds the host's root file system only: other mounts (a separate ``/home``,
``/data``, ``/run``) appear as their empty mount points unless passed in ``binds``. The rest
of the host's root file system is readable as it is outside the sandbox (this sandbox keeps
the host unchanged; it is no confinement of what a session may read).

The process tree is one unit: ``--unshare-pid`` makes bwrap's child the init of a new pid
namespace, so when it dies the kernel kills everything else in the sandbox;
``--die-with-parent`` kills that init when bwrap dies; ``--new-session`` puts the command in a
session of its own, away from the hub's terminal. Killing the process that was started (it is
bwrap, or ``unshare`` that execs into it) ends the whole session.

Capabilities: bwrap started as root drops every capability in the sandbox; the command still
runs as uid 0 unless ``user`` is given, in which case bwrap keeps only CAP_SETUID/CAP_SETGID and
``setpriv`` switches to that user (without supplementary groups) before the command runs.

:func:`sandbox_argv` is pure (it builds the command line from a :class:`SandboxSupport`);
:func:`probe` does the I/O: it finds bwrap and its version, then really runs each candidate mode
once in a scratch directory (a file written to ``/`` must land in the upper directory and not on
the host), and caches the answer per scratch directory.
"""

from __future__ import annotations

import enum
import functools
import glob
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "DEFAULT_ROOT",
    "DEFAULT_SESSION_PREFIX",
    "RootEntry",
    "SandboxDirs",
    "SandboxMode",
    "SandboxSupport",
    "candidate_modes",
    "checkout_session_env",
    "default_session_env",
    "host_root",
    "identity_files",
    "layer_dirs",
    "owned_prefix",
    "prepare_dirs",
    "probe",
    "remove_tree",
    "sandbox_argv",
    "write_identity",
]

log = logging.getLogger(__name__)

_OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off"
# Groups of four arguments (lower, upper, work, merged), one per overlay, then "--", then
# the bwrap command line. Paths are passed as arguments, never pasted into the script, so
# no quoting can go wrong.
_MOUNT_SCRIPT = (
    "mount --make-rprivate / && "
    'while [ "$1" != -- ]; do '
    'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3,{options}" "$4" '
    "|| exit 1; shift 4; done; "
    'shift && exec "$@"'
)
# What of the host's root a sandbox shows (anything else of it is not there at all): the
# system's programs, libraries and configuration, and /opt, where the sessions' base
# environment lives. The hub's data directory, its secrets, its checkout, /root, /home and
# /var are absent; a session's own home and environment are bound in on their own.
DEFAULT_ROOT = ("usr", "etc", "opt", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Where sessions and ranks run from, and where, inside their sandbox, their own environment
# lives (the spawner's and the agent's defaults must agree).
DEFAULT_SESSION_PREFIX = "/opt/gpufleet/env"


def default_session_env() -> str:
    """The sessions' base environment (scripts/build-session-env makes it):
    $GPUFLEET_SESSION_ENV; else, for gpufleet installed editable from a checkout, that
    checkout's own (``checkout_session_env``), so two checkouts on one machine never run
    their sessions from one environment; else /opt/gpufleet/session-env."""
    named = os.environ.get("GPUFLEET_SESSION_ENV")
    if named:
        return named
    checkout = _editable_checkout()
    if checkout is not None:
        return checkout_session_env(checkout)
    return "/opt/gpufleet/session-env"


def checkout_session_env(checkout: Path) -> str:
    """A checkout's own sessions' environment: where its ``.tools/session-env`` points
    (scripts/build-session-env makes the link once the environment is whole), resolved,
    because a sandbox binds the environment at its real path; the link's own path while
    there is none yet, so what is missing is named."""
    return os.path.realpath(checkout / ".tools" / "session-env")


@functools.cache
def _editable_checkout() -> Path | None:
    """The checkout this module runs from in a development (editable) install, or None for
    a regular install, whose files lie in site-packages: found from the module's own file
    (a strict editable install links it from the checkout's ``snapshotter/``)."""
    checkout = Path(__file__).resolve().parents[1]
    return checkout if (checkout / "pyproject.toml").is_file() else None


@dataclass(frozen=True)
class RootEntry:
    """One top-level entry of the host's root that a sandbox shows: a directory (an overlay
    layer, or read-only without an overlay) or, where the host has a symlink (``/lib ->
    usr/lib`` on a merged-/usr system), the same symlink."""

    name: str
    link: str | None = None

    @property
    def path(self) -> str:
        return "/" + self.name


def host_root(names: Sequence[str] = DEFAULT_ROOT, root: Path = Path("/")) -> tuple[RootEntry, ...]:
    """The entries of ``names`` the host has, as directories or symlinks. Blocking."""
    found = []
    for name in names:
        path = root / name
        if path.is_symlink():
            found.append(RootEntry(name, os.readlink(path)))
        elif path.is_dir():
            found.append(RootEntry(name))
    return tuple(found)


def layer_dirs(directory: Path, root: Sequence[RootEntry]) -> list[Path]:
    """Where each directory entry of ``root`` has its part of an overlay's upper, work or
    merged directory ``directory``: ``directory/usr``, ``directory/etc``, ... So an upper
    directory holds ``usr/...``, ``etc/...`` as an overlay on the whole root would."""
    return [directory / entry.name for entry in root if entry.link is None]


_PROBE_TIMEOUT_S = 30


class SandboxMode(enum.StrEnum):
    """How sessions are sandboxed on this machine, best first (see the module docstring)."""

    OVERLAY_BWRAP = "overlay-bwrap"
    OVERLAY_MOUNT = "overlay-mount"
    OVERLAY_USERNS = "overlay-userns"
    READONLY = "readonly"
    NONE = "none"


_OVERLAY_MODES = frozenset(
    {SandboxMode.OVERLAY_BWRAP, SandboxMode.OVERLAY_MOUNT, SandboxMode.OVERLAY_USERNS}
)


@dataclass(frozen=True)
class SandboxSupport:
    """What this machine can do for session sandboxes, as :func:`probe` found it.

    ``reason`` says why this mode and not a better one, in words for the log. ``uid``/``gid``
    are the caller's (the userns mode maps them into the sandbox). ``upper_self_contained`` is
    True when an upper directory written in this mode can be read without its merged view
    (no redirects, no metacopy), as :func:`.overlay.read_upper` needs once the session is gone.
    """

    mode: SandboxMode
    reason: str
    bwrap: str | None = None
    bwrap_version: tuple[int, ...] | None = None
    unshare: str | None = None
    is_root: bool = False
    uid: int = 0
    gid: int = 0
    gpu_devices: tuple[str, ...] = ()
    upper_self_contained: bool = True

    @property
    def overlay(self) -> bool:
        """Whether sessions get an overlay root (their changes land in an upper directory)."""
        return self.mode in _OVERLAY_MODES


# ------------------------------------------------------------------ the command line (pure)
def _check_overlay_path(name: str, path: Path) -> str:
    text = str(path)
    if not path.is_absolute():
        raise ValueError(f"sandbox {name} must be an absolute path, got {text!r}")
    if any(c in text for c in ",:\\"):
        raise ValueError(
            f"sandbox {name} {text!r} contains ',', ':' or '\\', which overlay mount options "
            "cannot carry; choose a state directory without them"
        )
    return text


def _as_user(argv: Sequence[str], user: tuple[int, int] | None) -> list[str]:
    if user is None:
        return list(argv)
    uid, gid = user
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]


def _parents(destinations: Sequence[Path]) -> list[str]:
    """Every ancestor of the destinations but ``/``, parents first, each once.

    bwrap started as root creates missing mount-point parents with mode 0700, which a session
    run as another user cannot cross; ``--dir`` with ``--perms 0755`` creates them traversable
    first (and leaves a directory that exists as it is).
    """
    seen: dict[str, None] = {}
    for destination in destinations:
        for parent in reversed(destination.parents):
            if parent != Path("/"):
                seen.setdefault(str(parent))
    return list(seen)


def sandbox_argv(
    support: SandboxSupport,
    *,
    upper: Path,
    work: Path,
    merged: Path,
    home: Path,
    binds: Sequence[tuple[Path, Path]],
    env_prefix: Path | None,
    argv: Sequence[str],
    root: Sequence[RootEntry],
    tmp: Path | None = None,
    devices: Sequence[Path] | None = None,
    user: tuple[int, int] | None = None,
    read_only: Sequence[tuple[Path, Path]] = (),
    share_pids: bool = False,
    lowers: Sequence[Path] = (),
    chdir: Path | None = None,
) -> list[str]:
    """The command line that runs ``argv`` in a session sandbox of ``support.mode``.

    The sandbox's ``/`` is empty but for ``root`` (:func:`host_root`): each directory of it
    an overlay layer (its parts of ``upper``, ``work`` and ``merged``, :func:`layer_dirs`,
    must exist, ``work``'s empty, on the file system of ``upper``; ``merged``'s are mount
    points), or read-only without an overlay. ``home``, ``env_prefix`` and each ``(source,
    destination)`` of ``binds`` are bound read-write, then each of ``read_only`` read-only
    (over what is already there: the sessions' base environment, a passwd file). ``tmp``,
    when given, is bound at ``/tmp``; otherwise ``/tmp`` is a fresh tmpfs. ``devices``
    replaces the GPU device nodes :func:`probe` found. ``user`` = ``(uid, gid)`` runs the
    command as that user (root only). ``share_pids`` keeps the caller's pid namespace (the
    sandbox's processes are then not alone: only for a caller that needs to find them by
    pid, never for a researcher's processes). ``lowers``: read-only layers stacked above the
    host's directories in the overlay modes, topmost first (``<lower>/usr`` over ``/usr``;
    each must exist): a job's copy of its session's upper directory. ``chdir``: where the
    command starts (inside the sandbox). In mode ``none`` the result is ``argv``
    itself (behind ``setpriv`` when ``user`` is given).

    Pure: reads nothing, creates nothing. Raises ``ValueError`` for an empty ``argv``, for
    paths the overlay mount options cannot carry, or for ``user`` where bwrap is not root.
    """
    if not argv:
        raise ValueError("sandbox_argv needs a command to run (argv is empty)")
    user = _switched_user(support, user)
    if support.mode is SandboxMode.NONE:
        return _as_user(argv, user)
    prefix, root_args = _root_args(support, root, (upper, work, merged), lowers)
    args = [*prefix, *root_args, "--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--tmpfs", "/dev/shm"]
    for device in devices if devices is not None else support.gpu_devices:
        args += ["--dev-bind", str(device), str(device)]
    args += (
        ["--bind", str(tmp), "/tmp"] if tmp is not None else ["--perms", "1777", "--tmpfs", "/tmp"]
    )
    mounts = [(home, home)]
    if env_prefix is not None:
        mounts.append((env_prefix, env_prefix))
    args += _bind_args([*mounts, *binds], read_only)
    if not share_pids:
        args.append("--unshare-pid")
    if chdir is not None:
        args += ["--chdir", str(chdir)]
    args += ["--die-with-parent", "--new-session"]
    if user is not None and support.is_root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*args, "--", *_as_user(argv, user)]


def _switched_user(support: SandboxSupport, user: tuple[int, int] | None) -> tuple[int, int] | None:
    """The user to switch to in the sandbox: None when that is the caller already.
    ValueError when switching needs root and the caller is not."""
    if user == (support.uid, support.gid):
        return None
    if user is not None and not support.is_root:
        raise ValueError(
            f"cannot run the session as uid/gid {user}: switching users needs root, and this "
            f"process runs as {support.uid}/{support.gid}"
        )
    return user


def _root_args(
    support: SandboxSupport,
    root: Sequence[RootEntry],
    dirs: tuple[Path, Path, Path],
    lowers: Sequence[Path],
) -> tuple[list[str], list[str]]:
    """What makes the sandbox's ``/``: the command that runs before bwrap (the mount
    script of the ``unshare`` modes; empty otherwise) and bwrap with its root's
    arguments. ``dirs``: the upper, work and merged directories."""
    mode = support.mode
    bwrap = support.bwrap
    if bwrap is None:
        raise ValueError(f"sandbox mode {mode.value} needs bwrap, and the support names none")
    prefix: list[str] = []
    root_args: list[str] = [bwrap]
    layers = [entry for entry in root if entry.link is None]
    if mode in _OVERLAY_MODES:
        names = ("upper directory", "work directory", "merged directory")
        paths = [_check_overlay_path(name, path) for name, path in zip(names, dirs, strict=True)]
        stacked = [_check_overlay_path("lower layer", lower) for lower in lowers]
        if mode is SandboxMode.OVERLAY_BWRAP:
            for entry in layers:
                for lower in stacked:
                    root_args += ["--overlay-src", f"{lower}/{entry.name}"]
                root_args += ["--overlay-src", entry.path, "--overlay"]
                root_args += [f"{paths[0]}/{entry.name}", f"{paths[1]}/{entry.name}", entry.path]
        else:
            prefix = _mount_script(support, layers, paths, stacked)
            if mode is SandboxMode.OVERLAY_USERNS:
                root_args += ["--unshare-user", "--uid", str(support.uid)]
                root_args += ["--gid", str(support.gid)]
            for entry in layers:
                root_args += ["--bind", f"{paths[2]}/{entry.name}", entry.path]
    else:  # READONLY
        for entry in layers:
            root_args += ["--ro-bind", entry.path, entry.path]
    for entry in root:
        if entry.link is not None:
            root_args += ["--symlink", entry.link, entry.path]
    root_args += ["--ro-bind", "/sys", "/sys"]
    return prefix, root_args


def _mount_script(
    support: SandboxSupport, layers: Sequence[RootEntry], paths: list[str], stacked: list[str]
) -> list[str]:
    """The ``unshare`` command that mounts each layer's overlay at its part of the merged
    directory and then runs bwrap (``overlay-mount``, ``overlay-userns``)."""
    groups = [
        [
            ":".join([*(f"{lower}/{entry.name}" for lower in stacked), entry.path]),
            *(f"{path}/{entry.name}" for path in paths),
        ]
        for entry in layers
    ]
    unshare = support.unshare or "unshare"
    if support.mode is SandboxMode.OVERLAY_MOUNT:
        script = _MOUNT_SCRIPT.format(options=_OVERLAY_OPTIONS)
        prefix = [unshare, "-m", "--", "/bin/sh", "-c", script]
    else:  # OVERLAY_USERNS: userxattr implies no redirects and no metacopy
        script = _MOUNT_SCRIPT.format(options="userxattr").removeprefix(
            "mount --make-rprivate / && "
        )
        prefix = [unshare, "-U", "-r", "-m", "--", "/bin/sh", "-c", script]
    return [*prefix, "sh", *(arg for group in groups for arg in group), "--"]


def _bind_args(
    mounts: Sequence[tuple[Path, Path]], read_only: Sequence[tuple[Path, Path]]
) -> list[str]:
    """Bind each ``(source, destination)`` of ``mounts`` read-write, then each of
    ``read_only`` read-only, their missing parents made traversable first."""
    args: list[str] = []
    for parent in _parents([destination for _, destination in [*mounts, *read_only]]):
        args += ["--perms", "0755", "--dir", parent]
    for source, destination in mounts:
        args += ["--bind", str(source), str(destination)]
    for source, destination in read_only:
        args += ["--ro-bind", str(source), str(destination)]
    return args


def identity_files(
    name: str, uid: int, gid: int, home: Path, etc: Path = Path("/etc")
) -> dict[str, str]:
    """The host's passwd and group files with an entry for ``name`` (``uid``/``gid``, a
    group of its own) in place of any of that name or number: what a sandbox binds over
    ``/etc/passwd`` and ``/etc/group`` for a user the host has no account for, so that
    programs that look the user up (``whoami``, ``~``, pip's cache) find them. Blocking."""
    entries = {
        "passwd": f"{name}:x:{uid}:{gid}:gpufleet user {name}:{home}:/bin/bash",
        "group": f"{name}:x:{gid}:",
    }
    files = {}
    for file, entry in entries.items():
        number = str(uid if file == "passwd" else gid)
        kept = [
            line
            for line in (etc / file).read_text().splitlines()
            if line.split(":", 1)[0] != name and line.split(":")[2:3] != [number]
        ]
        files[file] = "\n".join([*kept, entry]) + "\n"
    return files


# ------------------------------------------------------------ directories (I/O, blocking)
@dataclass(frozen=True)
class SandboxDirs:
    """One sandbox's directories on the host: ``upper`` (its container state: what it
    changed in the root's directories; kept across starts), ``work`` and ``merged`` (the
    overlay's scratch and mount points: renewed at each start), ``tmp`` (its /tmp:
    emptied at each start)."""

    root: Path

    @property
    def upper(self) -> Path:
        return self.root / "upper"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"


def prepare_dirs(dirs: SandboxDirs, overlay: bool, root: Sequence[RootEntry]) -> None:
    """Make a sandbox's directories for a start: keep ``upper``, renew the others (only
    ``tmp`` without ``overlay``), each with a layer per directory of ``root``.

    A layer of ``upper`` (``upper/usr``) covers the host's directory of that name, so it
    gets that directory's mode and owner (a layer only root may enter would shut the
    sandbox's user out of it). Raises ``OSError`` (a mount point that is not empty: is an
    earlier start still running?)."""
    dirs.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    remove_tree(dirs.tmp)
    dirs.tmp.mkdir(mode=0o700)
    os.chmod(dirs.tmp, 0o1777)
    if not overlay:
        return
    dirs.upper.mkdir(mode=0o755, exist_ok=True)
    for layer in layer_dirs(dirs.upper, root):
        if not layer.is_dir():
            _mkdir_as(layer, Path("/") / layer.name)
    remove_tree(dirs.work)
    dirs.work.mkdir(mode=0o700)
    for layer in layer_dirs(dirs.work, root):
        layer.mkdir(mode=0o700)
    if dirs.merged.exists():
        try:
            # never rmtree: they must be empty, unmounted directories
            for mount_point in dirs.merged.iterdir():
                mount_point.rmdir()
            dirs.merged.rmdir()
        except OSError as e:
            raise OSError(
                e.errno,
                f"{dirs.merged} should hold only empty mount points and does not "
                f"({e.strerror}); is something of an earlier start still running?",
            ) from e
    dirs.merged.mkdir(mode=0o700)
    for layer in layer_dirs(dirs.merged, root):
        layer.mkdir(mode=0o700)


def owned_prefix(upper: Path, prefix: Path, uid: int, gid: int) -> Path:
    """``prefix``'s place in ``upper``, a directory of the user's, its parents made as the
    host's directories they cover are (mode and owner): where a sandbox's own environment
    is written, inside its container state."""
    current = upper
    for part in prefix.relative_to("/").parts[:-1]:
        current = current / part
        if not current.is_dir():
            _mkdir_as(current, Path("/") / current.relative_to(upper))
    target = upper / prefix.relative_to("/")
    target.mkdir(mode=0o755, exist_ok=True)
    if os.geteuid() == 0 and (target.lstat().st_uid, target.lstat().st_gid) != (uid, gid):
        os.chown(target, uid, gid, follow_symlinks=False)
    return target


def _mkdir_as(path: Path, like: Path) -> None:
    """Make the directory ``path`` with the mode and owner of the host's ``like`` (0755 and
    the caller's where the host has none)."""
    path.mkdir(mode=0o755)
    try:
        info = like.stat()
    except FileNotFoundError:
        return
    if os.geteuid() == 0:
        os.chown(path, info.st_uid, info.st_gid)
    os.chmod(path, stat.S_IMODE(info.st_mode))


def write_identity(
    directory: Path, name: str, uid: int, gid: int, home: Path
) -> list[tuple[Path, Path]]:
    """:func:`identity_files` written into ``directory`` (mode 0644), as ``(file,
    /etc/...)`` pairs to bind read-only into the sandbox."""
    pairs = []
    for file, text in identity_files(name, uid, gid, home).items():
        target = directory / file
        target.write_text(text)
        target.chmod(0o644)
        pairs.append((target, Path("/etc") / file))
    return pairs


def remove_tree(path: Path) -> None:
    """Remove a tree that may hold an overlay's work directories (left with mode 000)."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path)


# ------------------------------------------------------------------------- probing (I/O)
_cache: dict[str, SandboxSupport] = {}
_cache_lock = threading.Lock()


def probe(scratch: Path | None = None, *, refresh: bool = False) -> SandboxSupport:
    """What this machine can do, found by really trying each mode once; cached per ``scratch``.

    ``scratch`` is a directory on the file system where session upper directories will live
    (the overlay's upper must support the overlay's xattrs there); the trial runs in a
    temporary directory under it, removed afterwards. Default: the system's temporary
    directory. Logs the outcome once per probe: INFO with an overlay, WARNING without.
    """
    base = str(scratch if scratch is not None else Path(tempfile.gettempdir()))
    with _cache_lock:
        if not refresh and base in _cache:
            return _cache[base]
        support = _probe(Path(base))
        _cache[base] = support
    level = logging.INFO if support.overlay else logging.WARNING
    log.log(level, "session sandbox: %s (%s)", support.mode.value, support.reason)
    return support


def _bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def _kernel_defaults_self_contained() -> bool:
    """Whether overlay mounts default to no redirects and no metacopy (module parameters)."""
    params = Path("/sys/module/overlay/parameters")
    try:
        redirect = (params / "redirect_dir").read_text().strip()
        metacopy = (params / "metacopy").read_text().strip()
    except OSError:
        return False  # not loaded yet, or hidden: do not count on it
    return redirect in ("N", "n", "0") and metacopy in ("N", "n", "0")


def candidate_modes(support: SandboxSupport, kernel_self_contained: bool) -> list[SandboxMode]:
    """The modes worth trying on a machine with these facts, best first (pure).

    ``support`` carries the facts (bwrap and its version, unshare, root); its mode is ignored.
    ``kernel_self_contained``: overlay mounts default to ``redirect_dir`` and ``metacopy`` off.
    Without bwrap, only ``none`` is left.
    """
    if support.bwrap is None:
        return [SandboxMode.NONE]
    self_contained = kernel_self_contained
    version = support.bwrap_version or (0,)
    native = version >= (0, 9)
    modes: list[SandboxMode] = []
    if native and self_contained:
        modes.append(SandboxMode.OVERLAY_BWRAP)
    if support.unshare is not None:
        modes.append(SandboxMode.OVERLAY_MOUNT if support.is_root else SandboxMode.OVERLAY_USERNS)
    if native and not self_contained:
        modes.append(SandboxMode.OVERLAY_BWRAP)
    modes.append(SandboxMode.READONLY)
    return modes


def _probe(base: Path) -> SandboxSupport:
    uid, gid = os.getuid(), os.getgid()
    devices = tuple(sorted(glob.glob("/dev/nvidia*")))
    facts = SandboxSupport(
        SandboxMode.NONE, "", is_root=os.geteuid() == 0, uid=uid, gid=gid, gpu_devices=devices
    )
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return replace(facts, reason="bwrap (bubblewrap) is not installed")
    facts = replace(
        facts, bwrap=bwrap, bwrap_version=_bwrap_version(bwrap), unshare=shutil.which("unshare")
    )
    self_contained = _kernel_defaults_self_contained()
    failures: list[str] = []
    try:
        trial_root = Path(tempfile.mkdtemp(prefix=".gpufleet-sandbox-probe-", dir=base))
    except OSError as e:
        return replace(facts, reason=f"cannot create a probe directory in {base}: {e}")
    try:
        for mode in candidate_modes(facts, self_contained):
            candidate = replace(
                facts,
                mode=mode,
                upper_self_contained=mode is not SandboxMode.OVERLAY_BWRAP or self_contained,
            )
            failure = _try(candidate, trial_root / mode.value)
            if failure is None:
                version = ".".join(map(str, facts.bwrap_version or ())) or "of unknown version"
                who = "as root" if facts.is_root else f"as uid {uid}"
                why = f"{mode.value} works here (bwrap {version}, {who})"
                return replace(candidate, reason="; ".join([why, *failures]))
            failures.append(f"{mode.value}: {failure}")
    finally:
        _remove_tree(trial_root)
    return replace(facts, reason="bwrap cannot run here; " + "; ".join(failures))


def _try(support: SandboxSupport, where: Path) -> str | None:
    """Run one trial sandbox; None when it behaved, else what went wrong."""
    dirs = {name: where / name for name in ("upper", "work", "merged", "home")}
    root = host_root()
    for path in dirs.values():
        path.mkdir(parents=True)
        if path.name != "home":
            for layer in layer_dirs(path, root):
                layer.mkdir()
    marker = f".gpufleet-sandbox-probe-{os.getpid()}-{secrets.token_hex(4)}"
    if support.overlay:
        script = f'echo probe > /etc/{marker} && echo ok > "$0/ok"'
    else:
        script = 'echo ok > "$0/ok"'
    argv = sandbox_argv(
        support,
        upper=dirs["upper"],
        work=dirs["work"],
        merged=dirs["merged"],
        home=dirs["home"],
        binds=(),
        env_prefix=None,
        root=root,
        argv=["/bin/sh", "-c", script, str(dirs["home"])],
    )
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    host_marker = Path("/etc") / marker
    if host_marker.exists():  # the sandbox wrote to the host: never use this mode
        host_marker.unlink()
        return "a write to /etc reached the host"
    if done.returncode != 0:
        detail = " ".join(done.stderr.split())[-300:] or f"exit status {done.returncode}"
        return detail
    if not (dirs["home"] / "ok").exists():
        return "the home directory was not writable in the sandbox"
    if support.overlay and not (dirs["upper"] / "etc" / marker).exists():
        return "a write to /etc did not land in the upper directory"
    return None


def _remove_tree(path: Path) -> None:
    """Remove a probe tree, opening the overlay's work directories (left with mode 000) first."""
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):
                try:
                    os.chmod(child, 0o700)
                except OSError:
                    continue
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("could not remove the sandbox probe directory %s", path)
