"""Snapshot passes and restores of one session, run as ``gpufleet snapshot`` processes.

The culler's live pass (in the controller) and the spawner's final pass and restore (in
the hub) run the command line in a process of its own: the work is heavy (reading,
hashing, compressing gigabytes) and must never hold up an event loop, and a process can
be given the session's identity and environment. Progress and results come back as JSON
lines (``--json``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import CullerError


class SnapshotFailed(CullerError):
    """A snapshot or restore process failed; the message carries its own explanation."""


@dataclass(frozen=True)
class Sources:
    """What a session's snapshot holds, as ``gpufleet snapshot create`` takes it."""

    paths: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    overlays: tuple[str, ...] = ()  # "upper[:merged]"
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Sources:
        return cls(
            tuple(raw.get("paths", ())),
            tuple(raw.get("prefixes", ())),
            tuple(raw.get("overlays", ())),
            tuple(raw.get("exclude", ())),
        )

    def to_json(self) -> dict[str, list[str]]:
        return {
            "paths": list(self.paths),
            "prefixes": list(self.prefixes),
            "overlays": list(self.overlays),
            "exclude": list(self.exclude),
        }

    def __bool__(self) -> bool:
        return bool(self.paths or self.prefixes or self.overlays)


@dataclass(frozen=True)
class SnapshotSettings:
    """Where snapshots go: the same settings the ``gpufleet snapshot`` command reads."""

    store: str
    key_file: str
    s3_endpoint: str = ""
    cache_dir: str = ""
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env}
        env["GPUFLEET_SNAPSHOT_STORE"] = self.store
        env["GPUFLEET_SNAPSHOT_KEY_FILE"] = self.key_file
        if self.s3_endpoint:
            env["GPUFLEET_S3_ENDPOINT"] = self.s3_endpoint
        return env


Progress = Callable[[dict[str, Any]], None]


def _command() -> list[str]:
    """This installation's ``gpufleet`` command (beside the running interpreter)."""
    beside = os.path.join(os.path.dirname(sys.executable), "gpufleet")
    found = beside if os.path.exists(beside) else shutil.which("gpufleet")
    if found is None:
        raise SnapshotFailed("the gpufleet command is not installed beside this Python")
    return [found]


async def create(
    settings: SnapshotSettings,
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
    settings: SnapshotSettings,
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
    settings: SnapshotSettings, project: str, user: str, server: str
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


async def _run(
    settings: SnapshotSettings, project: str, args: list[str], on_progress: Progress | None
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
