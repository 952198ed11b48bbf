"""Which container's layer a snapshot of a Kubernetes session reads on this node.

The session's container is found from its processes: the oldest one carrying the
session's marker is the container's first, and its mount table names the container's
overlay (``gpufleet.snapshotter.node_operations.process_layer`` reads and checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..recovery.processes import marked_process_details
from ..snapshotter.node_operations import process_layer


def find_container_layer(
    marker: str, roots: Sequence[str], proc: Path = Path("/proc")
) -> str | None:
    """The upper directory of the container whose processes carry ``marker``; None when
    no such process runs here or its layer is not an overlay. Raises
    :class:`~gpufleet.snapshotter.node_operations.LayerRefused` for a layer that is not
    provably that container's own (outside ``roots``, the runtime's directories, or not
    what the container sees). Blocking."""
    if not marker:
        return None
    mine = [p for p in marked_process_details((), proc) if p.marker == marker]
    if not mine:
        return None
    first = min(mine, key=lambda p: (p.started, p.pid))
    return process_layer(first.pid, roots, proc)
