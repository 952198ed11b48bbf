"""Which GPUs each workload's processes really have, as node agents read them back.

On Kubernetes the controller admits a pod onto N GPUs of a node, but the pod asks only for
N of the cluster's GPU resource: NVIDIA's device plugin chooses which devices it gets. The
node agent reads the choice from the environment of the pod's processes
(``agent/placements.py``) and reports it per process marker; :meth:`ReadbackStore.
record_placements` then *re-seats* the workload's open allocations onto those GPUs, so
metrics, idle detection and the admin panel name the GPUs it really uses.

Rules (``plan_reseat`` decides, on plain values; the store applies the plan):

- A report is recorded only if it fits the admission: GPUs this controller knows, on the
  pod's node, as many as it was given, of its GPU type. Anything else changes nothing and
  is a ``gpu-readback-mismatch`` event that says what the agent saw and what was
  allocated, once per pod and distinct observation.
- A GPU the report names may be held, on record, by another pod of the node (the device
  plugin chose differently for two pods). That pod is moved too: onto what its own report
  says if the same report names it, else onto GPUs the reported pods left (of the same
  type; there are always enough, since each reported pod gives up as many as it takes),
  until its own processes are read back. Two pods reported with one GPU are both
  mismatches, as is a pod that claims a GPU whose holder's report matches it.
- Every pod moved is a ``gpus-read-back`` event naming its GPUs then and now; a report
  that matches the admission records nothing.

Allocations stay append-only history: a GPU a pod no longer has is closed now and the GPU
it has is opened now, with ``opened_at`` meaning what it means everywhere, the moment the
controller recorded the GPU as the pod's. The history then says what the controller knew
when. Backdating the new row to the admission would make rows of one GPU overlap in time
(its earlier holder's and this pod's), so that a GPU would be charged more hours than the
clock had. GPU-hours per project and user are unchanged: the pod holds as many GPUs as
before, without a gap. GPUs kept stay in their rows. All rows are closed before any is
opened, in one fenced transaction, so no moment has two open allocations of one GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from .base import Repository, _event
from .models import Allocation, Event, Gpu, Node, Workload, WorkloadState

# Workloads whose report is recorded: GPUs held and processes starting or running. A
# stopping workload's pods are going away; ended and pending ones hold nothing.
READ_BACK_STATES = (WorkloadState.admitted, WorkloadState.running)
MISMATCH = EventKind.GPU_READBACK_MISMATCH
READ_BACK = EventKind.GPUS_READ_BACK

# A pod of a workload: (workload id, pod index).
PodKey = tuple[int, int]


@dataclass(frozen=True)
class Placement:
    """What an agent read: the GPUs the processes carrying ``marker`` were given.

    ``marker`` is a workload's process marker, or one pod's (``<marker>.<pod index>``,
    ``recovery.processes.part_marker``); a bare marker is pod 0."""

    marker: str
    gpu_uuids: tuple[str, ...]


@dataclass(frozen=True)
class GpuFacts:
    node_id: int
    gpu_type: str
    index: int


@dataclass(frozen=True)
class Held:
    """One pod's open allocations, on record."""

    node_id: int
    gpu_type: str
    gpus: frozenset[str]


@dataclass(frozen=True)
class Mismatch:
    """Why a report fits no admission: ``reason`` for programs, ``why`` in words."""

    reason: str
    why: str


@dataclass(frozen=True)
class ReseatPlan:
    """The pods to move (their GPUs from now on), and the reports that fit no admission
    (why, in words)."""

    moves: dict[PodKey, frozenset[str]] = field(default_factory=dict)
    read_back: frozenset[PodKey] = frozenset()  # moved on their own report; else displaced
    mismatches: dict[PodKey, Mismatch] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadbackResult:
    reseated: tuple[int, ...]  # workloads whose allocations moved (the displaced included)
    mismatched: tuple[int, ...]  # workloads whose report changed nothing (said once)
    unknown: tuple[str, ...]  # markers of no workload this controller knows


def _names(uuids: Iterable[str]) -> str:
    return ", ".join(sorted(uuids)) or "none"


def _fit(seen: frozenset[str], held: Held, gpus: Mapping[str, GpuFacts]) -> Mismatch | None:
    """Why ``seen`` cannot be recorded for a pod that holds ``held``; None if it can."""
    unknown = [u for u in seen if u not in gpus]
    if unknown:
        return Mismatch("unknown-gpu", f"GPU(s) {_names(unknown)} are unknown to the controller")
    elsewhere = [u for u in seen if gpus[u].node_id != held.node_id]
    if elsewhere:
        return Mismatch("other-node", f"GPU(s) {_names(elsewhere)} are on another node")
    if len(seen) != len(held.gpus):
        return Mismatch("count", f"{len(seen)} GPU(s) seen, {len(held.gpus)} allocated")
    other_type = [u for u in seen if gpus[u].gpu_type != held.gpu_type]
    if other_type:
        return Mismatch("gpu-type", f"GPU(s) {_names(other_type)} are not {held.gpu_type}")
    return None


def plan_reseat(
    held: Mapping[PodKey, Held],
    seen: Mapping[PodKey, frozenset[str]],
    gpus: Mapping[str, GpuFacts],
) -> ReseatPlan:
    """Which pods move where so that every reported pod holds what its processes have.

    ``held``: every open allocation on the nodes concerned, per pod; ``seen``: the reported
    pods (of admitted or running workloads) and their GPUs; ``gpus``: what is known of the
    GPUs named in either.
    """
    mismatches: dict[PodKey, Mismatch] = {}
    accepted: dict[PodKey, frozenset[str]] = {}
    fixed: dict[str, PodKey] = {}  # GPUs of pods whose report matches their record
    for key in sorted(seen):
        record = held.get(key)
        if record is None:
            mismatches[key] = Mismatch("holds-none", "it holds no GPU")
        elif seen[key] == record.gpus:
            fixed.update(dict.fromkeys(record.gpus, key))
        elif (why := _fit(seen[key], record, gpus)) is not None:
            mismatches[key] = why
        else:
            accepted[key] = seen[key]
    claims: dict[str, list[PodKey]] = defaultdict(list)
    for key, uuids in accepted.items():
        for uuid in uuids:
            claims[uuid].append(key)
    for uuid, keys in sorted(claims.items()):
        for key in keys:
            others = [k for k in keys if k != key] + ([fixed[uuid]] if uuid in fixed else [])
            if others and key in accepted:
                del accepted[key]
                mismatches[key] = Mismatch(
                    "shared", f"GPU {uuid} is also seen in workload {others[0][0]}'s processes"
                )
    while True:
        moves, short = _moves(held, accepted, gpus)
        if not short:
            return ReseatPlan(moves, frozenset(accepted), mismatches)
        # Only with inconsistent records (a GPU whose type differs from its allocation's):
        # the reports that took what could not be given back are not recorded.
        for key in short:
            mismatches[key] = Mismatch(
                "no-exchange", "the GPUs it would leave do not fit the workload it displaces"
            )
            del accepted[key]


def _moves(
    held: Mapping[PodKey, Held],
    accepted: Mapping[PodKey, frozenset[str]],
    gpus: Mapping[str, GpuFacts],
) -> tuple[dict[PodKey, frozenset[str]], list[PodKey]]:
    """The moves for ``accepted``, and the accepted pods whose claims left a displaced pod
    short of GPUs (empty when the plan holds)."""
    taken = {uuid: key for key, uuids in accepted.items() for uuid in uuids}
    moves = dict(accepted)
    left: dict[tuple[int, str], list[str]] = defaultdict(list)  # (node, type) -> GPUs
    for key, uuids in accepted.items():
        for uuid in held[key].gpus - uuids:
            if uuid not in taken:
                left[(held[key].node_id, gpus[uuid].gpu_type)].append(uuid)
    for pool in left.values():
        pool.sort(key=lambda u: (gpus[u].index, u))
    short: list[PodKey] = []
    for key in sorted(held.keys() - accepted.keys()):
        lost = sorted(held[key].gpus & taken.keys())
        if not lost:
            continue
        replacements = []
        for uuid in lost:
            pool = left[(held[key].node_id, gpus[uuid].gpu_type)]
            if not pool:
                short.append(taken[uuid])
                continue
            replacements.append(pool.pop(0))
        moves[key] = (held[key].gpus - taken.keys()) | frozenset(replacements)
    return moves, sorted(set(short))


def split_marker(marker: str) -> tuple[str, int] | None:
    """(workload marker, pod index) of a reported marker; None if it cannot be one."""
    base, dot, part = marker.partition(".")
    if not dot:
        return base, 0
    return (base, int(part)) if part.isascii() and part.isdigit() else None


class ReadbackStore(Repository):
    def record_placements(
        self, now: datetime, agent: str, placements: Iterable[Placement]
    ) -> ReadbackResult:
        """Re-seat admitted and running workloads onto the GPUs their processes have (the
        module docstring has the rules), in one fenced transaction."""
        reports: dict[str, tuple[str, int, frozenset[str]]] = {}  # marker -> (base, pod, GPUs)
        unknown: list[str] = []
        for placement in placements:
            parsed = split_marker(placement.marker)
            if parsed is None:
                unknown.append(placement.marker)
            else:
                reports[placement.marker] = (*parsed, frozenset(placement.gpu_uuids))
        with self._write(now) as session:
            bases = {base for base, _, _ in reports.values()}
            workloads = {
                w.process_marker: w
                for w in session.scalars(select(Workload).where(Workload.process_marker.in_(bases)))
            }
            seen: dict[PodKey, frozenset[str]] = {}
            for marker, (base, pod, uuids) in sorted(reports.items()):
                workload = workloads.get(base)
                if workload is None:
                    unknown.append(marker)
                elif workload.state in READ_BACK_STATES:
                    seen[(workload.id, pod)] = uuids
            if not seen:
                return ReadbackResult((), (), tuple(sorted(unknown)))
            held, rows = _held(session, {w for w, _ in seen})
            gpus = _gpu_facts(session, {u for s in seen.values() for u in s} | set(rows))
            plan = plan_reseat(held, seen, gpus)
            reseated = _apply(session, now, agent, plan, held, rows, gpus)
            mismatched = _say_mismatches(session, now, agent, plan, held, seen)
        return ReadbackResult(reseated, mismatched, tuple(sorted(unknown)))


def _held(
    session: Session, workload_ids: set[int]
) -> tuple[dict[PodKey, Held], dict[str, Allocation]]:
    """Every open allocation on the nodes where ``workload_ids`` hold GPUs, per pod; and
    each of those allocations by GPU."""
    nodes = select(Allocation.node_id).where(
        Allocation.closed_at.is_(None), Allocation.workload_id.in_(workload_ids)
    )
    rows = session.scalars(
        select(Allocation).where(Allocation.closed_at.is_(None), Allocation.node_id.in_(nodes))
    ).all()
    gpus: dict[PodKey, set[str]] = defaultdict(set)
    first: dict[PodKey, Allocation] = {}
    for row in rows:
        key = (row.workload_id, row.pod_index)
        gpus[key].add(row.gpu_uuid)
        first.setdefault(key, row)
    held = {
        key: Held(first[key].node_id, first[key].gpu_type, frozenset(uuids))
        for key, uuids in gpus.items()
    }
    return held, {row.gpu_uuid: row for row in rows}


def _gpu_facts(session: Session, uuids: set[str]) -> dict[str, GpuFacts]:
    rows = session.execute(
        select(Gpu.uuid, Gpu.node_id, Gpu.gpu_type, Gpu.index).where(Gpu.uuid.in_(uuids))
    )
    return {uuid: GpuFacts(node_id, gpu_type, index) for uuid, node_id, gpu_type, index in rows}


def _apply(
    session: Session,
    now: datetime,
    agent: str,
    plan: ReseatPlan,
    held: Mapping[PodKey, Held],
    rows: Mapping[str, Allocation],
    gpus: Mapping[str, GpuFacts],
) -> tuple[int, ...]:
    """Close what each moved pod no longer has, then open what it has now; the events."""
    if not plan.moves:
        return ()
    template = {key: next(rows[u] for u in held[key].gpus) for key in plan.moves}
    for key, uuids in plan.moves.items():
        for uuid in held[key].gpus - uuids:
            rows[uuid].closed_at = now
    # Every GPU left is closed before any is opened: the unique index on open
    # allocations never sees one GPU twice, whatever order the moves come in.
    session.flush()
    for key, uuids in sorted(plan.moves.items()):
        old = template[key]
        for uuid in sorted(uuids - held[key].gpus):
            session.add(
                Allocation(
                    workload_id=old.workload_id,
                    gpu_uuid=uuid,
                    node_id=old.node_id,
                    pod_index=old.pod_index,
                    project_id=old.project_id,
                    username=old.username,
                    gpu_type=old.gpu_type,
                    opened_at=now,
                )
            )
    names = _node_names(session, {held[key].node_id for key in plan.moves})
    moved_by: dict[str, int] = {u: key[0] for key in plan.read_back for u in plan.moves[key]}
    for key, uuids in sorted(plan.moves.items()):
        workload = session.get_one(Workload, key[0])
        workload.version += 1  # its allocations are part of what the API shows
        was, node = held[key].gpus, names[held[key].node_id]
        data = {
            "pod": key[1],
            "node": node,
            "gpus": _by_index(uuids, gpus),
            "was": _by_index(was, gpus),
        }
        if key in plan.read_back:
            message = (
                f"workload {key[0]}'s processes have GPU(s) {_listed(uuids, gpus)} of {node}, "
                f"not {_listed(was, gpus)} as recorded: the node's device plugin chose them; "
                "recorded from now on"
            )
            reason = "read-back"
        else:
            takers = sorted({moved_by[u] for u in was - uuids})
            message = (
                f"workload {key[0]}'s GPU(s) {_listed(was - uuids, gpus)} of {node} are used "
                f"by workload(s) {', '.join(map(str, takers))}, whose processes have them; "
                f"recorded on {_listed(uuids - was, gpus)} until its own processes are read "
                "back"
            )
            reason = "displaced"
            data["by"] = takers
        _event(
            session,
            now,
            READ_BACK,
            message,
            reason=reason,
            cause=agent,
            workload=workload,
            node=node,
            data=data,
        )
    return tuple(sorted({key[0] for key in plan.moves}))


def _say_mismatches(
    session: Session,
    now: datetime,
    agent: str,
    plan: ReseatPlan,
    held: Mapping[PodKey, Held],
    seen: Mapping[PodKey, frozenset[str]],
) -> tuple[int, ...]:
    """A ``gpu-readback-mismatch`` event per pod and observation not said before."""
    if not plan.mismatches:
        return ()
    ids = {key[0] for key in plan.mismatches}
    said = {
        (e.workload_id, e.data.get("pod"), tuple(e.data.get("seen", ())))
        for e in session.scalars(
            select(Event).where(Event.kind == MISMATCH, Event.workload_id.in_(ids))
        )
    }
    names = _node_names(session, {h.node_id for h in held.values()})
    for key, mismatch in sorted(plan.mismatches.items()):
        observed = tuple(sorted(seen[key]))
        if (key[0], key[1], observed) in said:
            continue
        record = held.get(key)
        allocated = sorted(record.gpus) if record else []
        node = names.get(record.node_id) if record else None
        _event(
            session,
            now,
            MISMATCH,
            f"workload {key[0]}'s processes have GPU(s) {_names(observed)}, but "
            f"{_names(allocated)} {'is' if len(allocated) == 1 else 'are'} allocated"
            f"{f' on {node}' if node else ''}: {mismatch.why}; its allocations are left as "
            "they are",
            reason=mismatch.reason,
            cause=agent,
            workload=session.get_one(Workload, key[0]),
            node=node,
            data={"pod": key[1], "seen": list(observed), "allocated": allocated},
        )
    return tuple(sorted(ids))


def _node_names(session: Session, ids: set[int]) -> dict[int, str]:
    rows = session.execute(select(Node.id, Node.name).where(Node.id.in_(ids)))
    return {node_id: name for node_id, name in rows}


def _by_index(uuids: Iterable[str], gpus: Mapping[str, GpuFacts]) -> list[str]:
    return sorted(uuids, key=lambda u: (gpus[u].index if u in gpus else -1, u))


def _listed(uuids: Iterable[str], gpus: Mapping[str, GpuFacts]) -> str:
    """ "GPU-a (index 0), GPU-b (index 2)"."""
    return ", ".join(
        f"{u} (index {gpus[u].index})" if u in gpus else u for u in _by_index(uuids, gpus)
    )
