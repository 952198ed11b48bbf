"""A job's traces in the REST API: every rank's Python stacks (state/traces.py).

``GET /jobs/{id}/traces`` lists them, newest first (the hang's, taken before its gang was
stopped, and those asked for); ``POST /jobs/{id}/traces`` asks the node agents for a new
one of a running job (its owner or an admin) and answers at once with the open trace;
``GET /jobs/{id}/traces/{trace}?wait=S`` long-polls until that trace is complete.
"""

from __future__ import annotations

import time
from typing import Any

from ...api import jobs as js
from ...state.models import JobTrace
from .. import scopes
from ..errors import NotFoundError
from .base import APIHandler, store_errors_as_http
from .jobs import load_job
from .views import MAX_WAIT_SECONDS


def trace_out(trace: JobTrace, pods: int) -> js.TraceOut:
    answered = {d.pod_index for d in trace.dumps}
    return js.TraceOut(
        id=trace.id,
        job=trace.workload_id,
        attempt=trace.attempt,
        why=trace.why,
        asked_by=trace.asked_by,
        asked_at=trace.asked_at,
        complete=trace.closed_at is not None,
        closed_at=trace.closed_at,
        pods=[
            js.PodStacksOut(
                pod=d.pod_index,
                node=d.node,
                taken_at=d.taken_at,
                ranks=[js.RankStackOut(**r) for r in d.ranks],
            )
            for d in trace.dumps
        ],
        missing_pods=[i for i in range(pods) if i not in answered],
    )


class TracesHandler(APIHandler):
    async def get(self, workload_id: str) -> None:
        identity = self.require(scopes.USE)
        wid = self.path_id(workload_id)
        with self.controller.store.read() as session:
            pods = load_job(session, identity, wid).pods
        traces = self.controller.store.traces.traces(wid)
        self.send(js.TraceList(items=[trace_out(t, pods) for t in traces]))

    async def post(self, workload_id: str) -> None:
        identity = self.require(scopes.USE)
        wid = self.path_id(workload_id)
        with self.controller.store.read() as session:
            pods = load_job(session, identity, wid).pods
        controller = self.controller
        with store_errors_as_http():
            trace_id = controller.store.traces.ask(controller.now(), wid, identity.name)
        controller.notifier.changed([wid])  # the agents' waiting syncs answer at once
        [trace] = controller.store.traces.traces(wid, trace_id)
        self.send(trace_out(trace, pods), status=202)


class TraceHandler(APIHandler):
    """One trace; ``?wait=S`` long-polls until it is complete (or S seconds pass)."""

    async def get(self, workload_id: str, trace_id: str) -> None:
        identity = self.require(scopes.USE)
        wid = self.path_id(workload_id)
        wait = self.int_argument("wait", 0, 0, MAX_WAIT_SECONDS)
        with self.controller.store.read() as session:
            pods = load_job(session, identity, wid).pods
        deadline = time.monotonic() + wait
        while True:
            found = self.controller.store.traces.traces(wid, self.path_id(trace_id))
            if not found:
                raise NotFoundError(f"job {wid} has no trace {trace_id}")
            left = deadline - time.monotonic()
            if found[0].closed_at is not None or left <= 0:
                break
            await self.controller.notifier.wait_for_change(wid, left)
        self.send(trace_out(found[0], pods))


def trace_routes(api: str) -> list[tuple[str, Any]]:
    return [
        (rf"{api}/jobs/(\d+)/traces", TracesHandler),
        (rf"{api}/jobs/(\d+)/traces/(\d+)", TraceHandler),
    ]
