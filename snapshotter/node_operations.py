"""Node operations the agent runs for the controller: snapshot passes and restores of a
Kubernetes session's files, on the node where they are (``state/operations.py``).

The agent holds the snapshot master key, as the hub and the controller do; a user's pod
never does. It reads the session's hostPath volumes where the hub said they are, and what
the container changed outside them from the container's overlay upper directory, found
from the session's own processes: the oldest process carrying the session's marker is the
container's first (the agent finds it: ``agent/layers.py``), and its mount table names the
overlay its root (a container runtime's image layers: containerd, CRI-O, Docker) or its
top-level directories (gpufleet's own sandbox, one overlay layer per directory) are
mounted from. A container whose layer is not an overlay on this node (another
snapshotter, a VM runtime) is reported as such: its volumes are still snapshotted.

The functions here are pure but for ``process_layer`` (reads /proc) and
``run_operation`` (runs ``gpufleet snapshot``).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import runner as snapshots
from .settings import StoreAccess


@dataclass(frozen=True)
class OverlayMount:
    mount_point: str
    upper: str


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def overlay_mounts(mountinfo: str) -> list[OverlayMount]:
    """The overlay mounts of a mount table (``/proc/<pid>/mountinfo``) that name an upper
    directory, in the table's order."""
    found = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] != "overlay":
            continue
        for option in tail[2].split(","):
            if option.startswith("upperdir="):
                found.append(OverlayMount(_unescape(fields[4]), _unescape(option[9:])))
    return found


def container_layer(mounts: Sequence[OverlayMount]) -> str | None:
    """The upper directory holding what a container changed, as an overlay source of a
    snapshot takes it (its ``usr/...`` is what the container changed in ``/usr``):

    - a runtime's overlay root: the upper directory of the mount at ``/``;
    - a root of one overlay per top-level directory (``/usr`` from ``<dir>/usr``, ``/etc``
      from ``<dir>/etc``): ``<dir>``, when every such layer shares it.

    None when neither is there."""
    for mount in mounts:
        if mount.mount_point == "/":
            return mount.upper
    layers = [
        m
        for m in mounts
        if m.mount_point.count("/") == 1
        and posixpath.basename(m.upper) == m.mount_point[1:]
        and m.upper.startswith("/")
    ]
    parents = {posixpath.dirname(m.upper) for m in layers}
    if len(parents) == 1:
        return parents.pop()
    return None


class LayerRefused(Exception):
    """The mount table names an upper directory the agent will not read; says why."""


def process_layer(pid: int, roots: Sequence[str], proc: Path = Path("/proc")) -> str | None:
    """The upper directory of the container whose first process is ``pid``, read from that
    process's mount table; None when the process is gone or its layer is not an overlay.
    Raises :class:`LayerRefused` for a layer that is not provably that container's own.

    The mount table is the kernel's, but of the user's mount namespace: a user may mount
    an overlay of their own (in a user namespace) whose ``upperdir`` names, as a string, a
    path that on the host is someone else's (another container's layer, ``/etc``). Read
    from the host, that path would put another's files into this user's snapshot. So the
    upper directory is read only if, from the host's view, it is under ``roots`` (the
    container runtime's directories) and really lies under what the container sees: a
    probe file made there appears at the same place through the process's own root.
    """
    try:
        table = (proc / str(pid) / "mountinfo").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    mounts = overlay_mounts(table)
    layer = container_layer(mounts)
    if layer is None:
        return None
    real = os.path.realpath(layer)
    if not any(_is_under(real, root) for root in roots):
        raise LayerRefused(
            f"the container's upper directory {layer} is under none of the runtime's "
            f"directories ({', '.join(roots) or 'none configured'}: "
            "c.NodeAgent.container_layer_roots)"
        )
    probed = [m.mount_point for m in mounts if m.mount_point == "/"] or [
        m.mount_point for m in mounts if posixpath.dirname(m.upper) == layer
    ][:1]
    root_of_process = proc / str(pid) / "root"
    if not probed or not _shows_through(real, probed[0], root_of_process):
        raise LayerRefused(
            f"the upper directory {layer} named by the container's mount table is not what "
            "the container sees"
        )
    return real


def _is_under(path: str, root: str) -> bool:
    root = os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _shows_through(upper: str, mount_point: str, process_root: Path) -> bool:
    """Whether a file made in ``upper`` (its part for ``mount_point``) shows at
    ``mount_point`` through the process's root. Blocking."""
    name = f".gpufleet-layer-probe-{secrets.token_hex(8)}"
    part = upper if mount_point == "/" else os.path.join(upper, mount_point.lstrip("/"))
    probe = os.path.join(part, name)
    try:
        descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    os.close(descriptor)
    try:
        seen = str(process_root) + mount_point.rstrip("/") + "/" + name
        return os.path.lexists(seen)
    finally:
        os.unlink(probe)


def prepare_volume(path: str, owner: Sequence[int] | None) -> None:
    """Make a session's volume directory that is not there yet (a user's first session on
    this node), owned by the session's user, so that the pod's hostPath finds it."""
    if os.path.lexists(path):
        return
    os.makedirs(path, mode=0o700)
    if owner:
        os.chown(path, int(owner[0]), int(owner[1]))


Report = Callable[[dict[str, Any]], None]
# The container layer of the session whose processes carry a marker (None: not found
# here); raises LayerRefused. Blocking.
LayerFinder = Callable[[str], str | None]


async def run_operation(
    kind: str,
    request: Mapping[str, Any],
    settings: StoreAccess,
    on_progress: Report,
    find_layer: LayerFinder,
) -> dict[str, Any]:
    """Run one operation; its result. Raises ``snapshots.SnapshotFailed``."""
    project, user, server = request["project"], request["username"], request["server"]
    paths = [str(p) for p in request.get("paths", ())]
    if kind == "restore":
        restored = await snapshots.restore_missing(
            settings, project, user, server, within=set(paths), on_progress=on_progress
        )
        for path in paths:
            await asyncio.to_thread(prepare_volume, path, request.get("owner"))
        if restored is None:
            return {"restored": []}
        return {
            "id": restored.snapshot_id,
            "created_at": restored.created_at,
            "restored": list(restored.sources),
            "seconds": restored.seconds,
            "notice": restored.notice(),
        }
    present = [p for p in paths if await asyncio.to_thread(os.path.isdir, p)]
    overlays: tuple[str, ...] = ()
    layer_note = ""
    if request.get("container"):
        try:
            layer = await asyncio.to_thread(find_layer, str(request.get("marker", "")))
        except LayerRefused as e:
            layer, layer_note = None, f"the container's layer was not read: {e}"
        if layer is not None:
            overlays = (layer,)
        elif not layer_note:
            layer_note = (
                "the container's layer was not found on this node (not running, or not an overlay)"
            )
    sources = snapshots.Sources(
        paths=tuple(present), overlays=overlays, exclude=tuple(request.get("exclude", ()))
    )
    if not sources:
        return {"skipped": "nothing of the session is on this node", "container": layer_note}
    result = await snapshots.create(
        settings,
        project,
        user,
        server,
        sources,
        tags=tuple(request.get("tags", ())),
        on_progress=on_progress,
    )
    return {**result, "container": layer_note or (overlays[0] if overlays else "")}
