"""The local backend's side of the session sandbox (:mod:`gpufleet.snapshotter.sandbox`).

:class:`SandboxedProcessSpawner` is JupyterHub's local process spawner with each server run
in that sandbox (``LocalGPUSpawner`` builds on it); the functions here do its file system and
process work, off the event loop.

Where a server's sandbox lives on the host, made for each start by :func:`prepare`::

    <sandbox_dir>/<user>/<server, or "default">/
        upper/   the session's container state: what it changed in the root's directories
                 (usr/, etc/, opt/: its own virtualenv at opt/gpufleet/env above all). Kept
                 across restarts of the same server; the snapshotter reads it with
                 overlay.read_upper, a restore refills it.
        work/    the overlays' scratch directories: recreated empty at each start.
        merged/  the overlays' mount points: recreated empty at each start. The mounts exist
                 only in the session's own mount namespace, never on the host.
        tmp/     the session's /tmp: recreated empty at each start (as a reboot clears it);
                 not part of the session's state.
        passwd, group   the host's, with the user's entry (sandbox mode), bound read-only.

User and server names are escaped (:func:`path_component`) so that every name gets a directory
of its own that the overlay's mount options can carry.

A running session's processes carry ``GPUFLEET_SANDBOX_UPPER=<upper>`` (and the marker) in
their environment: :func:`holders` finds them, so nothing touches an upper directory that is
still mounted.

The process tree of a sandboxed server, as the spawner starts it::

    sh (gpufleet-session, the spawner's pid) ─ bwrap ─ bwrap init (pid 1 inside) ─ server
                                                                                  └ kernels

``sh`` is there because bwrap's ``--die-with-parent`` also kills bwrap when *its* parent dies:
without it, every session would end with the hub, which must be able to restart without them.
Signals meant for the server (SIGINT, SIGTERM) go to :func:`sandbox_top_processes`; killing
``sh`` ends the whole sandbox (bwrap, then its pid namespace).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from subprocess import Popen
from typing import Any, ClassVar

from jupyterhub.spawner import SimpleLocalProcessSpawner
from jupyterhub.utils import random_port
from tornado import web
from traitlets import Enum, List, Unicode, default

from ..snapshotter.sandbox import (
    DEFAULT_SESSION_PREFIX,
    RootEntry,
    SandboxDirs,
    SandboxMode,
    SandboxSupport,
    default_session_env,
    host_root,
    owned_prefix,
    prepare_dirs,
    probe,
    sandbox_argv,
    write_identity,
)

UPPER_VARIABLE = "GPUFLEET_SANDBOX_UPPER"
MODE_VARIABLE = "GPUFLEET_SANDBOX_MODE"
UNNAMED_SERVER = "default"

_OVERLAY_MODE_NAMES = frozenset(m.value for m in SandboxMode if SandboxSupport(m, "").overlay)
_BWRAP_MODE_NAMES = frozenset(m.value for m in SandboxMode if m is not SandboxMode.NONE)
# What a session finds on PATH after its own and the base environment's programs.
_SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/sbin", "/sbin")
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.@+")


class SandboxUnavailable(Exception):
    """The configured sandbox cannot be had here; the message says why and what to change."""


# One server's sandbox directories (see the module docstring).
SessionDirs = SandboxDirs


@dataclass(frozen=True)
class Containment:
    """Whom a server runs as, and from what (docs/containment.md).

    ``uid``/``gid``: the user's account (never 0). ``mode``: "sandbox" (a uid of the
    controller's range, given a passwd entry inside the sandbox) or "system" (the machine's
    account of that name). ``base_env``: the sessions' base environment (read-only inside).
    ``prefix``: where the session's own virtualenv lives inside the sandbox."""

    username: str
    uid: int
    gid: int
    mode: str
    base_env: Path
    prefix: Path

    @property
    def base_python(self) -> Path:
        return self.base_env / "bin" / "python"


def passwd_files(
    dirs: SessionDirs, containment: Containment, home: Path
) -> list[tuple[Path, Path]]:
    """In sandbox mode, the host's passwd and group files with the user's entries
    (:func:`.sandbox.write_identity`), beside the server's sandbox, as ``(file,
    /etc/...)`` pairs to bind read-only. Blocking."""
    if containment.mode != "sandbox":
        return []
    return write_identity(dirs.root, containment.username, containment.uid, containment.gid, home)


def path_component(name: str) -> str:
    """``name`` as one directory name: letters, digits and ``-.@+`` kept, every other byte
    (``_`` included, and a leading ``.``) written ``_xx``; distinct names stay distinct."""
    out = []
    for i, char in enumerate(name):
        if char in _SAFE and not (i == 0 and char == "."):
            out.append(char)
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode())
    return "".join(out) or "_"


def session_dirs(sandbox_dir: Path, user: str, server: str) -> SessionDirs:
    """Where the server ``server`` ("" for the default one) of ``user`` keeps its sandbox."""
    name = path_component(server) if server else UNNAMED_SERVER
    if server == UNNAMED_SERVER:  # a named server called "default" is not the default one
        name = f"_{ord(name[0]):02x}{name[1:]}"
    return SessionDirs(sandbox_dir / path_component(user) / name)


def choose(setting: str, support: SandboxSupport) -> SandboxSupport:
    """The sandbox a server gets for the spawner's ``sandbox`` setting. Pure.

    There is no unsandboxed setting: a researcher's code runs in a sandbox or not at all.
    Raises :class:`SandboxUnavailable` with what to install or configure when this machine
    cannot give the setting's sandbox.
    """
    if support.mode is SandboxMode.NONE:
        raise SandboxUnavailable(
            f"sessions run only in the bubblewrap sandbox, and it cannot run here "
            f"({support.reason}); install bubblewrap (apt-get install bubblewrap) and allow "
            "namespaces, or run the hub as root"
        )
    if setting == "overlay" and not support.overlay:
        raise SandboxUnavailable(
            "this machine cannot give sessions an overlay root "
            f"({support.mode.value}: {support.reason}); run the hub as root or install "
            "bubblewrap 0.9 or newer, or set the spawner's sandbox to 'auto' to accept a "
            "read-only root"
        )
    if setting == "readonly":
        return replace(support, mode=SandboxMode.READONLY)
    return support


def probe_at(sandbox_dir: Path) -> SandboxSupport:
    """What this machine can do for sandboxes whose directories live in ``sandbox_dir``
    (made if missing): :func:`.sandbox.probe`, cached. Blocking."""
    try:
        sandbox_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise SandboxUnavailable(f"cannot create the sandbox directory {sandbox_dir}: {e}") from e
    return probe(sandbox_dir)


def sandboxed_command(
    support: SandboxSupport,
    dirs: SessionDirs,
    argv: Sequence[str],
    *,
    home: Path,
    containment: Containment,
    extra_binds: Iterable[str],
    read_only: Iterable[str],
    notebook_dir: str,
    binds_at: Iterable[tuple[Path, Path]] = (),
    read_only_at: Iterable[tuple[Path, Path]] = (),
    share_pids: bool = False,
) -> list[str]:
    """Prepare a server's directories for a start and return the command line that runs
    ``argv`` in its sandbox as the user of ``containment``, with ``home``, from the
    session's own virtualenv (:mod:`.session_venv`). Blocking.

    ``binds_at`` and ``read_only_at``: ``(host path, path inside)`` pairs bound read-write
    and read-only where the inside path says (a pod's volumes at their mount paths, for the
    Kubernetes tier's test kubelet); ``extra_binds`` and ``read_only`` appear at their own
    paths. ``share_pids``: the caller's pid namespace is kept (that kubelet's ``hostPID``
    pods, the platform's node agent; never a researcher's session).

    Raises :class:`SandboxUnavailable` with what went wrong.
    """
    if not containment.base_python.exists():
        raise SandboxUnavailable(
            f"the sessions' base environment {containment.base_env} is missing; build it "
            "with scripts/build-session-env (scripts/install does), or set "
            "c.LocalGPUSpawner.session_base_env"
        )
    root = host_root()
    try:
        prepare_home(home, containment)
        prepare(dirs, support.overlay, root)
        prefix_source = prepare_prefix(dirs, support.overlay, containment)
        identity = passwd_files(dirs, containment, home)
    except OSError as e:
        raise SandboxUnavailable(f"preparing {dirs.root}: {e}") from e
    binds = [
        (path, path) for path in session_binds(home, extra=extra_binds, notebook_dir=notebook_dir)
    ]
    if prefix_source is not None:
        binds.append((prefix_source, containment.prefix))
    binds += binds_at
    shown_read_only = [containment.base_env, *(Path(p) for p in read_only if os.path.exists(p))]
    launcher = [
        str(containment.base_python),
        "-m",
        "gpufleet.spawner.session_venv",
        str(containment.prefix),
        "--",
        *argv,
    ]
    try:
        wrapped = sandbox_argv(
            support,
            upper=dirs.upper,
            work=dirs.work,
            merged=dirs.merged,
            home=home,
            binds=binds,
            env_prefix=None,
            argv=launcher,
            root=root,
            tmp=dirs.tmp,
            user=(containment.uid, containment.gid),
            read_only=[*((p, p) for p in shown_read_only), *identity, *read_only_at],
            share_pids=share_pids,
        )
    except ValueError as e:
        raise SandboxUnavailable(str(e)) from e
    return keep_alive(wrapped)


def prepare_home(home: Path, containment: Containment) -> None:
    """The user's home: made (sandbox mode) or required (system mode), owned by the user,
    mode 0700 (no other researcher may read it). Blocking."""
    if containment.mode == "system":
        if not home.is_dir():
            raise SandboxUnavailable(
                f"the home directory {home} of {containment.username} does not exist"
            )
    else:
        home.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        home.mkdir(mode=0o700, exist_ok=True)
    info = home.lstat()
    if (info.st_uid, info.st_gid) != (containment.uid, containment.gid) and os.geteuid() == 0:
        if containment.mode == "system" and info.st_uid != containment.uid:
            raise SandboxUnavailable(
                f"the home directory {home} belongs to uid {info.st_uid}, not to "
                f"{containment.username} ({containment.uid})"
            )
        os.chown(home, containment.uid, containment.gid)
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(home, stat.S_IMODE(info.st_mode) & 0o700)


def prepare_prefix(dirs: SessionDirs, overlay: bool, containment: Containment) -> Path | None:
    """Where the session's own virtualenv can be written, owned by the user: with an overlay,
    the prefix's place in the upper directory (so it is part of the session's container
    state: snapshotted, restored, pinned for its jobs), its parents as on the host; else a
    directory beside the sandbox, returned to be bound at the prefix. Blocking."""
    if overlay:
        owned_prefix(dirs.upper, containment.prefix, containment.uid, containment.gid)
        return None
    # Its mount point, under a directory the sandbox shows read-only: an empty directory
    # of root's on the host, the same for every session.
    containment.prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = dirs.root / "env"
    target.mkdir(mode=0o755, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(target, containment.uid, containment.gid)
    return target


# --------------------------------------------------------------------------- directories
def prepare(dirs: SessionDirs, overlay: bool, root: Sequence[RootEntry]) -> None:
    """Make the server's directories for a start (:func:`.sandbox.prepare_dirs`).

    Raises :class:`SandboxUnavailable` while a process of an earlier start still runs over
    ``upper`` (a second mount of a live upper directory is undefined behaviour).
    """
    running = holders(dirs.upper)
    if running:
        raise SandboxUnavailable(
            f"processes {running} of an earlier start of this server still run over "
            f"{dirs.upper}; end them (or stop the server again) before starting it"
        )
    prepare_dirs(dirs, overlay, root)


def session_binds(home: Path, *, extra: Iterable[str], notebook_dir: str) -> list[Path]:
    """Host paths bound read-write besides the home, each once: ``extra`` (those that
    exist) and a notebook directory outside the home (``~`` is the home). Nothing of the
    hub's own environment: the server runs from the sessions' base environment."""
    binds = [Path(p) for p in extra if os.path.exists(p)]
    if notebook_dir:
        if notebook_dir.startswith("~"):
            notebook_dir = str(home) + notebook_dir[1:]
        notebook = Path(notebook_dir)
        if notebook.is_absolute() and not notebook.is_relative_to(home) and notebook.is_dir():
            binds.append(notebook)
    return list(dict.fromkeys(binds))


# --------------------------------------------------------------------------- processes
def keep_alive(argv: Sequence[str]) -> list[str]:
    """``argv`` run under a shell that waits for it (see the module docstring: why)."""
    return ["/bin/sh", "-c", '"$@"; exit $?', "gpufleet-session", *argv]


def _status(proc: Path, pid: str) -> dict[str, str]:
    try:
        lines = (proc / pid / "status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def sandbox_top_processes(outer: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes right under the init of the sandbox started as ``outer``: the server,
    and any orphan the init adopted. [] when no sandbox init runs under ``outer``."""
    parent: dict[int, int] = {}
    nspid: dict[int, list[str]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            status = _status(proc, entry.name)
            if "PPid" in status:
                parent[int(entry.name)] = int(status["PPid"])
                nspid[int(entry.name)] = status.get("NSpid", "").split()
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    depth = len(nspid.get(outer, ()))
    queue = list(children.get(outer, ()))
    while queue:
        pid = queue.pop(0)
        ids = nspid.get(pid, [])
        if len(ids) > depth and ids[-1] == "1":
            return sorted(children.get(pid, ()))
        queue += children.get(pid, ())
    return []


def holders(upper: Path, proc: Path = Path("/proc")) -> list[int]:
    """Live processes started in a sandbox over ``upper`` (they carry it in their environment)."""
    wanted = f"{UPPER_VARIABLE}={upper}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    return sorted(found)


# --------------------------------------------------------------------------- the spawner
class SandboxFailed(web.HTTPError):
    """The session sandbox could not be set up; the message says why and what to change."""

    def __init__(self, message: str):
        super().__init__(500, message)
        self.jupyterhub_message = f"The session sandbox could not be set up: {message}"


class SandboxedProcessSpawner(SimpleLocalProcessSpawner):
    """JupyterHub's local process spawner, with each server run in its session sandbox as
    its user's account (docs/containment.md).

    ``start`` is LocalProcessSpawner's with the command wrapped (:func:`sandboxed_command`);
    the sandbox's mode and the server's upper directory are kept in the spawner's state
    (``gpufleet_sandbox_mode``, ``gpufleet_sandbox_upper``: the upper is kept after the
    server stops, it is the server's container state) and given to the server as
    ``GPUFLEET_SANDBOX_MODE`` and ``GPUFLEET_SANDBOX_UPPER``. Subclasses say whom the server
    runs as through :meth:`containment`.
    """

    sandbox = Enum(
        ["auto", "overlay", "readonly"],
        "auto",
        help="Every server runs in a bubblewrap sandbox, as its user's account: its / holds "
        "only the host's /usr, /etc, /opt and /bin, /sbin, /lib* (never the hub's data, "
        "secrets or software, /root, /home or /var), its home and its own environment, and "
        "its processes see no one else's. 'auto': those directories as overlays where the "
        "machine allows (what the session changes in them lands in its own upper directory "
        "under sandbox_dir, which the snapshotter reads, and never on the host), else "
        "read-only; the log says which and why. 'overlay': overlays or no spawn. 'readonly': "
        "read-only, no upper directory. Where bubblewrap cannot run, no server starts and the "
        "spawn says what to install.",
    ).tag(config=True)

    sandbox_dir = Unicode(
        help="Where each server's sandbox lives: <sandbox_dir>/<user>/<server, or "
        "'default'>/ holds upper/ (the session's container state, kept across restarts of "
        "the server), work/ and merged/ (the overlay's, renewed at each start) and tmp/ (the "
        "session's /tmp, emptied at each start). Default: $GPUFLEET_DATA_DIR/sessions. It "
        "must be on a file system that can hold an overlay's upper directory (not an overlay "
        "or NFS), and its path must not contain ',', ':' or '\\\\'.",
    ).tag(config=True)

    @default("sandbox_dir")
    def _default_sandbox_dir(self) -> str:
        data_dir = os.environ.get("GPUFLEET_DATA_DIR") or os.path.abspath(".gpufleet")
        return os.path.join(data_dir, "sessions")

    sandbox_binds = List(
        Unicode(),
        help="Host paths bound read-write at the same place in every sandbox, e.g. shared "
        "data sets. Nothing else of the host is there but the directories 'sandbox' names, "
        "the home and the notebook directory.",
    ).tag(config=True)

    session_base_env = Unicode(
        help="The sessions' base environment (scripts/build-session-env): the Python, "
        "JupyterLab and packages every session and job rank runs from, shown read-only. "
        "Default: $GPUFLEET_SESSION_ENV, else the checkout's own (scripts/build-session-env "
        "--print-target), else /opt/gpufleet/session-env.",
    ).tag(config=True)

    @default("session_base_env")
    def _default_session_base_env(self) -> str:
        return default_session_env()

    session_prefix = Unicode(
        DEFAULT_SESSION_PREFIX,
        help="Where, inside the sandbox, each session gets a virtualenv of its own over the "
        "base environment, made at its first start: kernels and pip install there, it is "
        "part of the session's container state (snapshotted, restored) and affects no one "
        "else. It must lie under one of the sandbox's root directories (/opt by default).",
    ).tag(config=True)

    sandbox_mode: str = ""  # a SandboxMode value, as of the last start
    sandbox_upper: str = ""  # the server's overlay upper directory; kept after it stops
    _sandbox_logged: ClassVar[set[str]] = set()

    async def containment(self) -> Containment:
        """Whom the server runs as, and from what: an abstract hook, which LocalGPUSpawner
        answers from the controller's account record. A sandboxed spawner without one has no
        account to run servers as, so it refuses to start them."""
        raise NotImplementedError(
            f"{type(self).__name__} must say whom servers run as (containment())"
        )

    def sandbox_read_only(self) -> list[str]:
        """Host paths every server of this spawner sees read-only (the fake NVML library)."""
        return []

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.sandbox_mode = state.get("gpufleet_sandbox_mode", "")
        self.sandbox_upper = state.get("gpufleet_sandbox_upper", "")

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.sandbox_mode:
            state["gpufleet_sandbox_mode"] = self.sandbox_mode
        if self.sandbox_upper:
            state["gpufleet_sandbox_upper"] = self.sandbox_upper
        return state

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        # Nothing of the hub's own environment's paths: the server runs from the base.
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_ROOT", "CONDA_DEFAULT_ENV"):
            env.pop(name, None)
        base_bin = os.path.join(self.session_base_env, "bin")
        env["PATH"] = os.pathsep.join(
            [os.path.join(self.session_prefix, "bin"), base_bin, *_SYSTEM_PATH]
        )
        if self.sandbox_mode:
            env[MODE_VARIABLE] = self.sandbox_mode
        if self.sandbox_upper and self.sandbox_mode in _OVERLAY_MODE_NAMES:
            env[UPPER_VARIABLE] = self.sandbox_upper
        return env

    async def _sandbox_support(self) -> SandboxSupport:
        """The sandbox this start gets, as ``sandbox`` allows."""
        try:
            support = await asyncio.to_thread(probe_at, Path(self.sandbox_dir))
        except SandboxUnavailable as e:
            raise SandboxFailed(str(e)) from e
        if support.mode.value not in SandboxedProcessSpawner._sandbox_logged:
            SandboxedProcessSpawner._sandbox_logged.add(support.mode.value)
            level = logging.INFO if support.overlay else logging.WARNING
            self.log.log(level, "session sandbox: %s (%s)", support.mode.value, support.reason)
        try:
            return choose(self.sandbox, support)
        except SandboxUnavailable as e:
            raise SandboxFailed(f"c.{type(self).__name__}.sandbox is {self.sandbox!r}: {e}") from e

    async def start(self) -> tuple[str, int]:
        """LocalProcessSpawner.start, with the server's command run in its sandbox."""
        support = await self._sandbox_support()
        containment = await self.containment()
        dirs = session_dirs(Path(self.sandbox_dir), self.user.name, self.name)
        self.sandbox_mode = support.mode.value
        if support.overlay:
            self.sandbox_upper = str(dirs.upper)
        if self.port == 0:  # type: ignore[has-type]  # (a trait of the untyped Spawner)
            self.port = random_port()
        env = self.get_env()
        cmd = [*self.cmd, *self.get_args()]
        if self.shell_cmd:
            cmd = [*self.shell_cmd, shlex.join(cmd)]
        try:
            argv = await asyncio.to_thread(
                sandboxed_command,
                support,
                dirs,
                cmd,
                home=Path(env["HOME"]),
                containment=containment,
                extra_binds=self.sandbox_binds,
                read_only=self.sandbox_read_only(),
                notebook_dir=self.format_string(self.notebook_dir) if self.notebook_dir else "",
            )
        except SandboxUnavailable as e:
            raise SandboxFailed(str(e)) from e
        self.log.info(
            "Spawning %s in a %s sandbox as uid %d (%s)",
            shlex.join(cmd),
            support.mode,
            containment.uid,
            dirs.root,
        )
        popen_kwargs: dict[str, Any] = {
            # The outer processes stay root (they mount); setpriv switches to the user.
            "start_new_session": True,
            "cwd": env["HOME"],  # the sandbox starts where it was started: in the home
            **self.popen_kwargs,
            "env": env,
        }
        self.proc = await asyncio.to_thread(lambda: Popen(argv, **popen_kwargs))
        self.pid = self.proc.pid
        return (self.ip or "127.0.0.1", self.port)

    async def _signal(self, sig: int) -> bool:
        """Signal the server; in a sandbox, SIGINT and SIGTERM go to the server itself (and
        whatever the sandbox's init adopted): bwrap does not pass signals on."""
        if sig in (signal.SIGINT, signal.SIGTERM) and self.sandbox_mode in _BWRAP_MODE_NAMES:
            inner = await asyncio.to_thread(sandbox_top_processes, self.pid)
            for pid in inner:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
            if inner:
                sig = 0  # the sandbox ends when the server does; is it still there?
        alive: bool = await super()._signal(sig)
        return alive
