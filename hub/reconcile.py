"""The reconciler's pure core: what the database records against what really runs.

``reconcile(recorded, observed, now, grace) -> tuple[Repair, ...]`` takes plain data and
does no I/O; ``hub/reconciler.py`` observes (the hub's servers, the marked processes of
this machine), reads the database, calls it and applies the repairs.

The rules (the table with examples is in docs/reconciler.md):
- ``session-lost``: a session holds GPUs (admitted, running), the hub runs no server for
  it and no process of it is alive: end it as ``lost``, releasing its GPUs — unless its
  final snapshot is pending (its spawner retries it; the GPUs wait for it).
- ``stop-finished``: a workload is stopping and nothing of it runs: end it as ``stopped``.
- ``stray-processes``: as either of those, but processes of it are still alive: end them
  (the next pass releases the GPUs).
- ``stop-overdue``: a session is stopping but the hub still runs its server, ready: stop
  the server through the hub.
- ``server-without-gpus``: the hub runs a ready server for which no workload is open:
  stop it through the hub.
- ``orphan-processes``: live processes carry the marker of an ended workload: end them.
- ``orphan-pods``: a pod of an ended workload still exists in a Kubernetes cluster (its
  hub lost track of it: a hub restored from an old state, a stop that never reached the
  cluster): delete it, so that its processes stop using GPUs the scheduler gave others.

Invariants:
- No GPU is released while anything of its workload may still run: a workload is ended
  only when its process marker is known, no live process carries it and no pod of it
  exists in the fleet's Kubernetes clusters (``Observed.pods``: a pod on a node that
  does not answer may still run). A workload whose marker is unknown (recorded before
  markers were) is never ended here.
- Only processes whose marker this database knows are touched. A marker it does not know
  belongs to another deployment on the same machine (or to a job rank before jobs are
  recorded) and is left alone.
- A discrepancy is repaired only once the workload has been in its state (ended, for an
  orphan or a server without GPUs) for longer than ``grace``, so the normal paths (a
  spawn, a stop, a release) finish first; the hub, for one, shows a server whose queued
  spawn was just cancelled as ready for a moment while it tears it down. A ready server
  for which the database has no workload at all is stopped at once.
- The caller takes ``now`` before observing anything and reads the database last, so a
  workload that changed while the world was observed is younger than ``now`` and left
  for the next pass; it applies a repair only to the workload ``version`` it carries.

``before_start(recorded, processes) -> BeforeStart`` decides the same question for one
server at once, when its spawner asks for GPUs for it again while the database still
holds GPUs for its previous start (the controller was down when the server stopped, so
the release never arrived). There the hub is starting that very server, and it runs one
instance of a server at a time, so the previous one is not running in the hub: only its
processes are looked at, and no grace applies (the stop that would have finished first
has finished). A workload with nothing alive is ended as the reconciler would end it; one
with live processes, or whose marker is unknown, or whose final snapshot is still being
retried, refuses the new start and says why.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

State = Literal["pending", "admitted", "running", "stopping", "ended"]
Kind = Literal["session", "job"]
HOLDING_GPUS: frozenset[State] = frozenset({"admitted", "running"})


class Rule(enum.StrEnum):
    """Why a repair was made; the ``reason`` of its event and a metric label."""

    session_lost = "session-lost"
    stop_finished = "stop-finished"
    stray_processes = "stray-processes"
    stop_overdue = "stop-overdue"
    server_without_gpus = "server-without-gpus"
    orphan_processes = "orphan-processes"
    orphan_pods = "orphan-pods"


@dataclass(frozen=True)
class RecordedWorkload:
    """A workload as the database records it: every open one, the ended ones whose
    marker a live process still carries, and the last one of each server the hub runs
    with none open."""

    id: int
    version: int
    kind: Kind
    username: str
    server_name: str
    state: State
    since: datetime  # when it entered ``state``
    marker: str | None  # None: recorded before markers were; nothing can be proved gone
    outcome: str | None = None  # how it ended, for an ended one
    # Stopped, its final snapshot not committed yet: its spawner retries, its GPUs stay.
    snapshot_pending: bool = False


@dataclass(frozen=True)
class HubServer:
    """A server the hub lists as active; a server it does not list is stopped."""

    username: str
    server_name: str
    ready: bool  # False: starting, stopping or being checked (pending)


@dataclass(frozen=True)
class MarkedProcess:
    pid: int
    marker: str


@dataclass(frozen=True)
class Observed:
    servers: tuple[HubServer, ...]
    processes: tuple[MarkedProcess, ...]
    # The markers of workloads that have a pod in one of the fleet's Kubernetes clusters:
    # something of them may still run there (on a node this machine cannot look into).
    pods: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EndWorkload:
    """End the workload in the database, closing its allocations (GPUs released)."""

    workload_id: int
    version: int
    outcome: str
    rule: Rule
    reason: str


@dataclass(frozen=True)
class StopServer:
    """Stop the server through the hub's API (its spawner ends its processes)."""

    username: str
    server_name: str
    workload_id: int | None
    rule: Rule
    reason: str


@dataclass(frozen=True)
class EndProcesses:
    """End every process carrying ``marker`` (``processes.end_all``); ``pids`` as seen."""

    marker: str
    pids: tuple[int, ...]
    workload_id: int
    rule: Rule
    reason: str


@dataclass(frozen=True)
class DeletePods:
    """Delete every pod of gpufleet's carrying ``marker``, in every cluster."""

    marker: str
    workload_id: int
    rule: Rule
    reason: str


Repair = EndWorkload | StopServer | EndProcesses | DeletePods


def reconcile(
    recorded: Iterable[RecordedWorkload],
    observed: Observed,
    now: datetime,
    grace: timedelta,
) -> tuple[Repair, ...]:
    """The repairs that bring the database and what runs back together, in a fixed order:
    open workloads by id, then servers by user and name, then orphans by workload id."""
    workloads = sorted(recorded, key=lambda w: w.id)
    servers = {(s.username, s.server_name): s for s in observed.servers}
    pids_of: dict[str, list[int]] = defaultdict(list)
    for process in observed.processes:
        pids_of[process.marker].append(process.pid)
    open_workloads = [w for w in workloads if w.state != "ended"]
    ended = [w for w in workloads if w.state == "ended"]
    open_servers = {_key(w) for w in open_workloads if w.kind == "session"}
    open_markers = {w.marker for w in open_workloads if w.marker}

    repairs: list[Repair] = []
    for workload in open_workloads:
        server = servers.get(_key(workload)) if workload.kind == "session" else None
        pids = tuple(sorted(pids_of.get(workload.marker or "", ())))
        if workload.marker in observed.pods:
            continue  # its pod still exists: its GPUs stay held until the pod is gone
        repair = _check_open(workload, server, pids, now, grace)
        if repair is not None:
            repairs.append(repair)
    for key, server in sorted(servers.items()):
        if server.ready and key not in open_servers:
            last = max((w for w in ended if _key(w) == key), key=lambda w: w.id, default=None)
            if last is None or now - last.since > grace:
                repairs.append(_server_without_gpus(server, last))
    owner_of = {w.marker: w for w in ended if w.marker and w.marker not in open_markers}
    for marker, workload in sorted(owner_of.items(), key=lambda item: item[1].id):
        pids = tuple(sorted(pids_of.get(marker, ())))
        has_pod = marker in observed.pods
        if not (pids or has_pod) or now - workload.since <= grace:
            continue
        key = _key(workload)
        if workload.kind == "session" and key in servers and key not in open_servers:
            continue  # the hub still lists its server: stopping that ends them
        if has_pod:
            repairs.append(
                DeletePods(
                    marker,
                    workload.id,
                    Rule.orphan_pods,
                    f"a pod of workload {workload.id}, which ended "
                    f"({workload.outcome or 'ended'}) {_seconds(now - workload.since)} ago, "
                    "still exists; deleting it",
                )
            )
        if not pids:
            continue
        repairs.append(
            EndProcesses(
                marker,
                pids,
                workload.id,
                Rule.orphan_processes,
                f"found {_processes(pids)} with the marker of workload {workload.id}, "
                f"which ended ({workload.outcome or 'ended'}) {_seconds(now - workload.since)} "
                "ago; ending them",
            )
        )
    return tuple(repairs)


def _check_open(
    workload: RecordedWorkload,
    server: HubServer | None,
    pids: Sequence[int],
    now: datetime,
    grace: timedelta,
) -> Repair | None:
    age = now - workload.since
    label = _label(workload)
    if workload.state == "stopping":
        if server is not None:
            if server.ready and age > grace:
                return StopServer(
                    workload.username,
                    workload.server_name,
                    workload.id,
                    Rule.stop_overdue,
                    f"workload {workload.id} has been stopping for {_seconds(age)} but the "
                    f"hub still runs {label}; stopping the server",
                )
            return None  # the hub is stopping it
        gone = f"workload {workload.id} is stopping"
    elif workload.state in HOLDING_GPUS and workload.kind == "session":
        if server is not None or workload.snapshot_pending:
            return None
        gone = f"the hub no longer runs {label}"
    else:
        # Pending holds nothing; a job's ranks are watched by its runner, not the hub.
        return None
    if workload.marker is None or age <= grace:
        return None
    if pids:
        return EndProcesses(
            workload.marker,
            tuple(pids),
            workload.id,
            Rule.stray_processes,
            f"{gone} but found {_processes(pids)} of workload {workload.id} alive; ending "
            "them before its GPUs are released",
        )
    if workload.state == "stopping":
        return EndWorkload(
            workload.id,
            workload.version,
            "stopped",
            Rule.stop_finished,
            f"{gone} and nothing of it runs any more; its GPUs are released",
        )
    return EndWorkload(
        workload.id,
        workload.version,
        "lost",
        Rule.session_lost,
        f"{gone} and no process of workload {workload.id} is alive; its GPUs are released",
    )


def _server_without_gpus(server: HubServer, last: RecordedWorkload | None) -> StopServer:
    label = f"server {server.server_name or '(default)'} of {server.username}"
    if last is not None:
        reason = (
            f"the hub runs {label} but its workload {last.id} ended "
            f"({last.outcome or 'ended'}); stopping the server, which holds no GPUs any more"
        )
    else:
        reason = f"the hub runs {label} but no workload holds GPUs for it; stopping the server"
    return StopServer(
        server.username,
        server.server_name,
        last.id if last is not None else None,
        Rule.server_without_gpus,
        reason,
    )


def _key(workload: RecordedWorkload) -> tuple[str, str]:
    return (workload.username, workload.server_name)


def _label(workload: RecordedWorkload) -> str:
    return f"server {workload.server_name or '(default)'} of {workload.username}"


def _processes(pids: Sequence[int]) -> str:
    listed = ", ".join(str(pid) for pid in pids)
    return f"process {listed}" if len(pids) == 1 else f"{len(pids)} processes ({listed})"


def _seconds(age: timedelta) -> str:
    return f"{int(age.total_seconds())} s"


# ------------------------------------------------------------------ a new start


@dataclass(frozen=True)
class BeforeStart:
    """What a new start of a server does with its previous workloads: end them, and
    refuse the start (``refused`` is the message) if one may still run."""

    ends: tuple[EndWorkload, ...]
    refused: str | None = None


def before_start(
    recorded: Iterable[RecordedWorkload],
    processes: Iterable[MarkedProcess],
    pods: frozenset[str] = frozenset(),
) -> BeforeStart:
    """The open workloads of the one server being started again, and the live marked
    processes of this machine, against a new request for that server.

    A pending request (and an admitted one with nothing alive) is left to the new
    request, which supersedes it; ``refused`` names the first workload that blocks it.
    """
    pids_of: dict[str, list[int]] = defaultdict(list)
    for process in processes:
        pids_of[process.marker].append(process.pid)
    ends: list[EndWorkload] = []
    refusals: list[str] = []
    for workload in sorted(recorded, key=lambda w: w.id):
        if workload.kind != "session" or workload.state in ("pending", "ended"):
            continue
        pids = tuple(sorted(pids_of.get(workload.marker or "", ())))
        held = f"{_label(workload)} still holds GPUs as workload {workload.id} ({workload.state})"
        if pids:
            refusals.append(
                f"{held}: {_processes(pids)} of it {'is' if len(pids) == 1 else 'are'} "
                "still alive on this machine, though the hub no longer runs the server. "
                "The reconciler ends such processes and then releases the GPUs; start the "
                "server again once it has (its next passes), or end the processes first"
            )
        elif workload.marker is not None and workload.marker in pods:
            refusals.append(
                f"{held}: its pod still exists in its Kubernetes cluster (its node may not "
                "answer), though the hub no longer runs the server. Its GPUs are released "
                "once the pod is gone; start the server again then, or ask the cluster's "
                "admin to delete the pod"
            )
        elif workload.state == "admitted":
            continue  # nothing of it runs: the new request supersedes it
        elif workload.snapshot_pending:
            refusals.append(
                f"{held}: the final snapshot of its last session is still being retried, "
                "and its GPUs are kept until it is saved; start the server again once it "
                f"is, or ask an admin to release workload {workload.id}"
            )
        elif workload.marker is None:
            refusals.append(
                f"{held} and started before process markers were recorded, so nothing "
                f"proves it gone; ask an admin to release workload {workload.id}, then "
                "start the server again"
            )
        else:
            stopping = workload.state == "stopping"
            ends.append(
                EndWorkload(
                    workload.id,
                    workload.version,
                    "stopped" if stopping else "lost",
                    Rule.stop_finished if stopping else Rule.session_lost,
                    f"a new start of {_label(workload)} found workload {workload.id} still "
                    f"{workload.state} although the hub no longer runs the server, and no "
                    f"process of it is alive; its GPUs are released",
                )
            )
    return BeforeStart(tuple(ends), refusals[0] if refusals else None)
