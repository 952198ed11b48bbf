"""The reconciler's adapter: observe what runs, read the database, repair, record.

One pass (``Reconciler.run_once``), in this order (``hub/reconcile.py`` says why):
1. ``now`` is taken before anything is observed;
2. the hub's active servers, ``GET /users?state=active`` (paginated) with the
   controller's token (``list:users``, and ``admin:servers``, which holds
   ``read:servers``);
3. the live marked processes of this machine (``recovery.processes``): the local backend
   runs every session and job rank on the controller's machine;
4. the database, read last: every open workload, ended ones whose marker a live process
   still carries, and the last workload of each ready server with none open;
5. an open session whose server the list did not show is asked for alone
   (``GET /users/{name}``): offset pagination over a list that changes while it is read
   can skip a user, and a skipped server would look stopped;
6. ``reconcile(...)``; each repair is applied and recorded as a ``reconciled`` event:
   a workload is ended through the store (only at the version the decision saw), a
   server is stopped through the hub's API (``hub/stopper.py``, as the culler and
   preemption stop one) once a second look confirms it (still ready, still no open
   workload; its spawner then ends its processes and releases), processes
   are ended with ``processes.end_all`` (SIGTERM, then SIGKILL).

``settle_before_start`` answers the same question for one server at once, on the path of
a new request for it (``POST api/v1/sessions``, before the request opens): a server
stopped while the controller was down can be started again as soon as nothing of it
runs, not one pass and a grace later (``reconcile.before_start`` says why no grace and no
look at the hub are needed there).

Which processes belong to which workload: the controller records the marker
(``workloads.process_marker``), sent by the spawner with its request, rather than reading
it from the hub's spawner state (``GET /users?include_stopped_servers`` with
``admin:server_state``), because
- it is known before any process carries it: a starting server's processes are never
  taken for orphans, and a server whose hub died before it reported running is still
  recognised as that workload's;
- the hub clears a server's state when the server stops, which is exactly the server the
  reconciler looks for, and saves it only once a start has completed;
- the controller's hub scopes stay as they are (spawner state may hold other backends'
  secrets), and the record survives a hub that is down or lost its database;
- a Kubernetes backend records the same marker (a pod label there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from sqlalchemy import func, or_, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..recovery import processes
from ..scheduler.errors import InvalidRequest, LeaseLost, SchedulerError
from ..state.models import Event, Workload, WorkloadKind, WorkloadState
from ..state.reconcile import ReconcileStore
from .metrics import ControllerMetrics
from .notifier import Notifier
from .reconcile import (
    DeletePods,
    EndProcesses,
    EndWorkload,
    HubServer,
    MarkedProcess,
    Observed,
    RecordedWorkload,
    Repair,
    Rule,
    StopServer,
    before_start,
    reconcile,
)
from .stopper import ServerStopper

PAGINATION = "application/jupyterhub-pagination+json"


class ReconcilerState(Protocol):
    """What the reconciler uses of the database (``state.fleet.FleetStore``): its
    repairs' repository, and sessions to read the workloads it compares."""

    reconcile: ReconcileStore

    def read(self) -> Session: ...


class StartContext(Protocol):
    """What ``settle_before_start`` uses of the controller (``ControllerContext`` has it)."""

    metrics: ControllerMetrics
    notifier: Notifier
    log: logging.Logger

    @property
    def store(self) -> ReconcilerState: ...

    def now(self) -> datetime: ...

    def kick(self) -> None: ...

    async def live_pod_markers(self) -> frozenset[str] | None:
        """The markers of workloads with a pod in a Kubernetes cluster; None: unknown."""


class Reconciler:
    def __init__(
        self,
        store: ReconcilerState,
        metrics: ControllerMetrics,
        servers: ServerStopper,
        hub_api_url: str,
        hub_api_token: str,
        log: logging.Logger,
        clock: Callable[[], datetime],
        pods: Callable[[], Awaitable[frozenset[str] | None]] | None = None,
        delete_pods: Callable[[str], Awaitable[int]] | None = None,
    ):
        """``servers``: stops a server through the hub (``hub_api_url`` and its token are
        for reading the hub's servers); ``pods``: the markers of the workloads that have a
        pod in the fleet's Kubernetes clusters, None when some cluster cannot say (then the
        pass repairs nothing); ``delete_pods``: delete the pods carrying a marker, in every
        cluster (how many)."""
        self.pods = pods
        self.delete_pods = delete_pods
        self.store = store
        self.metrics = metrics
        self.servers = servers
        self.hub_api_url = hub_api_url.rstrip("/")
        self.headers = {"Authorization": f"token {hub_api_token}"}
        self.log = log
        self.clock = clock
        # One client for every pass: making one costs a TLS context, every pass.
        self._client = httpx.AsyncClient(timeout=30, headers=self.headers)

    async def close(self) -> None:
        await self._client.aclose()

    async def run_once(self, grace: timedelta) -> list[int]:
        """One pass; returns the workloads whose visible state changed.

        A pass that cannot see the hub's servers repairs nothing.
        """
        now = self.clock()
        client = self._client
        servers = await self._active_servers(client)
        if servers is None:
            return []
        pods = await self.pods() if self.pods is not None else frozenset()
        if pods is None:
            self.log.warning(
                "reconciler: a Kubernetes cluster cannot list its pods; nothing is "
                "repaired until every cluster answers"
            )
            return []
        marked = {
            pid: processes.workload_marker(found)
            for pid, found in (await asyncio.to_thread(processes.marked_processes)).items()
        }
        recorded = recorded_workloads(self.store, set(marked.values()) | pods)
        for username in sorted(_unseen_users(recorded, servers)):
            found = await self._servers_of_user(client, username)
            if found is None:
                return []
            servers.update(found)
        seen = {w.id for w in recorded}
        recorded += [
            w
            for w in last_workloads(self.store, _ready_without_open(recorded, servers))
            if w.id not in seen
        ]
        observed = Observed(
            servers=tuple(servers.values()),
            processes=tuple(MarkedProcess(pid, m) for pid, m in sorted(marked.items())),
            pods=pods,
        )
        repairs = reconcile(recorded, observed, now, grace)
        changed = await asyncio.gather(*(self._apply(client, r) for r in repairs))
        return [workload_id for workload_id in changed if workload_id is not None]

    # ----------------------------------------------------------- the hub's servers
    async def _active_servers(
        self, client: httpx.AsyncClient
    ) -> dict[tuple[str, str], HubServer] | None:
        servers: dict[tuple[str, str], HubServer] = {}
        offset = 0
        while True:
            response = await client.get(
                f"{self.hub_api_url}/users",
                params={"state": "active", "offset": offset},
                headers={"Accept": PAGINATION},
            )
            response.raise_for_status()
            page = response.json()
            for user in page["items"]:
                found = self._servers_in(user)
                if found is None:
                    return None
                servers.update(found)
            next_page = (page.get("_pagination") or {}).get("next")
            if not next_page:
                return servers
            offset = next_page["offset"]

    async def _servers_of_user(
        self, client: httpx.AsyncClient, username: str
    ) -> dict[tuple[str, str], HubServer] | None:
        response = await client.get(f"{self.hub_api_url}/users/{quote(username, safe='')}")
        if response.status_code == 404:
            return {}  # the user is gone, and with them every server
        response.raise_for_status()
        return self._servers_in(response.json())

    def _servers_in(self, user: dict[str, Any]) -> dict[tuple[str, str], HubServer] | None:
        """The user's active servers; None when the token may not read servers at all."""
        if "servers" not in user:
            self.log.error(
                "the hub does not show the controller its users' servers (the "
                "gpufleet-controller role needs admin:servers); reconciliation is off"
            )
            return None
        return {
            (user["name"], name): HubServer(user["name"], name, ready=bool(model.get("ready")))
            for name, model in user["servers"].items()
            if model.get("ready") or model.get("pending")
        }

    # ----------------------------------------------------------- repairs
    async def _apply(self, client: httpx.AsyncClient, repair: Repair) -> int | None:
        """Apply one repair and record it; returns the workload it ended, if any."""
        try:
            if isinstance(repair, EndWorkload):
                return self._end_workload(repair)
            if isinstance(repair, StopServer):
                await self._stop_server(client, repair)
            elif isinstance(repair, DeletePods):
                await self._delete_pods(repair)
            else:
                await self._end_processes(repair)
        except LeaseLost:
            self.log.warning("lost the database lease while reconciling; standing by")
        except (httpx.HTTPError, SQLAlchemyError, SchedulerError):
            self.log.exception("could not apply a repair: %s", repair.reason)
        return None

    def _end_workload(self, repair: EndWorkload) -> int | None:
        if not end_workload(self.store, self.metrics, self.log, self.clock(), repair):
            return None  # it changed since it was observed: the next pass looks again
        return repair.workload_id

    async def _stop_server(self, client: httpx.AsyncClient, repair: StopServer) -> None:
        """Stop the server, if it is still ready and (for a server without GPUs) still no
        workload is open for it: a user who just stopped and started it again keeps the
        new start."""
        found = await self._servers_of_user(client, repair.username) or {}
        server = found.get((repair.username, repair.server_name))
        if server is None or not server.ready:
            return  # it changed since it was observed: the next pass looks again
        if repair.rule is Rule.server_without_gpus and open_session_exists(
            self.store, repair.username, repair.server_name
        ):
            return
        outcome = await self.servers.stop(
            repair.username,
            repair.server_name,
            workload_id=repair.workload_id,
            message=repair.reason,
            by="reconciler",
            event=EventKind.RECONCILED,
            reason=repair.rule.value,
            data={
                "repair": "stop-server",
                "username": repair.username,
                "server_name": repair.server_name,
            },
        )
        if outcome.stopped:  # else logged with the hub's answer; the next pass looks again
            self._count(repair)

    async def _end_processes(self, repair: EndProcesses) -> None:
        gone = await processes.end_all(repair.marker)
        message = repair.reason
        if not gone:
            message += "; some survived SIGKILL (stuck in the kernel): an admin must look"
            self.log.error("reconciler: %s", message, extra={"workload": repair.workload_id})
        self.store.reconcile.record_reconciled(
            self.clock(),
            message,
            rule=repair.rule.value,
            workload_id=repair.workload_id,
            data={"repair": "end-processes", "pids": list(repair.pids), "all_gone": gone},
        )
        self._count(repair)

    async def _delete_pods(self, repair: DeletePods) -> None:
        if self.delete_pods is None:
            return
        deleted = await self.delete_pods(repair.marker)
        if not deleted:
            return  # gone since it was observed
        self.store.reconcile.record_reconciled(
            self.clock(),
            repair.reason,
            rule=repair.rule.value,
            workload_id=repair.workload_id,
            data={"repair": "delete-pods", "deleted": deleted},
        )
        self._count(repair)

    def _count(self, repair: Repair) -> None:
        _count(self.metrics, self.log, repair)


def _count(metrics: ControllerMetrics, log: logging.Logger, repair: Repair) -> None:
    metrics.repairs.labels(repair.rule.value).inc()
    log.warning(
        "reconciler: %s",
        repair.reason,
        extra={"rule": repair.rule.value, "workload": getattr(repair, "workload_id", None)},
    )


def end_workload(
    store: ReconcilerState,
    metrics: ControllerMetrics,
    log: logging.Logger,
    now: datetime,
    repair: EndWorkload,
) -> bool:
    """End the workload at the version the decision saw and record it; whether it ended."""
    ended = store.reconcile.end_reconciled(
        now, repair.workload_id, repair.version, repair.outcome, repair.rule.value, repair.reason
    )
    if ended is None:
        return False
    _count(metrics, log, repair)
    if ended.state == WorkloadState.ended:  # else a job back in the queue, as its next attempt
        metrics.ended.labels(ended.kind.value, repair.outcome).inc()
    return True


async def settle_before_start(controller: StartContext, username: str, server_name: str) -> None:
    """Before a new request for a server opens: end what its previous workloads still hold
    if nothing of them runs on this machine; else refuse the start.

    Called on the request's own path (``POST api/v1/sessions``), so a server stopped while
    the controller was down starts again at once rather than after the reconciler's next
    pass and its grace. Each end is a ``reconciled`` event, as the reconciler's own. Raises
    ``InvalidRequest`` saying what still runs and what to do; a pending request is left to
    the new one, which supersedes it.
    """
    store = controller.store
    recorded = [w for w in server_workloads(store, username, server_name) if w.state != "pending"]
    if not recorded:
        return  # the usual case: nothing to look at, no scan of /proc
    marked = await asyncio.to_thread(processes.marked_processes)
    pods = await controller.live_pod_markers()
    if pods is None:  # a cluster cannot say: any of them may still have a pod
        pods = frozenset(w.marker for w in recorded if w.marker)
    decision = before_start(
        recorded,
        (MarkedProcess(pid, processes.workload_marker(m)) for pid, m in sorted(marked.items())),
        pods,
    )
    ended = [
        end.workload_id
        for end in decision.ends
        if end_workload(store, controller.metrics, controller.log, controller.now(), end)
    ]
    if ended:
        controller.notifier.changed(ended)
        controller.kick()  # its GPUs may admit waiting requests
    if decision.refused is not None:
        raise InvalidRequest(decision.refused)


def recorded_workloads(
    store: ReconcilerState, live_markers: Iterable[str]
) -> list[RecordedWorkload]:
    """Every open workload, and the ended ones whose marker is in ``live_markers``."""
    markers = sorted(set(live_markers))
    with store.read() as session:
        rows = session.scalars(
            select(Workload)
            .where(
                or_(
                    Workload.state != WorkloadState.ended,
                    Workload.process_marker.in_(markers),
                )
            )
            .order_by(Workload.id)
        ).all()
        stopping = [w.id for w in rows if w.state == WorkloadState.stopping]
        last_event = _last_events(session, stopping)
    return [_recorded(w, last_event.get(w.id)) for w in rows]


def _last_events(session: Session, workload_ids: list[int]) -> dict[int, datetime]:
    """When each workload's latest event happened (a stop is decided with one)."""
    if not workload_ids:
        return {}
    return {
        workload_id: at
        for workload_id, at in session.execute(
            select(Event.workload_id, func.max(Event.at))
            .where(Event.workload_id.in_(workload_ids))
            .group_by(Event.workload_id)
        )
        if workload_id is not None
    }


def _recorded(w: Workload, last_event: datetime | None) -> RecordedWorkload:
    return RecordedWorkload(
        id=w.id,
        version=w.version,
        kind=w.kind.value,
        username=w.username,
        server_name=w.server_name,
        state=w.state.value,
        since=_since(w, last_event),
        marker=w.process_marker,
        outcome=w.outcome,
        snapshot_pending=w.snapshot_pending_since is not None,
    )


def last_workloads(
    store: ReconcilerState, servers: Iterable[tuple[str, str]]
) -> list[RecordedWorkload]:
    """The latest workload of each ``(username, server_name)``, if it has one."""
    found = []
    with store.read() as session:
        for username, server_name in sorted(set(servers)):
            last = session.scalar(
                select(Workload)
                .where(
                    Workload.kind == WorkloadKind.session,
                    Workload.username == username,
                    Workload.server_name == server_name,
                )
                .order_by(Workload.id.desc())
                .limit(1)
            )
            if last is not None:
                found.append(_recorded(last, None))
    return found


def server_workloads(
    store: ReconcilerState, username: str, server_name: str
) -> list[RecordedWorkload]:
    """The open workloads of one server (``username``'s ``server_name``)."""
    with store.read() as session:
        rows = session.scalars(
            select(Workload)
            .where(
                Workload.kind == WorkloadKind.session,
                Workload.username == username,
                Workload.server_name == server_name,
                Workload.state != WorkloadState.ended,
            )
            .order_by(Workload.id)
        ).all()
        stopping = [w.id for w in rows if w.state == WorkloadState.stopping]
        last_event = _last_events(session, stopping)
    return [_recorded(w, last_event.get(w.id)) for w in rows]


def open_session_exists(store: ReconcilerState, username: str, server_name: str) -> bool:
    with store.read() as session:
        found = session.scalar(
            select(Workload.id)
            .where(
                Workload.kind == WorkloadKind.session,
                Workload.username == username,
                Workload.server_name == server_name,
                Workload.state != WorkloadState.ended,
            )
            .limit(1)
        )
    return found is not None


def _since(workload: Workload, last_event: datetime | None) -> datetime:
    """When the workload entered its state; a stop is decided with an event, so a
    stopping workload's latest event is when it began stopping."""
    entered = {
        WorkloadState.pending: workload.created_at,
        WorkloadState.admitted: workload.admitted_at,
        WorkloadState.running: workload.started_at,
        WorkloadState.stopping: last_event,
        WorkloadState.ended: workload.ended_at,
    }[workload.state]
    return entered or workload.started_at or workload.admitted_at or workload.created_at


def _ready_without_open(
    recorded: Iterable[RecordedWorkload], servers: dict[tuple[str, str], HubServer]
) -> set[tuple[str, str]]:
    """Ready servers for which no workload is open."""
    open_keys = {
        (w.username, w.server_name) for w in recorded if w.kind == "session" and w.state != "ended"
    }
    return {key for key, server in servers.items() if server.ready and key not in open_keys}


def _unseen_users(
    recorded: Iterable[RecordedWorkload], servers: dict[tuple[str, str], HubServer]
) -> set[str]:
    """Users with an open session whose server the hub's list did not show."""
    return {
        w.username
        for w in recorded
        if w.kind == "session"
        and w.state in ("admitted", "running", "stopping")
        and (w.username, w.server_name) not in servers
    }
