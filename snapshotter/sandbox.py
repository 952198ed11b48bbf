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
import glob
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["SandboxMode", "SandboxSupport", "candidate_modes", "probe", "sandbox_argv"]

log = logging.getLogger(__name__)

_OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off"
# $1 upper, $2 work, $3 merged, then the bwrap command line. Paths are passed as arguments,
# never pasted into the script, so no quoting can go wrong.
_MOUNT_SCRIPT = (
    "mount --make-rprivate / && "
    'mount -t overlay overlay -o "lowerdir=/,upperdir=$1,workdir=$2,{options}" "$3" && '
    'shift 3 && exec "$@"'
)
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
    tmp: Path | None = None,
    devices: Sequence[Path] | None = None,
    user: tuple[int, int] | None = None,
) -> list[str]:
    """The command line that runs ``argv`` in a session sandbox of ``support.mode``.

    ``upper``, ``work`` (empty, on the same file system as ``upper``) and ``merged`` (an empty
    directory, the mount point) must exist; they are used by the overlay modes only. ``home``,
    ``env_prefix`` and each ``(source, destination)`` of ``binds`` are bound read-write.
    ``tmp``, when given, is bound at ``/tmp``; otherwise ``/tmp`` is a fresh tmpfs. ``devices``
    replaces the GPU device nodes :func:`probe` found. ``user`` = ``(uid, gid)`` runs the
    command as that user (root only). In mode ``none`` the result is ``argv`` itself (behind
    ``setpriv`` when ``user`` is given).

    Pure: reads nothing, creates nothing. Raises ``ValueError`` for an empty ``argv``, for
    paths the overlay mount options cannot carry, or for ``user`` where bwrap is not root.
    """
    if not argv:
        raise ValueError("sandbox_argv needs a command to run (argv is empty)")
    if user == (support.uid, support.gid):
        user = None  # already that user
    if user is not None and not support.is_root and user != (support.uid, support.gid):
        raise ValueError(
            f"cannot run the session as uid/gid {user}: switching users needs root, and this "
            f"process runs as {support.uid}/{support.gid}"
        )
    mode = support.mode
    if mode is SandboxMode.NONE:
        return _as_user(argv, user)
    bwrap = support.bwrap
    if bwrap is None:
        raise ValueError(f"sandbox mode {mode.value} needs bwrap, and the support names none")
    prefix: list[str] = []
    root_args: list[str]
    if mode in _OVERLAY_MODES:
        paths = [
            _check_overlay_path("upper directory", upper),
            _check_overlay_path("work directory", work),
            _check_overlay_path("merged directory", merged),
        ]
        if mode is SandboxMode.OVERLAY_BWRAP:
            root_args = [bwrap, "--overlay-src", "/", "--overlay", paths[0], paths[1], "/"]
        elif mode is SandboxMode.OVERLAY_MOUNT:
            script = _MOUNT_SCRIPT.format(options=_OVERLAY_OPTIONS)
            prefix = [support.unshare or "unshare", "-m", "--", "/bin/sh", "-c", script, "sh"]
            prefix += paths
            root_args = [bwrap, "--bind", paths[2], "/"]
        else:  # OVERLAY_USERNS: userxattr implies no redirects and no metacopy
            script = _MOUNT_SCRIPT.format(options="userxattr").removeprefix(
                "mount --make-rprivate / && "
            )
            prefix = [support.unshare or "unshare", "-U", "-r", "-m", "--", "/bin/sh", "-c"]
            prefix += [script, "sh", *paths]
            root_args = [bwrap, "--unshare-user", "--uid", str(support.uid)]
            root_args += ["--gid", str(support.gid), "--bind", paths[2], "/"]
        root_args += ["--ro-bind", "/sys", "/sys"]
    else:  # READONLY: bwrap binds recursively, so /sys and the other mounts come along
        root_args = [bwrap, "--ro-bind", "/", "/"]

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
    mounts += binds
    for parent in _parents([destination for _, destination in mounts]):
        args += ["--perms", "0755", "--dir", parent]
    for source, destination in mounts:
        args += ["--bind", str(source), str(destination)]
    args += ["--unshare-pid", "--die-with-parent", "--new-session"]
    if user is not None and support.is_root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*args, "--", *_as_user(argv, user)]


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
        return replace(
            facts, reason="bwrap (bubblewrap) is not installed: sessions run unsandboxed"
        )
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
    return replace(
        facts, reason="bwrap cannot run here, sessions run unsandboxed; " + "; ".join(failures)
    )


def _try(support: SandboxSupport, where: Path) -> str | None:
    """Run one trial sandbox; None when it behaved, else what went wrong."""
    dirs = {name: where / name for name in ("upper", "work", "merged", "home")}
    for path in dirs.values():
        path.mkdir(parents=True)
    marker = f".gpufleet-sandbox-probe-{os.getpid()}-{secrets.token_hex(4)}"
    if support.overlay:
        script = f'echo probe > /{marker} && echo ok > "$0/ok"'
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
    host_marker = Path("/") / marker
    if host_marker.exists():  # the sandbox wrote to the host: never use this mode
        host_marker.unlink()
        return "a write to / reached the host"
    if done.returncode != 0:
        detail = " ".join(done.stderr.split())[-300:] or f"exit status {done.returncode}"
        return detail
    if not (dirs["home"] / "ok").exists():
        return "the home directory was not writable in the sandbox"
    if support.overlay and not (dirs["upper"] / marker).exists():
        return "a write to / did not land in the upper directory"
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
