"""What the cluster manager does about one cluster's job pods, decided without I/O.

Each pass of the manager (``clusters/kube_jobs.py``) lists the cluster's job pods, reads
each with :func:`read_pod`, and asks :func:`plan_pass` what to do, given the pods the store
asks for on the cluster's nodes (``DesiredPod``, from the last sync) and the leftovers it
must end there. The answer: the reports to sync (each pod's state as an agent would report
it), the gangs to create, the pods to delete, the leftover markers no pod carries any more
and the attempts whose shared objects can go.

The invariants it keeps:

- **All or nothing.** A gang is created whole or not at all (the adapter deletes what it
  made when one object is refused). A gang not running whole within ``start_deadline_s``
  of its creation is deleted whole; its pods are reported failed (``StartTimeout``, the
  reason naming what each waited for) only once none of them exists, so its GPUs never go
  back while a pod of it may still start.
- **No GPU released under a pod.** A pod is reported ended only when its phase is terminal
  (nothing of it runs) or it is gone from the API server. A pod being deleted by someone
  else is reported when it is gone, with the cause seen while it was going (``Deleted``,
  ``Evicted``). A pod of a lost node may never confirm its end: the inventory gives up on
  it after its grace (``JobStore.lose_cluster_node``), its GPUs held as leftovers until the
  cluster no longer has the pod.
- **Stacks before the stop.** A pod to stop whose ranks' stacks a trace awaits
  (``DesiredPod.trace``: a hang's, state/traces.py) is deleted once its node agent has
  taken them, or the trace's wait is over: a hang's stacks are those of the hang.
- **Failures first.** A pass's reports put the pods that failed before those stopped, so
  the job's reason and its classification are the first failure's.
- **Kept pods are the new attempt's.** A pod a restart keeps (``DesiredPod.kept``: its
  name is the attempt's that made it) counts as the new attempt's from the start: it is
  patched into it (``Pass.keep``) until its labels say so, never deleted as an earlier
  attempt's, and only the gang's other pods are created.

What a pod says becomes its report's ``cause`` in Kubernetes' own words: ``OOMKilled``
from the container's termination reason (never inferred from exit 137), ``Evicted``,
``DeadlineExceeded``, ``UnexpectedAdmissionError`` from the pod's; and gpufleet's:
``Deleted`` (by someone else), ``NodeLost`` (its node lost or deleted under it),
``StartTimeout``, ``CreateRefused``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..state.jobs import DesiredPod, PodReport
from .job_manifests import (
    ASSIGNMENT_ANNOTATION,
    ATTEMPT_LABEL,
    CONTAINER_NAME,
    POD_INDEX_LABEL,
    gang_name,
)
from .manifests import MARKER_LABEL, WORKLOAD_LABEL

DELETED = "Deleted"
NODE_LOST = "NodeLost"
START_TIMEOUT = "StartTimeout"
CREATE_REFUSED = "CreateRefused"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class ObservedPod:
    """One job pod as its API server has it."""

    name: str
    workload_id: int
    attempt: int
    index: int
    marker: str  # the pod's own part marker
    node: str  # where it is bound ('' while unscheduled)
    phase: str
    terminating: bool  # its deletion has begun; it may still run
    running: bool  # its container runs
    exit_code: int | None = None
    signal: int | None = None
    cause: str = ""  # Kubernetes' word for how it ended or is ending
    message: str = ""  # what it said, for the job's reason
    waiting: str = ""  # why it is not running yet, in words
    ip: str = ""  # its address, once it has one
    # Its launcher follows an assignment (a pod of an earlier gpufleet's does not).
    keepable: bool = False

    @property
    def ended(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def gang(self) -> tuple[int, int]:
        return self.workload_id, self.attempt


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _container_status(status: Mapping[str, Any]) -> Mapping[str, Any]:
    for container in status.get("containerStatuses") or ():
        if container.get("name") == CONTAINER_NAME:
            return dict(container)
    return {}


def _waiting_words(pod: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    """Why a pod is not running yet, as a person would want it said."""
    waiting = state.get("waiting") or {}
    if waiting.get("reason"):
        message = str(waiting.get("message") or "").strip()
        return f"{waiting['reason']}: {message}" if message else str(waiting["reason"])
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "not scheduled"
            return f"{reason}: {condition.get('message') or ''}".strip(": ")
    if not (pod.get("spec") or {}).get("nodeName"):
        return "not scheduled yet"
    return "its container has not started yet"


def read_pod(pod: Mapping[str, Any]) -> ObservedPod | None:
    """A job pod's reading; None for a pod that is not one of gpufleet's job pods."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    workload = _int(labels.get(WORKLOAD_LABEL))
    attempt = _int(labels.get(ATTEMPT_LABEL))
    index = _int(labels.get(POD_INDEX_LABEL))
    if workload is None or attempt is None or index is None:
        return None
    status = pod.get("status") or {}
    container = _container_status(status)
    state = container.get("state") or {}
    terminated = state.get("terminated") or {}
    phase = str(status.get("phase") or "Pending")
    exit_code = _int(terminated.get("exitCode"))
    signal = _int(terminated.get("signal")) or None
    cause = str(terminated.get("reason") or "")
    message = str(terminated.get("message") or "").strip()
    if cause in ("Completed", "Error"):
        cause = ""  # the exit code says it; these words add nothing
    if status.get("reason"):  # the pod's own: Evicted, DeadlineExceeded, NodeLost...
        cause = str(status["reason"])
        message = str(status.get("message") or "").strip() or message
    for condition in status.get("conditions") or ():
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            cause = cause or "DisruptionTarget"
            message = message or str(condition.get("message") or condition.get("reason") or "")
    return ObservedPod(
        name=str(metadata.get("name") or ""),
        workload_id=workload,
        attempt=attempt,
        index=index,
        marker=str((metadata.get("annotations") or {}).get(MARKER_LABEL) or ""),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        phase=phase,
        terminating=bool(metadata.get("deletionTimestamp")),
        running="running" in state,
        exit_code=exit_code,
        signal=signal,
        cause=cause,
        message=message,
        waiting="" if "running" in state or terminated else _waiting_words(pod, state),
        ip=str(status.get("podIP") or ""),
        keepable=ASSIGNMENT_ANNOTATION in (metadata.get("annotations") or {}),
    )


@dataclass
class GangMemory:
    """What the manager remembers of its cluster between passes. A restarted controller
    starts with none: pods that exist are read again, and a gang is created only for an
    attempt none of whose pods was ever reported running and none of which exists."""

    created_at: dict[tuple[int, int], float] = field(default_factory=dict)
    deleting: set[str] = field(default_factory=set)  # pods gpufleet asked to delete
    ending: dict[str, str] = field(default_factory=dict)  # pod → cause, deleted by others
    timed_out: dict[tuple[int, int], str] = field(default_factory=dict)
    refused: dict[tuple[int, int], str] = field(default_factory=dict)

    def forget_all_but(self, gangs: set[tuple[int, int]], pods: set[str]) -> None:
        for table in (self.created_at, self.timed_out, self.refused):
            for key in [k for k in table if k not in gangs]:
                del table[key]
        self.deleting &= pods
        for name in [n for n in self.ending if n not in pods]:
            del self.ending[name]


@dataclass
class Pass:
    """One pass's decisions (see the module docstring)."""

    reports: list[PodReport] = field(default_factory=list)
    create: list[tuple[int, int]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    orphan_gangs: list[str] = field(default_factory=list)
    # Kept pods still labelled with an earlier attempt: (gang, pod index, pod name).
    keep: list[tuple[tuple[int, int], int, str]] = field(default_factory=list)
    # Kept pods whose launcher cannot follow an assignment: deleted, the gang restarts.
    cannot_keep: list[str] = field(default_factory=list)
    # A gang's master address when its pod 0 is kept: that pod's (its name is an earlier
    # attempt's, under a Service that goes with it).
    masters: dict[tuple[int, int], str] = field(default_factory=dict)


def _report(pod: ObservedPod, attempt: int) -> PodReport:
    """The report of a pod of ``attempt`` whose phase is terminal."""
    if pod.exit_code is not None:
        said = ": ".join(part for part in (pod.cause, pod.message) if part)
        return PodReport(
            pod.workload_id,
            pod.index,
            "exited",
            exit_code=pod.exit_code,
            signal=pod.signal,
            reason=said,
            attempt=attempt,
            cause=pod.cause,
        )
    what = pod.cause or "Failed"
    return PodReport(
        pod.workload_id,
        pod.index,
        "failed",
        reason=f"{what}: {pod.message}" if pod.message else what,
        attempt=attempt,
        cause=pod.cause,
    )


def pod_name(want: DesiredPod) -> str:
    """The name of the pod ``want`` is: the attempt's that made it."""
    return f"{gang_name(want.workload_id, want.created_attempt or want.attempt)}-{want.pod_index}"


def _failed(want: DesiredPod, cause: str, reason: str) -> PodReport:
    return PodReport(
        want.workload_id, want.pod_index, "failed", reason=reason, attempt=want.attempt, cause=cause
    )


def _vanished(want: DesiredPod, memory: GangMemory, lost_nodes: Mapping[str, str]) -> PodReport:
    """The report of a pod that should run and is gone from the API server."""
    gang = (want.workload_id, want.attempt)
    name = pod_name(want)
    if gang in memory.refused:
        return _failed(want, CREATE_REFUSED, memory.refused[gang])
    if gang in memory.timed_out:
        return _failed(want, START_TIMEOUT, memory.timed_out[gang])
    if want.node in lost_nodes:
        return _failed(want, NODE_LOST, f"its node {want.node} {lost_nodes[want.node]}")
    cause = memory.ending.pop(name, DELETED)
    if cause == DELETED:
        return _failed(want, DELETED, f"pod {name} was deleted by someone other than gpufleet")
    if cause == CREATE_REFUSED:  # a pod gpufleet could not keep
        why = f"pod {name} could not be kept for the next attempt (see the controller's log)"
        return _failed(want, cause, f"{why}; it was deleted")
    return _failed(want, cause, f"pod {name} was ended by its cluster ({cause})")


def _start_deadline(
    pass_: Pass,
    gang: tuple[int, int],
    wanted: Sequence[DesiredPod],
    pods: Mapping[int, ObservedPod],
    memory: GangMemory,
    now: float,
    start_deadline_s: float,
) -> None:
    """Delete a gang not running whole within its deadline, saying what each pod waits for."""
    created = memory.created_at.get(gang)
    if created is None or gang in memory.timed_out or now - created < start_deadline_s:
        return
    waiting = [
        f"pod {w.pod_index} on {w.node}: {pods[w.pod_index].waiting or 'not created'}"
        for w in wanted
        if w.run
        and not w.started
        and not (w.pod_index in pods and (pods[w.pod_index].running or pods[w.pod_index].ended))
    ]
    if not waiting:
        return
    memory.timed_out[gang] = (
        f"the gang did not start whole within {start_deadline_s:.0f} s, so none of it runs "
        f"(it was deleted whole and its GPUs go back): {'; '.join(waiting)}"
    )
    for pod in pods.values():
        if not pod.ended and pod.name not in memory.deleting:
            pass_.delete.append(pod.name)
            memory.deleting.add(pod.name)


def _deleted_by_others(pod: ObservedPod, memory: GangMemory) -> bool:
    """Whether someone else deletes the pod. Its end, whatever status its ranks left on
    the SIGTERM, is then the deletion's, said once it is gone; but for a pod that had
    succeeded first."""
    succeeded = pod.ended and pod.exit_code == 0
    return pod.terminating and pod.name not in memory.deleting and not succeeded


def _to_create(
    gang: tuple[int, int],
    wanted: Sequence[DesiredPod],
    have: Mapping[int, ObservedPod],
    memory: GangMemory,
) -> bool:
    """Whether the gang is made now: none of its pods to create (all but the kept ones)
    was ever reported or exists, and it was neither made nor refused before."""
    new = [w for w in wanted if not w.kept]
    return (
        bool(new)
        and all(w.run and not w.started and w.pod_index not in have for w in new)
        and gang not in memory.created_at
        and gang not in memory.refused
    )


def _kept_pods(
    out: Pass,
    gang: tuple[int, int],
    wanted: Sequence[DesiredPod],
    by_name: Mapping[str, ObservedPod],
) -> dict[int, ObservedPod]:
    """The gang's pods kept from attempts before, by index; those still labelled with
    their own attempt are to be patched (``out.keep``), and pod 0's address is the
    master's (``out.masters``)."""
    found: dict[int, ObservedPod] = {}
    for want in wanted:
        pod = by_name.get(pod_name(want)) if want.kept else None
        if pod is None or pod.workload_id != want.workload_id:
            continue
        found[want.pod_index] = pod
        if pod.attempt < want.attempt and want.run and not pod.terminating:
            if pod.keepable:
                out.keep.append((gang, want.pod_index, pod.name))
            else:
                out.cannot_keep.append(pod.name)
        if want.pod_index == 0:
            out.masters[gang] = pod.ip
    return found


def plan_pass(
    desired: Iterable[DesiredPod],
    observed: Iterable[ObservedPod],
    leftovers: Iterable[str],
    gangs: Iterable[str],  # or a mapping whose keys are the names
    memory: GangMemory,
    now: float,
    start_deadline_s: float,
    lost_nodes: Mapping[str, str] | None = None,
) -> Pass:
    """One pass over a cluster (see the module docstring). ``leftovers``: part markers of
    pods the store gave up on whose GPUs stay held; ``gangs``: the names of the attempts'
    shared objects the cluster has; ``lost_nodes``: node → what its cluster says of it, for
    nodes that are not Ready or are deleted. Updates ``memory``."""
    lost = lost_nodes or {}
    out = Pass()
    by_gang: dict[tuple[int, int], list[DesiredPod]] = defaultdict(list)
    kept_wanted = []
    for want in desired:
        by_gang[(want.workload_id, want.attempt)].append(want)
        if want.kept:
            kept_wanted.append(want)
    pods: dict[tuple[int, int], dict[int, ObservedPod]] = defaultdict(dict)
    all_pods = list(observed)
    for pod in all_pods:
        pods[pod.gang][pod.index] = pod
    failed: list[PodReport] = []
    others: list[PodReport] = []

    def delete(pod: ObservedPod) -> None:
        if pod.name not in memory.deleting and not pod.terminating:
            out.delete.append(pod.name)
            memory.deleting.add(pod.name)

    by_name = {pod.name: pod for pod in all_pods}
    held: set[str] = set()  # the pods the gangs asked for hold, kept ones too
    for gang, wanted in sorted(by_gang.items()):
        have = {**pods.get(gang, {}), **_kept_pods(out, gang, wanted, by_name)}
        held.update(pod.name for pod in have.values())
        if _to_create(gang, wanted, have, memory):
            out.create.append(gang)
            continue
        _start_deadline(out, gang, wanted, have, memory, now, start_deadline_s)
        for want in sorted(wanted, key=lambda w: w.pod_index):
            found = have.get(want.pod_index)
            if found is None:
                if want.run:
                    failed.append(_vanished(want, memory, lost))
                else:
                    others.append(
                        PodReport(want.workload_id, want.pod_index, "stopped", attempt=gang[1])
                    )
            elif _deleted_by_others(found, memory):
                memory.ending.setdefault(found.name, found.cause or DELETED)
            elif found.ended:
                report = _report(found, gang[1])
                bad = report.state == "failed" or report.exit_code != 0
                (failed if bad and want.run else others).append(report)
            elif not want.run and want.trace is None:
                delete(found)  # (a pod whose stacks are awaited is deleted once they are in)
            elif found.running and not want.started:
                others.append(
                    PodReport(want.workload_id, want.pod_index, "running", attempt=gang[1])
                )
    out.reports = failed + others

    markers = set(leftovers)
    carried = {pod.marker for pod in all_pods}
    out.gone = sorted(markers - carried)
    for pod in all_pods:
        if pod.marker in markers or (pod.gang not in by_gang and pod.name not in held):
            delete(pod)  # a leftover, or of an attempt nothing asks for any more
    # A kept pod's volume still names the objects of the attempt that made it.
    live = set(by_gang) | set(pods) | {(w.workload_id, w.created_attempt) for w in kept_wanted}
    out.orphan_gangs = sorted(
        name for name in set(gangs) if name not in {gang_name(*g) for g in live}
    )
    memory.forget_all_but(set(by_gang), {pod.name for pod in all_pods})
    return out
