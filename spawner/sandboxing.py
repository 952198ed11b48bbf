"""The local backend's side of the session sandbox (:mod:`gpufleet.snapshotter.sandbox`).

:class:`SandboxedProcessSpawner` is JupyterHub's local process spawner with each server run
in that sandbox (``LocalGPUSpawner`` builds on it); the functions here do its file system and
process work, off the event loop.

Where a server's sandbox lives on the host, made for each start by :func:`prepare`::

    <sandbox_dir>/<user>/<server, or "default">/
        upper/   the session's container state: what it changed outside its home (apt, pip
                 into system paths, /etc). Kept across restarts of the same server; the
                 snapshotter reads it with overlay.read_upper, a restore refills it.
        work/    the overlay's scratch directory: recreated empty at each start.
        merged/  the overlay's mount point: recreated empty at each start. The mount exists
                 only in the session's own mount namespace, never on the host.
        tmp/     the session's /tmp: recreated empty at each start (as a reboot clears it);
                 not part of the session's state.

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
import shutil
import signal
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any, ClassVar

from jupyterhub.spawner import SimpleLocalProcessSpawner
from jupyterhub.utils import random_port
from tornado import web
from traitlets import Enum, List, Unicode, default

from ..snapshotter.sandbox import SandboxMode, SandboxSupport, probe, sandbox_argv

UPPER_VARIABLE = "GPUFLEET_SANDBOX_UPPER"
MODE_VARIABLE = "GPUFLEET_SANDBOX_MODE"
UNNAMED_SERVER = "default"

_OVERLAY_MODE_NAMES = frozenset(m.value for m in SandboxMode if SandboxSupport(m, "").overlay)
_BWRAP_MODE_NAMES = frozenset(m.value for m in SandboxMode if m is not SandboxMode.NONE)
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.@+")


class SandboxUnavailable(Exception):
    """The configured sandbox cannot be had here; the message says why and what to change."""


@dataclass(frozen=True)
class SessionDirs:
    """One server's sandbox directories (see the module docstring)."""

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


def choose(setting: str, support: SandboxSupport) -> SandboxSupport | None:
    """The sandbox a server gets for the spawner's ``sandbox`` setting; None: run it as is.

    Pure. Raises :class:`SandboxUnavailable` when ``setting`` is "overlay" and ``support`` has
    no overlay mode.
    """
    if setting == "off":
        return None
    if setting == "overlay" and not support.overlay:
        raise SandboxUnavailable(
            "this machine cannot give sessions an overlay root "
            f"({support.mode.value}: {support.reason}); install bubblewrap, run the hub as "
            "root, or set the spawner's sandbox to 'auto' to accept a lesser sandbox"
        )
    return None if support.mode is SandboxMode.NONE else support


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
    user: tuple[int, int] | None,
    extra_binds: Iterable[str],
    notebook_dir: str,
    search_path: str,
) -> list[str]:
    """Prepare a server's directories for a start and return the command line that runs
    ``argv`` in its sandbox, as ``user`` (None: as the caller) with ``home``. Blocking.

    Raises :class:`SandboxUnavailable` with what went wrong.
    """
    if user is not None and not home.is_dir():
        raise SandboxUnavailable(f"the home directory {home} does not exist")
    try:
        if user is None:
            home.mkdir(mode=0o755, parents=True, exist_ok=True)
        prepare(dirs, support.overlay)
    except OSError as e:
        raise SandboxUnavailable(f"preparing {dirs.root}: {e}") from e
    binds = session_binds(
        home,
        extra=extra_binds,
        notebook_dir=notebook_dir,
        command=argv[0],
        search_path=search_path,
    )
    try:
        wrapped = sandbox_argv(
            support,
            upper=dirs.upper,
            work=dirs.work,
            merged=dirs.merged,
            home=home,
            binds=[(path, path) for path in binds],
            env_prefix=None,
            argv=argv,
            tmp=dirs.tmp,
            user=user,
        )
    except ValueError as e:
        raise SandboxUnavailable(str(e)) from e
    return keep_alive(wrapped)


# --------------------------------------------------------------------------- directories
def prepare(dirs: SessionDirs, overlay: bool) -> None:
    """Make the server's directories for a start: keep ``upper``, renew the others (only
    ``tmp`` without ``overlay``).

    ``upper`` becomes the ``/`` of the sandbox, so it gets the host root's mode and owner
    (a directory only root may enter would shut a session's user out of everything).
    Raises :class:`SandboxUnavailable` while a process of an earlier start still runs over
    ``upper`` (a second mount of a live upper directory is undefined behaviour).
    """
    running = holders(dirs.upper)
    if running:
        raise SandboxUnavailable(
            f"processes {running} of an earlier start of this server still run over "
            f"{dirs.upper}; end them (or stop the server again) before starting it"
        )
    dirs.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _remove_tree(dirs.tmp)
    dirs.tmp.mkdir(mode=0o700)
    os.chmod(dirs.tmp, 0o1777)
    if not overlay:
        return
    root = os.stat("/")
    if not dirs.upper.is_dir():
        dirs.upper.mkdir(mode=0o700)
        if os.geteuid() == 0:
            os.chown(dirs.upper, root.st_uid, root.st_gid)
        os.chmod(dirs.upper, stat.S_IMODE(root.st_mode))
    _remove_tree(dirs.work)
    dirs.work.mkdir(mode=0o700)
    if dirs.merged.exists():
        try:
            dirs.merged.rmdir()  # never rmtree: it must be an empty, unmounted directory
        except OSError as e:
            raise SandboxUnavailable(
                f"{dirs.merged} should be an empty mount point and is not ({e.strerror}); "
                "is something of an earlier session of this server still running?"
            ) from e
    dirs.merged.mkdir(mode=0o700)


def _remove_tree(path: Path) -> None:
    """Remove a tree that may hold the overlay's work directories (left with mode 000)."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path)


# The sandbox gives these their own content: a host path under them is hidden unless bound.
_REPLACED_IN_SANDBOX = (Path("/tmp"), Path("/dev"), Path("/proc"))


def hidden_in_sandbox(paths: Iterable[Path]) -> list[Path]:
    """Those of ``paths`` the sandbox would not show as they are, each once, outermost first
    (a path under another one listed is left out): what lives on another file system than
    ``/`` (the overlay root shows only the host's root file system), and what lives under a
    directory the sandbox replaces (its private ``/tmp``: a checkout or virtualenv there,
    as in CI)."""
    root_dev = os.stat("/").st_dev
    found: list[Path] = []
    for path in sorted({Path(os.path.realpath(p)) for p in paths}, key=lambda p: len(p.parts)):
        try:
            elsewhere = os.stat(path).st_dev != root_dev
        except OSError:
            continue
        replaced = any(path.is_relative_to(r) for r in _REPLACED_IN_SANDBOX)
        if (elsewhere or replaced) and not any(path.is_relative_to(o) for o in found):
            found.append(path)
    return found


def session_binds(
    home: Path, *, extra: Iterable[str], notebook_dir: str, command: str, search_path: str
) -> list[Path]:
    """Host paths a server needs that the overlay root would not show as they are, each once:
    ``extra`` (those that exist), a notebook directory outside the home (``~`` is the home),
    and whatever the server runs from that the sandbox would hide (``hidden_in_sandbox``)."""
    binds = [Path(p) for p in extra if os.path.exists(p)]
    if notebook_dir:
        if notebook_dir.startswith("~"):
            notebook_dir = str(home) + notebook_dir[1:]
        notebook = Path(notebook_dir)
        if notebook.is_absolute() and not notebook.is_relative_to(home) and notebook.is_dir():
            binds.append(notebook)
    binds += hidden_in_sandbox(runtime_paths(command, search_path))
    return list(dict.fromkeys(binds))


def runtime_paths(command: str, search_path: str) -> list[Path]:
    """What the server's command runs from: the command's environment (its ``bin``'s parent),
    this Python's prefixes and import path (an editable install's source checkout among them),
    and the resolver configuration (``/etc/resolv.conf`` often points into ``/run``)."""
    paths = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    paths += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    paths.append(Path(__file__).resolve().parents[1])  # this package, or its checkout
    found = shutil.which(command, path=search_path) if os.sep not in command else command
    if found:
        paths.append(Path(os.path.realpath(found)).parent.parent)
    paths.append(Path("/etc/resolv.conf"))
    return paths


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
    """JupyterHub's local process spawner, with each server run in its session sandbox.

    ``start`` is LocalProcessSpawner's with the command wrapped (:func:`sandboxed_command`);
    the sandbox's mode and the server's upper directory are kept in the spawner's state
    (``gpufleet_sandbox_mode``, ``gpufleet_sandbox_upper``: the upper is kept after the
    server stops, it is the server's container state) and given to the server as
    ``GPUFLEET_SANDBOX_MODE`` and ``GPUFLEET_SANDBOX_UPPER``. Subclasses that run servers as
    other users say which through :meth:`sandbox_user`.
    """

    sandbox = Enum(
        ["auto", "overlay", "off"],
        "auto",
        help="Run each server in a bubblewrap sandbox whose / is an overlay on the host's "
        "root file system, so what a session changes outside its home (apt, pip into system "
        "paths, /etc) lands in its own upper directory under sandbox_dir, which the "
        "snapshotter reads, and never on the host. 'auto': the best mode this machine allows "
        "(an overlay mode, else the host's root read-only, else no sandbox; the log says "
        "which and why). 'overlay': an overlay mode or no spawn (the spawn fails with the "
        "reason). 'off': run servers as plain processes.",
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
        "data sets on their own file system: the overlay root shows only the host's root "
        "file system. The home, the notebook directory, the fake NVML library and the "
        "Python environment the server runs from are bound without being listed here.",
    ).tag(config=True)

    sandbox_mode: str = ""  # "off", "none", or a SandboxMode value, as of the last start
    sandbox_upper: str = ""  # the server's overlay upper directory; kept after it stops
    _sandbox_logged: ClassVar[set[str]] = set()

    def sandbox_user(self) -> tuple[int, int] | None:
        """``(uid, gid)`` the server runs as in the sandbox; None: the hub's own user."""
        return None

    def sandbox_needs(self) -> list[str]:
        """Host directories every server of this spawner needs bound into its sandbox."""
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
        if self.sandbox_mode:
            env[MODE_VARIABLE] = self.sandbox_mode
        if self.sandbox_upper and self.sandbox_mode in _OVERLAY_MODE_NAMES:
            env[UPPER_VARIABLE] = self.sandbox_upper
        return env

    async def _sandbox_support(self) -> SandboxSupport | None:
        """The sandbox this start gets (None: a plain process), as ``sandbox`` allows."""
        if self.sandbox == "off":
            return None
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
            raise SandboxFailed(f"c.{type(self).__name__}.sandbox is 'overlay', but {e}") from e

    async def start(self) -> tuple[str, int]:
        """LocalProcessSpawner.start, with the server's command run in its sandbox."""
        support = await self._sandbox_support()
        if support is None:
            self.sandbox_mode = "off" if self.sandbox == "off" else SandboxMode.NONE.value
            address: tuple[str, int] = await super().start()
            return address
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
        user = self.sandbox_user()  # then the outer processes stay root: they mount
        try:
            argv = await asyncio.to_thread(
                sandboxed_command,
                support,
                dirs,
                cmd,
                home=Path(env["HOME"]),
                user=user,
                extra_binds=[*self.sandbox_binds, *self.sandbox_needs()],
                notebook_dir=self.format_string(self.notebook_dir) if self.notebook_dir else "",
                search_path=env.get("PATH", ""),
            )
        except SandboxUnavailable as e:
            raise SandboxFailed(str(e)) from e
        self.log.info("Spawning %s in a %s sandbox (%s)", shlex.join(cmd), support.mode, dirs.root)
        popen_kwargs: dict[str, Any] = {
            # Without a user, the preexec only makes and enters the home (no setuid).
            "preexec_fn": None if user else self.make_preexec_fn(self.user.name),
            "start_new_session": True,
            "cwd": env["HOME"],
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
