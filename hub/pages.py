"""The controller's pages, behind the hub's OAuth: for now, "my sessions and the queue".

Researchers see their own workloads with their queue position and reason; admins see
everyone's and the nodes. The admin panel and project pages come with the surfaces issue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from sqlalchemy import select
from sqlalchemy.orm import selectinload
from tornado import template, web

from ..scheduler.store.models import Workload, WorkloadState
from . import scopes
from .api.base import Identity
from .api.handlers import node_rows

if TYPE_CHECKING:
    from .app import FleetController

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpufleet — {{ title }}</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
 table { border-collapse: collapse; margin-bottom: 2rem; }
 th, td { border-bottom: 1px solid #ddd; padding: .4rem .8rem; text-align: left; }
 .pending { color: #a15c00; } .running { color: #1a7f37; } .reason { max-width: 40rem; }
</style></head>
<body>
<h1>{{ title }}</h1>
<p>Signed in as <b>{{ identity.name }}</b>{% if identity.is_admin %} (gpufleet admin){% end %}.
<a href="{{ hub_home }}">Back to the hub</a></p>
<h2>{% if identity.is_admin %}Workloads{% else %}Your sessions{% end %}</h2>
{% if not workloads %}<p id="no-workloads">Nothing running or waiting.</p>{% else %}
<table id="workloads"><tr><th>id</th><th>user</th><th>server</th><th>project</th>
<th>GPUs</th><th>state</th><th>queue</th><th>why</th></tr>
{% for w in workloads %}<tr data-workload="{{ w.id }}">
<td>{{ w.id }}</td><td>{{ w.username }}</td><td>{{ w.server_name or "(default)" }}</td>
<td>{{ w.project.name }}</td><td>{{ w.gpus }} × {{ w.gpu_type }}</td>
<td class="{{ w.state.value }}">{{ w.state.value }}</td>
<td>{{ w.queue_position or "" }}</td><td class="reason">{{ w.reason }}</td></tr>{% end %}
</table>{% end %}
{% if identity.is_admin %}<h2>Nodes</h2>
<table id="nodes"><tr><th>node</th><th>zone</th><th>GPU type</th><th>GPUs</th><th>free</th>
<th>health</th></tr>
{% for n in nodes %}<tr><td>{{ n.name }}</td><td>{{ n.zone }}</td>
<td>{{ n.gpu_type }}</td><td>{{ n.gpus }}</td><td>{{ n.free_gpus }}</td>
<td>{{ n.health }}</td></tr>{% end %}</table>{% end %}
</body></html>
"""


class PageHandler(HubOAuthenticated, web.RequestHandler):
    controller: FleetController
    identity: Identity | None

    def initialize(self, controller: FleetController) -> None:
        self.controller = controller
        self.hub_auth = controller.hub_auth

    async def prepare(self) -> None:
        # Resolve the user without blocking the event loop; HubOAuthenticated's own
        # get_current_user would call the hub synchronously.
        self.identity = await self.controller.identify(self)
        self._current_user = self.identity  # what @web.authenticated checks

    def get_current_user(self) -> Any:
        return self.identity


class MyWorkloadsPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        identity = self.identity
        assert identity is not None
        if not identity.has(scopes.USE):
            raise web.HTTPError(403, "your account may not use gpufleet")
        query = (
            select(Workload)
            .where(Workload.state != WorkloadState.ended)
            .order_by(Workload.id)
            .options(selectinload(Workload.project))
        )
        if not identity.is_admin:
            query = query.where(Workload.username == identity.name)
        with self.controller.store.read() as session:
            workloads = list(session.scalars(query))
            nodes = node_rows(session) if identity.is_admin else []
        self.finish(
            template.Template(PAGE).generate(
                title="gpufleet",
                identity=identity,
                workloads=workloads,
                nodes=nodes,
                hub_home="/hub/home",
            )
        )


def page_routes(prefix: str, controller: FleetController) -> list[tuple[str, type, dict[str, Any]]]:
    base = prefix.rstrip("/")
    return [
        (rf"{base}/?", MyWorkloadsPage, {"controller": controller}),
        (rf"{base}/oauth_callback", HubOAuthCallbackHandler, {}),
    ]
