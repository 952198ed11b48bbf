"""Snapshot passes and restores of one session, run as ``gpufleet snapshot`` processes.

The culler's live pass (in the controller), the spawner's final pass and restore (in the
hub) and the node agent's operations (``node_operations.py``) run the command line in a
process of its own: the work is heavy (reading, hashing, compressing gigabytes) and must
never hold up an event loop, and a process can be given the session's identity and
environment. Progress and results come back as JSON lines (``--json``). Where the
snapshots go is a :class:`~.settings.StoreAccess` (``c.SnapshotSettings``, resolved).
A session whose files only its node's agent can read is asked of that agent through
:func:`on_node`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .envspec import conda_environments
from .errors import SnapshotError
from .settings import StoreAccess


class SnapshotFailed(SnapshotError):
    """A snapshot or restore process failed; the message carries its own explanation."""


@dataclass(frozen=True)
class Sources:
    """What a session's snapshot holds, as ``gpufleet snapshot create`` takes it."""

    paths: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    overlays: tuple[str, ...] = ()  # "upper[:merged]"
    exclude: tuple[str, ...] = ()
    # The paths are on the session's node, read by its node agent (a Kubernetes session:
    # spawner/kube_snapshots.py), with its container's layer when ``container``.
    on_node: bool = False
    container: bool = False

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Sources:
        return cls(
            tuple(raw.get("paths", ())),
            tuple(raw.get("prefixes", ())),
            tuple(raw.get("overlays", ())),
            tuple(raw.get("exclude", ())),
            bool(raw.get("on_node", False)),
            bool(raw.get("container", False)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "paths": list(self.paths),
            "prefixes": list(self.prefixes),
            "overlays": list(self.overlays),
            "exclude": list(self.exclude),
            "on_node": self.on_node,
            "container": self.container,
        }

    def __bool__(self) -> bool:
        return bool(self.paths or self.prefixes or self.overlays)


def local_sources(home: str, upper: str, exclude: Sequence[str]) -> Sources:
    """What a local session's snapshots hold: its home; its overlay upper directory
    ``upper`` when it runs in one (everything it changed outside its home is there, conda
    environments included); otherwise the environment prefixes conda recorded outside its
    home. Reads the home's conda environment list."""
    overlays: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    if upper:
        overlays = (upper,)
    else:
        prefixes = tuple(
            str(p)
            for p in conda_environments([Path(home)])
            if not str(p).startswith(home.rstrip("/") + "/")
        )
    return Sources(
        paths=(home,) if home else (),
        prefixes=prefixes,
        overlays=overlays,
        exclude=tuple(exclude),
    )


Progress = Callable[[dict[str, Any]], None]


def _command() -> list[str]:
    """This installation's ``gpufleet`` command (beside the running interpreter)."""
    beside = os.path.join(os.path.dirname(sys.executable), "gpufleet")
    found = beside if os.path.exists(beside) else shutil.which("gpufleet")
    if found is None:
        raise SnapshotFailed("the gpufleet command is not installed beside this Python")
    return [found]


async def create(
    settings: StoreAccess,
    project: str,
    user: str,
    server: str,
    sources: Sources,
    *,
    tags: Sequence[str] = (),
    on_progress: Progress | None = None,
) -> dict[str, Any]:
    """One snapshot pass; its result (``id``, ``name``, ``stats``)."""
    args = ["create", *sources.paths, "--user", user, "--server", server]
    for prefix in sources.prefixes:
        args += ["--prefix", prefix]
    for overlay in sources.overlays:
        args += ["--overlay", overlay]
    for pattern in sources.exclude:
        args += ["--exclude", pattern]
    for tag in tags:
        args += ["--tag", tag]
    if settings.cache_dir:
        args += ["--cache-dir", settings.cache_dir]
    return await _run(settings, project, args, on_progress)


async def restore_latest(
    settings: StoreAccess,
    project: str,
    user: str,
    server: str,
    *,
    targets: Mapping[str, str] | None = None,
    only: Sequence[str] = (),
    on_progress: Progress | None = None,
) -> dict[str, Any]:
    """Restore the owner's latest snapshot of this server to where it came from (or to
    ``targets``: source name -> path), only the sources named in ``only`` if any; its
    result (``id``, ``files``, ``bytes``)."""
    args = ["restore", "latest", "--user", user, "--server", server]
    for name in only:
        args += ["--source", name]
    for name, path in (targets or {}).items():
        args += ["--target", f"{name}={path}"]
    if settings.cache_dir:
        args += ["--cache-dir", settings.cache_dir]
    return await _run(settings, project, args, on_progress)


async def show_latest(
    settings: StoreAccess, project: str, user: str, server: str
) -> dict[str, Any] | None:
    """The owner's latest snapshot of this server (``id``, ``created_at``, ``sources``:
    name, path, kind), None when there is none."""
    try:
        return await _run(
            settings, project, ["show", "latest", "--user", user, "--server", server], None
        )
    except SnapshotFailed as e:
        if "has no snapshot" in str(e):
            return None
        raise


@dataclass(frozen=True)
class Restored:
    """What a restore of the missing sources brought back."""

    snapshot_id: str
    created_at: float  # when the snapshot was taken (seconds since the epoch)
    sources: tuple[dict[str, Any], ...]  # name, path, kind of each source restored
    seconds: float

    def notice(self) -> str:
        """What the user should read about it in the session: what came back, in words (a
        long notice is shown in JupyterLab sentence by sentence, never cut)."""
        taken = datetime.fromtimestamp(self.created_at, UTC)
        back = "; ".join(dict.fromkeys(restored_label(s) for s in self.sources))
        return (
            f"Stopped at {taken:%H:%M UTC on %d %b} and restored from snapshot: {back}. "
            "Kernels were restarted."
        )


async def restore_missing(
    settings: StoreAccess,
    project: str,
    user: str,
    server: str,
    *,
    within: Collection[str] | None = None,
    announce: Callable[[Sequence[dict[str, Any]]], None] | None = None,
    on_progress: Progress | None = None,
) -> Restored | None:
    """Restore what the owner's latest snapshot of this server holds and is missing here
    (a source whose directory is gone or empty), only sources whose path is in
    ``within`` if given; None when nothing had to be restored. ``announce`` hears the
    sources about to be restored."""
    local = not settings.store.startswith("s3://")
    if local and not await asyncio.to_thread(os.path.isdir, settings.store):
        return None  # nothing was ever snapshotted here
    shown = await show_latest(settings, project, user, server)
    if shown is None:
        return None
    sources = [s for s in shown.get("sources", []) if within is None or s.get("path") in within]
    gone = await asyncio.to_thread(lambda: [is_missing(Path(s["path"])) for s in sources])
    missing = [s for s, is_gone in zip(sources, gone, strict=True) if is_gone]
    if not missing:
        return None
    if announce is not None:
        announce(missing)
    started = time.monotonic()
    result = await restore_latest(
        settings, project, user, server, only=[s["name"] for s in missing], on_progress=on_progress
    )
    return Restored(
        str(result.get("id")),
        float(shown.get("created_at", 0)),
        tuple(missing),
        time.monotonic() - started,
    )


def restored_label(source: Mapping[str, Any]) -> str:
    """What came back of one source, as the user knows it: a directory's path is the
    node's (a volume's, on Kubernetes), which the user may never have seen."""
    kind = source.get("kind")
    if kind == "overlay":
        return "the packages you installed and other system changes"
    if kind == "prefix":
        return f"the environment {source.get('path')}"
    return "your files"


def source_label(source: Mapping[str, Any]) -> str:
    kind = source.get("kind")
    if kind == "overlay":
        return "installed packages and system changes"
    if kind == "prefix":
        return f"environment {source.get('path')}"
    return "files"


def is_missing(path: Path) -> bool:
    try:
        with os.scandir(path) as listing:
            return next(listing, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


async def on_node(
    request: Callable[[], Awaitable[dict[str, Any]]],
    status: Callable[[int], Awaitable[dict[str, Any]]],
    abandon: Callable[[int], Awaitable[dict[str, Any]]],
    *,
    what: str,
    claim_within: float,
    silent_within: float = 60.0,
    on_progress: Progress | None = None,
    poll_s: float = 0.2,
) -> dict[str, Any]:
    """Ask a node agent for an operation (``state/operations.py``) and wait for its end:
    its result. Raises :class:`SnapshotFailed` when it fails, when no agent claims it
    within ``claim_within`` seconds, or when its agent stops reporting on it for
    ``silent_within`` seconds (it reports every half second while it runs: it died, or
    lost the controller). An operation given up on is failed, so no agent runs it later
    and a late report of it changes nothing."""
    operation = await request()
    oid, node = int(operation["id"]), operation["node"]
    claim_deadline = time.monotonic() + claim_within
    last_report, heard_at = operation.get("updated_at"), time.monotonic()
    last_progress = None
    while True:
        state = operation["state"]
        if state == "done":
            return dict(operation.get("result") or {})
        if state == "failed":
            raise SnapshotFailed(f"{what} on node {node} failed: {operation.get('error')}")
        if operation.get("updated_at") != last_report:
            last_report, heard_at = operation.get("updated_at"), time.monotonic()
        now = time.monotonic()
        if state == "pending" and now > claim_deadline:
            why = (
                f"no gpufleet node agent on node {node} took the {what} within "
                f"{claim_within:.0f} s: is the agent running there (docs/kubernetes.md)?"
            )
        elif state == "running" and now - heard_at > silent_within:
            why = (
                f"the gpufleet node agent on node {node} stopped reporting on the {what} "
                f"for {silent_within:.0f} s (did it restart, or lose the controller?)"
            )
        else:
            why = ""
        if why:
            operation = await abandon(oid)
            if operation["state"] == "failed":
                raise SnapshotFailed(why)
            continue  # it ended meanwhile
        progress = operation.get("progress")
        if progress and progress != last_progress and on_progress is not None:
            on_progress(progress)
        last_progress = progress
        await asyncio.sleep(poll_s)
        operation = await status(oid)


async def _run(
    settings: StoreAccess, project: str, args: list[str], on_progress: Progress | None
) -> dict[str, Any]:
    argv = [*_command(), "snapshot", "--json", "--project", project, *args]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=settings.env(),
    )
    assert process.stdout is not None and process.stderr is not None
    errors = asyncio.create_task(process.stderr.read())
    result: dict[str, Any] = {}
    try:
        async for raw in process.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # not ours (a library printing)
            if line.get("event") == "progress" and on_progress is not None:
                on_progress(line)
            elif line.get("event") == "done":
                result = line
        code = await process.wait()
    except BaseException:
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    stderr = (await errors).decode(errors="replace").strip()
    if code != 0 or not result:
        message = stderr.splitlines()[-1] if stderr else f"exit status {code}"
        raise SnapshotFailed(f"gpufleet snapshot {args[0]} failed: {message}")
    return result
