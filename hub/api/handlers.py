"""REST API v1 of the fleet controller; the route table also feeds the OpenAPI document."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from ...api import schemas
from ...api.events import EventOut
from ...scheduler.validation import SessionRequest
from ...state.catalogue import catalogue_of, projects_of
from ...state.inventory import GpuSpec, NodeSpec
from ...state.models import (
    Allocation,
    Event,
    Node,
    Profile,
    Project,
    Workload,
    WorkloadKind,
    Zone,
)
from ...state.readback import Placement
from .. import scopes
from ..errors import BadRequest, Forbidden, NotFoundError
from ..reconciler import settle_before_start
from ..timed import TimedJob, when
from .accounts import account_routes
from .base import APIHandler, store_errors_as_http
from .jobs import job_routes
from .node_operations import node_operation_routes
from .projects import project_routes
from .sessions import session_routes
from .traces import trace_routes
from .views import MAX_WAIT_SECONDS, listing, load_workload, page, workload_out

if TYPE_CHECKING:
    from ..context import ControllerContext


class InfoHandler(APIHandler):
    async def get(self) -> None:
        self.send(
            {
                "service": "gpufleet",
                "api": "v1",
                "version": self.controller.version,
                "leader": self.controller.is_leader,
            }
        )


class ReadyHandler(APIHandler):
    """``GET /ready``: 200 while this controller holds the database lease (it decides and
    writes), 503 while it stands by: a Kubernetes readiness probe keeps the standing-by
    one out of its Service."""

    async def get(self) -> None:
        leader = self.controller.is_leader
        self.send({"leader": leader}, status=200 if leader else 503)


class OpenAPIHandler(APIHandler):
    async def get(self) -> None:
        from ..openapi import openapi_document

        self.send(openapi_document(self.controller.version))


class SessionsHandler(APIHandler):
    async def post(self) -> None:
        self.require(scopes.SPAWN)
        body = self.body(schemas.SessionRequestIn)
        request = SessionRequest(
            username=body.username,
            server_name=body.server_name,
            project=body.project,
            gpu_type=body.gpu_type,
            gpus=body.gpus,
            profile=body.profile,
        )
        await self.controller.refresh_memberships(max_age=5.0)
        if self.get_query_argument("dry_run", "") in ("1", "true"):
            with store_errors_as_http():
                self.controller.store.workloads.check_session_request(request)
            self.send({"valid": True})
            return
        with store_errors_as_http():
            # A server stopped while the controller was down may still hold GPUs here:
            # settled at once when nothing of it runs (docs/reconciler.md).
            await settle_before_start(self.controller, request.username, request.server_name)
            workload = self.controller.store.workloads.open_session_request(
                self.controller.now(), request, self.controller.request_lease
            )
            if body.process_marker:
                # Before the answer: no process carries the marker until the spawner has it.
                self.controller.store.reconcile.record_process_marker(
                    self.controller.now(), workload.id, body.process_marker
                )
        self.controller.kick()
        with self.controller.store.read() as session:
            self.send(workload_out(load_workload(session, workload.id)), status=201)


class WorkloadsHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        offset = self.int_argument("offset", 0, 0, 10**9)
        limit = self.int_argument("limit", 100, 1, 1000)
        username = self.get_query_argument("username", None)
        states = self.get_query_arguments("state")
        kind = self.get_query_argument("kind", None)
        if kind not in (None, "session", "job"):
            raise BadRequest(f"kind must be session or job, not {kind!r}")
        if not identity.has(scopes.SPAWN):
            if username not in (None, identity.name):
                raise Forbidden("you may list only your own workloads")
            username = identity.name
        query = listing(states, username, WorkloadKind(kind) if kind else None)
        with self.controller.store.read() as session:
            rows, total = page(session, query, offset, limit)
            items = [workload_out(w) for w in rows]
        self.send(schemas.WorkloadList(items=items, total=total, offset=offset, limit=limit))


class WorkloadHandler(APIHandler):
    """One workload; ``?wait=S&version=N`` long-polls until its version differs from N."""

    async def get(self, workload_id: str) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        wait = self.int_argument("wait", 0, 0, MAX_WAIT_SECONDS)
        known_version = self.int_argument("version", 0, 0, 2**62)
        wid = self.path_id(workload_id)
        with self.controller.store.read() as session:
            workload = load_workload(session, wid)
            if not identity.may_act_for(workload.username):
                raise NotFoundError(f"there is no workload {wid}")
            version = workload.version
        if wait and version == known_version:
            await self.controller.notifier.wait_for_change(wid, wait)
        with self.controller.store.read() as session:
            self.send(workload_out(load_workload(session, wid)))


class WorkloadActionHandler(APIHandler):
    """The spawner's side of the handshake: renew, running, release."""

    async def post(self, workload_id: str, action: str) -> None:
        self.require(scopes.SPAWN)
        store = self.controller.store
        now = self.controller.now()
        wid = self.path_id(workload_id)
        with store_errors_as_http():
            if action == "renew":
                store.workloads.renew(now, wid, self.controller.request_lease)
            elif action == "hold":
                body_hold = self.body(schemas.HoldIn)
                store.sessions.hold_for_snapshot(now, wid, body_hold.message)
            elif action == "running":
                running = self.body(schemas.RunningIn)
                sources = running.snapshot.model_dump() if running.snapshot else None
                store.workloads.mark_running(now, wid, sources)
                notice = running.notice  # what the spawner restored, if anything
                culled = store.sessions.last_cull(wid)
                if culled is not None:
                    # Told even when nothing had to be restored (a session without the
                    # overlay sandbox keeps its home on the host): its kernels are new.
                    at, why = culled
                    notice = f"Culled at {at:%H:%M} UTC: {why}. " + (
                        notice or "Kernels were restarted."
                    )
                if notice:
                    store.sessions.post_session_notice(now, wid, "info", notice)
                self.controller.culler.kick()  # a new session: when is it due?
            else:
                body = self.body(schemas.ReleaseIn)
                message = (
                    body.message
                    or {
                        "withdrawn": "the spawn was cancelled before the server started",
                        "stopped": "the server stopped and its processes are gone",
                        "failed": "the server failed to start",
                    }[body.outcome]
                )
                ended = store.workloads.end(now, wid, body.outcome, message)
                self.controller.metrics.ended.labels(ended.kind.value, body.outcome).inc()
                self.controller.refresh_snapshot_index()  # its final snapshot, if any
        self.controller.notifier.changed([wid])
        self.controller.kick()
        with store.read() as session:
            self.send(workload_out(load_workload(session, wid)))


class SpawnOptionsHandler(APIHandler):
    async def get(self, username: str) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        if not identity.may_act_for(username):
            raise Forbidden("you may see only your own spawn options")
        await self.controller.refresh_memberships(max_age=5.0)
        store = self.controller.store
        with store.read() as session:
            catalogue = catalogue_of(session, username)
            usage = Counter[tuple[int, str]]()
            for project_id, gpu_type, count in session.execute(
                select(Allocation.project_id, Allocation.gpu_type, func.count())
                .where(Allocation.closed_at.is_(None))
                .group_by(Allocation.project_id, Allocation.gpu_type)
            ):
                usage[(project_id, gpu_type)] = count
            projects = [
                schemas.ProjectOut(
                    name=p.name,
                    display_name=p.display_name or p.name,
                    quotas=[
                        schemas.QuotaOut(
                            gpu_type=q.gpu_type,
                            guaranteed=q.guaranteed,
                            used=usage[(p.id, q.gpu_type)],
                        )
                        for q in sorted(p.quotas, key=lambda q: q.gpu_type)
                    ],
                )
                for p in projects_of(session, username)
            ]
            profiles = [
                schemas.ProfileOut(
                    name=p.name,
                    display_name=p.display_name or p.name,
                    description=p.description,
                    gpu_types=p.allowed_gpu_types,
                    projects=p.allowed_projects,
                    default=p.is_default,
                )
                for p in session.scalars(select(Profile).order_by(Profile.name))
                if not p.allowed_projects or set(p.allowed_projects) & catalogue.user_projects
            ]
        self.send(
            schemas.SpawnOptionsOut(
                username=username,
                projects=projects,
                profiles=profiles,
                gpu_types=dict(sorted(catalogue.largest_node.items())),
            )
        )


def node_rows(session: Session, spares: frozenset[str] = frozenset()) -> list[schemas.NodeOut]:
    """Every node with its GPUs and free GPUs (present, not lost, not allocated);
    ``spares``: the nodes the last admission cycle held back as recovery spares."""
    taken = set(session.scalars(select(Allocation.gpu_uuid).where(Allocation.closed_at.is_(None))))
    nodes = session.scalars(
        select(Node)
        .order_by(Node.name)
        .options(selectinload(Node.gpus), selectinload(Node.zone).selectinload(Zone.cluster))
    )
    rows = []
    for n in nodes:
        present = [g for g in n.gpus if g.present]
        rows.append(
            schemas.NodeOut(
                name=n.name,
                cluster=n.zone.cluster.name,
                zone=n.zone.name,
                gpu_type=n.gpu_type,
                health=n.health.value,
                cordoned=n.cordoned,
                gpus=len(present),
                free_gpus=sum(
                    1
                    for g in present
                    if not (g.lost or g.cordoned or g.leftover_marker) and g.uuid not in taken
                ),
                last_heartbeat_at=n.last_heartbeat_at,
                gpu_uuids=[g.uuid for g in sorted(present, key=lambda g: g.index)],
                cordoned_gpus=[g.uuid for g in present if g.cordoned],
                lemon_gpus=[g.uuid for g in present if g.lemon],
                leftover_gpus=[g.uuid for g in present if g.leftover_marker],
                maintenance=n.maintenance,
                spare=n.name in spares,
            )
        )
    return rows


class NodesHandler(APIHandler):
    async def get(self) -> None:
        self.require(scopes.USE, scopes.SPAWN, scopes.AGENT)
        with self.controller.store.read() as session:
            rows = node_rows(session, self.controller.spare_nodes)
        self.send({"items": [row.model_dump(mode="json") for row in rows]})


class NodeCordonHandler(APIHandler):
    """POST ``/nodes/<name>/cordon`` or ``/uncordon`` (admins): a cordoned node takes no
    new work; what runs there keeps running. Answers the node as ``GET /nodes`` lists it."""

    async def post(self, node_name: str, action: str) -> None:
        identity = self.require(scopes.ADMIN)
        with store_errors_as_http():
            await self.controller.cordon(node_name, action == "cordon", identity.name)
        self.controller.kick()
        with self.controller.store.read() as session:
            (row,) = [n for n in node_rows(session) if n.name == node_name]
        self.send(row.model_dump(mode="json"))


class AgentRegisterHandler(APIHandler):
    async def post(self) -> None:
        identity = self.require(scopes.AGENT)
        body = self.body(schemas.RegisterIn)
        specs = [
            NodeSpec(
                name=n.name,
                cluster=n.cluster,
                zone=n.zone,
                gpu_type=n.gpu_type,
                gpus=tuple(
                    GpuSpec(g.uuid, g.index, g.pci_bus_id, g.memory_bytes, g.gpu_type)
                    for g in n.gpus
                ),
                cpus=n.cpus,
                memory_bytes=n.memory_bytes,
                labels=n.labels,
            )
            for n in body.nodes
        ]
        with store_errors_as_http():
            names = self.controller.store.nodes.register_nodes(
                self.controller.now(), identity.name, specs
            )
        self.controller.kick()
        self.send({"registered": names})


class AgentHeartbeatHandler(APIHandler):
    async def post(self) -> None:
        identity = self.require(scopes.AGENT)
        body = self.body(schemas.HeartbeatIn)
        with store_errors_as_http():
            unknown = self.controller.store.nodes.heartbeat(
                self.controller.now(), identity.name, body.nodes
            )
        with self.controller.store.read() as session:
            rows = session.execute(
                select(Allocation.gpu_uuid, Workload, Project.name)
                .join(Workload, Allocation.workload_id == Workload.id)
                .join(Node, Allocation.node_id == Node.id)
                .join(Project, Allocation.project_id == Project.id)
                .where(Allocation.closed_at.is_(None), Node.name.in_(body.nodes))
            ).all()
            assignments = {
                uuid: schemas.AssignmentOut(
                    workload_id=w.id,
                    username=w.username,
                    name=w.name,
                    kind=w.kind.value,
                    project=project,
                    marker=w.process_marker or "",
                )
                for uuid, w, project in rows
            }
        self.send(schemas.HeartbeatOut(unknown=unknown, assignments=assignments))


class AgentSamplesHandler(APIHandler):
    async def post(self) -> None:
        identity = self.require(scopes.AGENT)
        body = self.body(schemas.SamplesIn)
        with store_errors_as_http():
            unknown = self.controller.store.nodes.record_samples(
                self.controller.now(),
                identity.name,
                [s.model_dump(exclude_none=True) for s in body.samples],
                self.controller.gpu_busy_utilization,
            )
        self.controller.kick()  # a lost or returned GPU changes what can be placed
        self.send({"unknown": unknown})


class NodeDrainHandler(APIHandler):
    """POST ``/nodes/<name>/drain`` (admins): cordon the node and stop what runs there —
    each job with the checkpoint signal and its grace, restarting elsewhere as its next
    attempt; each session snapshotted and stopped. Answers the node as ``GET /nodes``."""

    async def post(self, node_name: str) -> None:
        identity = self.require(scopes.ADMIN)
        body = self.body(schemas.DrainIn) if self.request.body else schemas.DrainIn()
        with self.controller.store.read() as session:
            rows = [n for n in node_rows(session) if n.name == node_name]
        if not rows:
            raise NotFoundError(f"there is no node {node_name!r}")
        if body.at is not None:
            try:
                at = when(body.at, self.controller.now())
            except ValueError as e:
                raise BadRequest(str(e)) from None
            job = self.controller.timed.schedule_drain(node_name, identity.name, body.reason, at)
            self.send(_timed_out(job).model_dump(mode="json"), status=202)
            return
        with store_errors_as_http():
            await self.controller.drain(node_name, identity.name, body.reason)
        with self.controller.store.read() as session:
            (row,) = [n for n in node_rows(session) if n.name == node_name]
        self.send(row.model_dump(mode="json"))


class NodeRecycleHandler(APIHandler):
    """POST ``/nodes/<name>/recycle`` (admins): drain the node, recycle it once it is
    empty, then diagnose it (docs/recovery.md, "Maintenance"). Answers the node."""

    async def post(self, node_name: str) -> None:
        identity = self.require(scopes.ADMIN)
        body = self.body(schemas.RecycleIn) if self.request.body else schemas.RecycleIn()
        with store_errors_as_http():
            await self.controller.recycle(node_name, identity.name, body.reason)
        with self.controller.store.read() as session:
            (row,) = [n for n in node_rows(session) if n.name == node_name]
        self.send(row.model_dump(mode="json"))


class TimedHandler(APIHandler):
    """GET ``/timed``: the timed jobs (admins)."""

    async def get(self) -> None:
        self.require(scopes.ADMIN)
        jobs = self.controller.timed.jobs()
        self.send({"items": [_timed_out(j).model_dump(mode="json") for j in jobs]})


class TimedJobHandler(APIHandler):
    """DELETE ``/timed/<id>`` (admins) cancels a timed job."""

    async def delete(self, job_id: str) -> None:
        self.require(scopes.ADMIN)
        if not self.controller.timed.cancel(job_id):
            raise NotFoundError(f"there is no timed job {job_id!r}")
        self.send({"cancelled": job_id})


def _timed_out(job: TimedJob) -> schemas.TimedJobOut:
    return schemas.TimedJobOut(id=job.id, what=job.what, at=job.at)


class LemonClearHandler(APIHandler):
    """POST ``/gpus/<uuid>/clear-lemon`` (admins): the GPU leaves the lemon list and takes
    new work again."""

    async def post(self, gpu_uuid: str) -> None:
        identity = self.require(scopes.ADMIN)
        with store_errors_as_http():
            cleared = self.controller.store.jobs.clear_lemon(
                self.controller.now(), gpu_uuid, identity.name
            )
        self.controller.kick()
        self.send({"cleared": cleared})


class BreakersHandler(APIHandler):
    """GET ``/recovery/breakers`` (admins): each cluster's breaker on automated cordons
    (docs/recovery.md)."""

    async def get(self) -> None:
        self.require(scopes.ADMIN)
        self.send({"items": _breakers(self.controller)})


class BreakerResetHandler(APIHandler):
    """POST ``/recovery/breakers/<cluster>/reset`` (admins) closes a cluster's breaker."""

    async def post(self, cluster: str) -> None:
        identity = self.require(scopes.ADMIN)
        with store_errors_as_http():
            self.controller.store.jobs.reset_breaker(self.controller.now(), cluster, identity.name)
        self.send({"items": _breakers(self.controller)})


def _breakers(controller: ControllerContext) -> list[dict[str, Any]]:
    return [
        schemas.BreakerOut(cluster=name, open=at is not None, tripped_at=at).model_dump(mode="json")
        for name, at in sorted(controller.store.jobs.breakers().items())
    ]


class AgentXidHandler(APIHandler):
    async def post(self) -> None:
        identity = self.require(scopes.AGENT)
        body = self.body(schemas.XidIn)
        with store_errors_as_http():
            known = self.controller.store.nodes.record_xid(
                self.controller.now(), identity.name, body.uuid, body.xid
            )
        if not known:
            raise NotFoundError(f"there is no GPU {body.uuid}; register its node first")
        # The recovery loop's first step, at once: the job on the GPU stops and the GPU or
        # its node leaves service as the fault's verdict says (docs/recovery.md).
        with store_errors_as_http():
            changed = self.controller.store.jobs.act_on_xid(
                self.controller.now(), body.uuid, body.xid
            )
        if changed:
            self.controller.notifier.changed(changed)  # the node agents stop its ranks
        self.controller.kick()
        self.send({"recorded": True}, status=202)


class AgentPlacementsHandler(APIHandler):
    """Which GPUs workloads' processes were really given, as a node agent read them; the
    controller records each workload on those GPUs (``state/readback.py``)."""

    async def post(self) -> None:
        identity = self.require(scopes.AGENT)
        body = self.body(schemas.PlacementsIn)
        placements = [Placement(p.marker, tuple(p.gpu_uuids)) for p in body.placements]
        with store_errors_as_http():
            result = self.controller.store.readback.record_placements(
                self.controller.now(), identity.name, placements
            )
        if result.reseated:
            self.controller.notifier.changed(result.reseated)
            self.controller.kick()  # a GPU left may be free now
        self.send(
            schemas.PlacementsOut(
                reseated=list(result.reseated),
                mismatched=list(result.mismatched),
                unknown=list(result.unknown),
            )
        )


class SnapshotsHandler(APIHandler):
    """Snapshots from the index: yours, or anyone's (``?username=``) for admins."""

    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        username = self.get_query_argument("username", None)
        if not identity.has(scopes.SPAWN) and username not in (None, identity.name):
            raise Forbidden("you may list only your own snapshots")
        rows = self.controller.store.snapshots.snapshots_of(username or identity.name)
        self.send(
            schemas.SnapshotList(
                items=[schemas.SnapshotOut.model_validate(r, from_attributes=True) for r in rows],
                indexed_at=self.controller.snapshot_index_at,
            )
        )


class EventsHandler(APIHandler):
    async def get(self) -> None:
        identity = self.require(scopes.USE, scopes.SPAWN)
        limit = self.int_argument("limit", 100, 1, 1000)
        query = select(Event).order_by(Event.id.desc()).limit(limit)
        workload_id = self.get_query_argument("workload_id", None)
        if workload_id is not None:
            query = query.where(Event.workload_id == self.int_argument("workload_id", 0, 0, 2**62))
        if not identity.has(scopes.SPAWN):
            query = query.where(Event.username == identity.name)
        with self.controller.store.read() as session:
            events = [
                EventOut.model_validate(e, from_attributes=True).model_dump(mode="json")
                for e in session.scalars(query)
            ]
        self.send({"items": events})


class MetricsHandler(APIHandler):
    async def get(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.controller.metrics.registry))


def routes(prefix: str, controller: Any) -> list[tuple[str, type, dict[str, Any]]]:
    api = prefix.rstrip("/") + "/api/v1"
    table: list[tuple[str, type]] = [
        (rf"{api}/?", InfoHandler),
        (rf"{api}/ready", ReadyHandler),
        (rf"{api}/openapi.json", OpenAPIHandler),
        (rf"{api}/sessions", SessionsHandler),
        (rf"{api}/workloads", WorkloadsHandler),
        (rf"{api}/workloads/(\d+)", WorkloadHandler),
        (rf"{api}/workloads/(\d+)/(renew|running|release|hold)", WorkloadActionHandler),
        (rf"{api}/users/([^/]+)/spawn-options", SpawnOptionsHandler),
        (rf"{api}/nodes", NodesHandler),
        (rf"{api}/nodes/([^/]+)/(cordon|uncordon)", NodeCordonHandler),
        (rf"{api}/nodes/([^/]+)/drain", NodeDrainHandler),
        (rf"{api}/nodes/([^/]+)/recycle", NodeRecycleHandler),
        (rf"{api}/recovery/breakers", BreakersHandler),
        (rf"{api}/gpus/([^/]+)/clear-lemon", LemonClearHandler),
        (rf"{api}/timed", TimedHandler),
        (rf"{api}/timed/([^/]+)", TimedJobHandler),
        (rf"{api}/recovery/breakers/([^/]+)/reset", BreakerResetHandler),
        (rf"{api}/agent/register", AgentRegisterHandler),
        (rf"{api}/agent/heartbeat", AgentHeartbeatHandler),
        (rf"{api}/agent/samples", AgentSamplesHandler),
        (rf"{api}/agent/xid", AgentXidHandler),
        (rf"{api}/agent/placements", AgentPlacementsHandler),
        (rf"{api}/events", EventsHandler),
        (rf"{api}/snapshots", SnapshotsHandler),
        *session_routes(api),
        *account_routes(api),
        *job_routes(api),
        *trace_routes(api),
        *node_operation_routes(api),
        *project_routes(api),
        (rf"{prefix.rstrip('/')}/metrics", MetricsHandler),
    ]
    return [(path, handler, {"controller": controller}) for path, handler in table]
