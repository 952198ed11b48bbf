"""Which GPUs each workload's processes were really given, read from their environment.

On Kubernetes the controller admits a session onto N GPUs of a node, but the pod only asks
for N of ``nvidia.com/gpu``: NVIDIA's device plugin chooses which devices the container
gets, and tells the container runtime in ``NVIDIA_VISIBLE_DEVICES`` (a comma list of GPU
UUIDs), which the container's processes inherit. The node agent reads that variable from
``/proc/<pid>/environ`` of each marked process of this machine and reports, per marker, the
UUIDs of GPUs it serves; the controller then records the workload on those GPUs
(``state/readback.py``), so metrics, idle detection and the admin panel name the
GPUs the workload really uses.

The functions here are pure: processes in, placements out (the adapter that reads /proc is
``recovery.processes.marked_process_details``; the loop is ``NodeAgent._placements``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..recovery.processes import (
    CONTAINER_VARIABLE,
    POD_NAME_VARIABLE,
    POD_NAMESPACE_VARIABLE,
    MarkedProcess,
    workload_marker,
)

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# Values that name no particular device: every GPU, none at all, or none and no driver
# files either. None of them says which GPU a workload holds.
NO_PARTICULAR_DEVICE = frozenset({"", "all", "none", "void"})
# "0", "3", or a MIG device by index "0:1".
_INDEX = re.compile(r"\d+(:\d+)?")


@dataclass(frozen=True)
class Conflict:
    """A later process of a marker whose ``NVIDIA_VISIBLE_DEVICES`` differs from the
    first one's (the first one's value is what counts)."""

    marker: str
    kept_pid: int
    kept: str | None
    other_pid: int
    other: str | None


@dataclass(frozen=True)
class Readback:
    """Per marker, the UUIDs of served GPUs its container was given; and the conflicts."""

    placements: dict[str, tuple[str, ...]]
    conflicts: tuple[Conflict, ...]


def visible_uuids(value: str | None, served: Collection[str]) -> tuple[str, ...]:
    """The GPUs an ``NVIDIA_VISIBLE_DEVICES`` value names, of those in ``served``.

    Only UUIDs are read. An index cannot be trusted: it is a position in one enumeration
    of the host's devices (NVML's, the device plugin's, CUDA's FASTEST_FIRST or PCI order)
    which do not agree with each other, which shifts when a GPU falls off the bus or the
    machine reboots with another set, and which containers renumber from 0 again. So a
    value that names any device by index is not read at all: reading only its UUIDs
    would report fewer GPUs than the container has. ``all``, ``none``, ``void`` and an
    empty value name no particular device. A UUID repeated counts once.
    """
    if value is None or value.strip().lower() in NO_PARTICULAR_DEVICE:
        return ()
    tokens = [token.strip() for token in value.split(",") if token.strip()]
    if any(_INDEX.fullmatch(token) for token in tokens):
        return ()
    return tuple(dict.fromkeys(token for token in tokens if token in served))


def read_placements(processes: Iterable[MarkedProcess], served: Collection[str]) -> Readback:
    """For each marker, the served GPUs named by its first process's environment.

    A marker's first process is the oldest (``started``, then the pid): the one its backend
    started, a container's init, whose environment the container runtime set. Its
    descendants inherit that environment, but any of them may start a child with another
    value; such a child does not change what the container was given, so its value only
    becomes a :class:`Conflict` for the log. A marker whose first process names no served
    GPU is left out.
    """
    first: dict[str, MarkedProcess] = {}
    conflicts: dict[str, Conflict] = {}
    ordered = sorted(processes, key=lambda p: (p.started, p.pid))
    seen: dict[str, tuple[str, ...]] = {}
    for process in ordered:
        uuids = visible_uuids(process.environ.get(VISIBLE_DEVICES), served)
        kept = first.setdefault(process.marker, process)
        if kept is process:
            seen[process.marker] = uuids
        elif uuids != seen[process.marker] and process.marker not in conflicts:
            conflicts[process.marker] = Conflict(
                process.marker,
                kept.pid,
                kept.environ.get(VISIBLE_DEVICES),
                process.pid,
                process.environ.get(VISIBLE_DEVICES),
            )
    return Readback(
        {marker: uuids for marker, uuids in seen.items() if uuids},
        tuple(conflicts.values()),
    )


@dataclass(frozen=True)
class PodIdentity:
    """The Kubernetes container holding a GPU, as its pod's environment names it."""

    pod: str
    namespace: str
    container: str


def pod_identities(
    processes: Iterable[MarkedProcess], served: Collection[str], holders: Mapping[str, str]
) -> dict[str, PodIdentity]:
    """GPU UUID → the pod whose container was given it, for the pods whose first process
    carries the pod variables (a Kubernetes pod gpufleet made; none on one machine).

    Only the workload holding a GPU (``holders``: UUID → its process marker, as the
    controller says) names its pod: a process may carry any marker and variables it likes,
    and must not relabel another's GPU."""
    ordered = sorted(processes, key=lambda p: (p.started, p.pid))
    first: dict[str, MarkedProcess] = {}
    for process in ordered:
        first.setdefault(process.marker, process)
    found = {}
    for marker, uuids in read_placements(ordered, served).placements.items():
        environ = first[marker].environ
        name = environ.get(POD_NAME_VARIABLE)
        if not name:
            continue
        identity = PodIdentity(
            name, environ.get(POD_NAMESPACE_VARIABLE, ""), environ.get(CONTAINER_VARIABLE, "")
        )
        holder = workload_marker(marker)
        found.update({uuid: identity for uuid in uuids if holders.get(uuid) == holder})
    return found


def changed_placements(
    now: Mapping[str, tuple[str, ...]], reported: Mapping[str, tuple[str, ...]] | None
) -> dict[str, tuple[str, ...]]:
    """What to send: everything when nothing is known to be reported (``reported`` None:
    the agent's start, a failed report, a controller that forgot this agent), else the
    markers that are new or whose GPUs changed. A marker that went away is not sent: its
    workload ends through its backend and the reconciler."""
    if reported is None:
        return dict(now)
    return {marker: uuids for marker, uuids in now.items() if reported.get(marker) != uuids}


def placements_body(placements: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """The body of ``POST /agent/placements``, in a stable order."""
    return {
        "placements": [
            {"marker": marker, "gpu_uuids": list(uuids)}
            for marker, uuids in sorted(placements.items())
        ]
    }


def served_uuids(inventory: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The UUIDs this agent registers (its registration body): whole GPUs, or the MIG
    slices of a GPU in MIG mode, as the device plugin hands them out."""
    return frozenset(str(gpu["uuid"]) for node in inventory for gpu in node["gpus"])
