"""The OpenAPI 3.1 document the controller serves at ``api/v1/openapi.json``.

Bodies and answers come from the pydantic models in ``api/`` (``gpufleet.api``); each operation
names the scopes that may call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel

from ..api import jobs as js
from ..api import node_operations as nops
from ..api import schemas
from . import scopes


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    scopes: tuple[str, ...]
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    status: int = 200
    query: tuple[tuple[str, str, str], ...] = ()  # (name, type, description)
    # Further answers it gives with the same body, by status: (status, description).
    also: tuple[tuple[int, str], ...] = ()


WORKLOAD_ID = ("workload_id", "integer", "the workload's id")
USERNAME = ("username", "string", "a hub user name")
NODE_NAME = ("node_name", "string", "a node's name, as GET /nodes lists it")
JOB_ID = ("job_id", "integer", "a job's id (the id of its workload)")
TRACE_ID = ("trace_id", "integer", "a trace's id, as GET /jobs/{job_id}/traces lists it")
PROJECT_NAME = ("project_name", "string", "a project's (or organisation's, team's) name")
OPERATION_ID = ("operation_id", "integer", "a node operation's id")
GPU_UUID = ("gpu_uuid", "string", "a GPU's UUID, as GET /nodes lists it")
CLUSTER = ("cluster", "string", "a cluster's name, as GET /nodes lists it")
TIMED_ID = ("timed_id", "string", "a timed job's id, as GET /timed lists it")
PAGING = (
    ("offset", "integer", "skip this many"),
    ("limit", "integer", "at most this many (1-1000)"),
)

OPERATIONS = (
    Operation("get", "/", "Service information", ()),
    Operation("get", "/openapi.json", "This document", ()),
    Operation(
        "get",
        "/ready",
        "Whether this controller leads (holds the database lease): a readiness probe",
        (),
        also=((503, "it stands by: another controller leads"),),
    ),
    Operation(
        "post",
        "/sessions",
        "Queue a session's request for GPUs (the spawner)",
        (scopes.SPAWN,),
        schemas.SessionRequestIn,
        schemas.WorkloadOut,
        201,
    ),
    Operation(
        "get",
        "/workloads",
        "List workloads (yours, or everyone's for admins)",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.WorkloadList,
        query=(
            ("username", "string", "only this user's"),
            ("state", "string", "pending|admitted|running|stopping|ended, repeatable"),
            ("kind", "string", "session or job"),
            *PAGING,
        ),
    ),
    Operation(
        "get",
        "/workloads/{workload_id}",
        "One workload; long-poll with wait and version",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.WorkloadOut,
        query=(
            ("wait", "integer", "seconds to wait for a change (0-60)"),
            ("version", "integer", "the version the caller already has"),
        ),
    ),
    Operation(
        "post",
        "/workloads/{workload_id}/renew",
        "Renew a waiting request's lease",
        (scopes.SPAWN,),
        None,
        schemas.WorkloadOut,
    ),
    Operation(
        "post",
        "/workloads/{workload_id}/running",
        "Report the session's server up",
        (scopes.SPAWN,),
        None,
        schemas.WorkloadOut,
    ),
    Operation(
        "post",
        "/workloads/{workload_id}/release",
        "Withdraw a request, or release GPUs once every process is gone",
        (scopes.SPAWN,),
        schemas.ReleaseIn,
        schemas.WorkloadOut,
    ),
    Operation(
        "post",
        "/workloads/{workload_id}/hold",
        "Keep a stopped session's GPUs: its final snapshot failed and is retried",
        (scopes.SPAWN,),
        schemas.HoldIn,
        schemas.WorkloadOut,
    ),
    Operation(
        "post",
        "/sessions/{workload_id}/activity",
        "A session's extension reports its kernels and terminals (the session's own user, "
        "with any of their tokens, the server's included); answers its notices",
        (scopes.USE, scopes.SPAWN),
        schemas.ActivityIn,
        schemas.SessionStateOut,
    ),
    Operation(
        "get",
        "/sessions/{workload_id}/activity",
        "A session's notices and keep-alive, without a report",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.SessionStateOut,
    ),
    Operation(
        "put",
        "/sessions/{workload_id}/keep-alive",
        "Keep a session from being culled until a time (or for some hours) within its "
        "project's limit; a time in the past clears it",
        (scopes.USE, scopes.SPAWN),
        schemas.KeepAliveIn,
        schemas.SessionStateOut,
    ),
    Operation(
        "post",
        "/users/{username}/account",
        "The Unix identity the user's sessions and job ranks run as, made on first use",
        (scopes.SPAWN, scopes.ADMIN),
        None,
        schemas.AccountOut,
    ),
    Operation(
        "get",
        "/users/{username}/spawn-options",
        "Projects, profiles and GPU types a user may pick on the spawn page",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.SpawnOptionsOut,
    ),
    Operation(
        "get",
        "/projects",
        "The project tree with quotas and live usage (yours and the nodes above, or all "
        "for admins)",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.ProjectList,
    ),
    Operation(
        "get",
        "/usage",
        "GPU-hours per project, user and week (your projects', or all for admins)",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.UsageList,
        query=(
            ("weeks", "integer", "how many weeks back, this one included (1-104, default 8)"),
            ("format", "string", "json (default) or csv: a file to download"),
        ),
    ),
    Operation(
        "patch",
        "/projects/{project_name}",
        "Change a project's quotas, weight, default priority or per-user cap (admins); "
        "audited in the event log, in effect from the next scheduling cycle",
        (scopes.ADMIN,),
        schemas.ProjectEditIn,
        schemas.ProjectUsageOut,
    ),
    Operation(
        "get",
        "/nodes",
        "Nodes with their health and free GPUs",
        (scopes.USE, scopes.SPAWN, scopes.AGENT),
    ),
    Operation(
        "post",
        "/nodes/{node_name}/cordon",
        "Cordon a node: it takes no new work; what runs there keeps running (admins)",
        (scopes.ADMIN,),
        None,
        schemas.NodeOut,
    ),
    Operation(
        "post",
        "/nodes/{node_name}/uncordon",
        "Uncordon a node: it takes new work again (admins)",
        (scopes.ADMIN,),
        None,
        schemas.NodeOut,
    ),
    Operation(
        "post",
        "/nodes/{node_name}/drain",
        "Drain a node: cordon it; its jobs stop with the checkpoint signal and restart "
        "elsewhere, its sessions are snapshotted and stopped (admins); with `at`, later",
        (scopes.ADMIN,),
        schemas.DrainIn,
        schemas.NodeOut,
    ),
    Operation(
        "post",
        "/nodes/{node_name}/recycle",
        "Recycle a node: drain it, recycle it once empty (the agent's recycle_command), "
        "then diagnose it; it returns to service if the diagnostics pass (admins)",
        (scopes.ADMIN,),
        schemas.RecycleIn,
        schemas.NodeOut,
    ),
    Operation(
        "post",
        "/gpus/{gpu_uuid}/clear-lemon",
        "Take a GPU off the lemon list: it takes new work again (admins)",
        (scopes.ADMIN,),
    ),
    Operation(
        "get",
        "/timed",
        "The timed jobs: drains scheduled for later (admins)",
        (scopes.ADMIN,),
    ),
    Operation(
        "delete",
        "/timed/{timed_id}",
        "Cancel a timed job (admins)",
        (scopes.ADMIN,),
    ),
    Operation(
        "get",
        "/recovery/breakers",
        "Each cluster's breaker on the recovery loop's automated cordons (admins)",
        (scopes.ADMIN,),
    ),
    Operation(
        "post",
        "/recovery/breakers/{cluster}/reset",
        "Close a cluster's recovery breaker: the recovery loop cordons faulty nodes there "
        "again (admins)",
        (scopes.ADMIN,),
    ),
    Operation(
        "post",
        "/jobs",
        "Submit a training job (a gang of pods, each running the script under torchrun)",
        (scopes.USE,),
        js.JobSubmitIn,
        js.JobOut,
        201,
    ),
    Operation(
        "get",
        "/jobs",
        "List jobs (yours, or everyone's for admins), newest first",
        (scopes.USE,),
        None,
        js.JobList,
        query=(
            ("username", "string", "only this user's (admins)"),
            ("state", "string", "pending|admitted|running|stopping|ended, repeatable"),
            *PAGING,
        ),
    ),
    Operation(
        "get",
        "/jobs/{job_id}",
        "One job with its pods; long-poll with wait and version",
        (scopes.USE,),
        None,
        js.JobOut,
        query=(
            ("wait", "integer", "seconds to wait for a change (0-60)"),
            ("version", "integer", "the version the caller already has"),
        ),
    ),
    Operation(
        "post",
        "/jobs/{job_id}/cancel",
        "Cancel a job: every rank is stopped, then its GPUs are released",
        (scopes.USE,),
        None,
        js.JobOut,
    ),
    Operation(
        "get",
        "/jobs/{job_id}/logs",
        "One rank's stdout or stderr from an offset on; long-poll with wait",
        (scopes.USE,),
        None,
        js.LogOut,
        query=(
            ("rank", "integer", "a global rank (default 0); -1 - p: pod p's launcher"),
            ("stream", "string", "stdout (default) or stderr"),
            ("offset", "integer", "bytes of the stream already read"),
            ("wait", "integer", "seconds to wait for more while the job runs (0-60)"),
        ),
    ),
    Operation(
        "get",
        "/jobs/{job_id}/traces",
        "The job's traces (every rank's Python stacks), newest first",
        (scopes.USE,),
        None,
        js.TraceList,
    ),
    Operation(
        "post",
        "/jobs/{job_id}/traces",
        "Take every rank's Python stacks of a running job now (the trace, open)",
        (scopes.USE,),
        None,
        js.TraceOut,
        202,
    ),
    Operation(
        "get",
        "/jobs/{job_id}/traces/{trace_id}",
        "One trace; long-poll with wait until every pod answered",
        (scopes.USE,),
        None,
        js.TraceOut,
        query=(("wait", "integer", "seconds to wait for it to complete (0-60)"),),
    ),
    Operation(
        "post",
        "/agent/pods",
        "A node agent reports its job pods and their logs, and learns what to run",
        (scopes.AGENT,),
        js.AgentSyncIn,
        js.AgentSyncOut,
    ),
    Operation(
        "post",
        "/agent/register",
        "A node agent reports its nodes and GPUs",
        (scopes.AGENT,),
        schemas.RegisterIn,
    ),
    Operation(
        "post",
        "/agent/heartbeat",
        "A node agent's heartbeat",
        (scopes.AGENT,),
        schemas.HeartbeatIn,
        schemas.HeartbeatOut,
    ),
    Operation(
        "post",
        "/agent/samples",
        "A node agent's latest GPU samples",
        (scopes.AGENT,),
        schemas.SamplesIn,
    ),
    Operation(
        "post",
        "/agent/xid",
        "A node agent reports an XID error as it happens",
        (scopes.AGENT,),
        schemas.XidIn,
        status=202,
    ),
    Operation(
        "post",
        "/agent/placements",
        "A node agent reports which GPUs each workload's processes were given (their "
        "NVIDIA_VISIBLE_DEVICES); the controller records each workload on those GPUs",
        (scopes.AGENT,),
        schemas.PlacementsIn,
        schemas.PlacementsOut,
    ),
    Operation(
        "post",
        "/workloads/{workload_id}/node-operations",
        "Ask the node agent of a session's node for a snapshot pass or a restore of its "
        "volumes (the Kubernetes spawner)",
        (scopes.SPAWN,),
        nops.NodeOperationIn,
        nops.NodeOperationOut,
        201,
    ),
    Operation(
        "get",
        "/node-operations/{operation_id}",
        "A node operation's state, progress and result",
        (scopes.SPAWN,),
        None,
        nops.NodeOperationOut,
    ),
    Operation(
        "post",
        "/node-operations/{operation_id}/abandon",
        "Give up on a node operation no agent has claimed (it fails)",
        (scopes.SPAWN,),
        None,
        nops.NodeOperationOut,
    ),
    Operation(
        "post",
        "/agent/node-operations",
        "A node agent reports on its node operations and claims the pending ones of its "
        "nodes (long-polls with wait)",
        (scopes.AGENT,),
        nops.AgentOperationsIn,
        nops.AgentOperationsOut,
    ),
    Operation(
        "get",
        "/snapshots",
        "Snapshots of your sessions (anyone's for admins), newest first, from the index",
        (scopes.USE, scopes.SPAWN),
        None,
        schemas.SnapshotList,
        query=(("username", "string", "this user's (admins)"),),
    ),
    Operation(
        "get",
        "/events",
        "The event log (yours, or everything for admins)",
        (scopes.USE, scopes.SPAWN),
        query=(
            ("workload_id", "integer", "one workload's"),
            ("limit", "integer", "at most this many"),
        ),
    ),
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# Every parameter a path may hold; an operation has those its path names.
PATH_PARAMETERS = (
    WORKLOAD_ID,
    USERNAME,
    NODE_NAME,
    JOB_ID,
    TRACE_ID,
    PROJECT_NAME,
    OPERATION_ID,
    GPU_UUID,
    CLUSTER,
    TIMED_ID,
)


def _register(components: dict[str, Any], model: type[BaseModel]) -> None:
    """``model``'s schema, and those it refers to, among the document's components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema


def _parameters(op: Operation) -> list[dict[str, Any]]:
    """The operation's path parameters, then its query parameters."""
    in_path = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": kind},
            "description": text,
        }
        for name, kind, text in PATH_PARAMETERS
        if "{" + name + "}" in op.path
    ]
    return in_path + [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": {"type": kind},
            "description": text,
        }
        for name, kind, text in op.query
    ]


def _operation(op: Operation, components: dict[str, Any]) -> dict[str, Any]:
    """The operation object of ``op``, its body's and answer's schemas registered."""
    error = {"content": {"application/json": {"schema": _ref(schemas.ErrorOut)}}}
    answer: dict[str, Any] = {"description": "OK"}
    if op.answer is not None:
        _register(components, op.answer)
        answer["content"] = {"application/json": {"schema": _ref(op.answer)}}
    else:
        answer["content"] = {"application/json": {"schema": {"type": "object"}}}
    operation: dict[str, Any] = {
        "summary": op.summary,
        "parameters": _parameters(op),
        "responses": {
            str(op.status): answer,
            "400": {"description": "bad input", **error},
            "401": {"description": "no valid token", **error},
            "403": {"description": "missing scope", **error},
            "404": {"description": "not found", **error},
        },
        "x-scopes": list(op.scopes),
    }
    for status, description in op.also:
        operation["responses"][str(status)] = {**answer, "description": description}
    if op.scopes:
        operation["security"] = [{"hubToken": []}]
    if op.body is not None:
        _register(components, op.body)
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(op.body)}},
        }
        operation["responses"]["415"] = {"description": "the body is not JSON", **error}
    return operation


@cache
def openapi_document(version: str) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    _register(components, schemas.ErrorOut)
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpufleet controller API",
            "version": version,
            "description": "Authenticate with a JupyterHub token: `Authorization: token <t>`. "
            "Errors are {code, message, details}.",
        },
        "servers": [{"url": "/services/gpufleet/api/v1"}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "hubToken": {"type": "apiKey", "in": "header", "name": "Authorization"}
            },
        },
    }
