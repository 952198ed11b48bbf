"""The REST API refuses bad input with a 4xx that says what is wrong, never a 500.

The controller's own routes and handlers run in this process under tornado, over a real
store (SQLite); the controller around them is a small stand-in that knows one admin user.
Each case here was found by fuzzing: 4,301-digit ids and counts (past Python's limit on
int()), ``true`` taken for 1, NUL and bidirectional controls in names, non-JSON bodies.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpufleet.api.schemas import SessionRequestIn
from gpufleet.hub import scopes
from gpufleet.hub.api.handlers import routes
from gpufleet.hub.api.identity import Identity
from gpufleet.hub.timed import TimedWork
from gpufleet.spawner.client import ControllerClient, ControllerUnavailable, RequestRejected
from gpufleet.state import db
from gpufleet.state.fleet import FleetStore
from gpufleet.state.inventory import GpuSpec, NodeSpec

from ..schema import migrated_sqlite

PREFIX = "/services/gpufleet/"
HUGE = "1" * 4301  # one digit past what int() reads
PADDED_ONE = "0" * 4300 + "1"
SESSION = {"username": "alice", "project": "vision", "gpu_type": "A100", "gpus": 1}
JOB = {
    "project": "vision",
    "gpu_type": "A100",
    "gpus": 1,
    "script": "print('hello')\n",
    "python": "/usr/bin/python3",
}
NUL = "vi\0sion"
BIDI = "vision\u202e"  # RIGHT-TO-LEFT OVERRIDE


@dataclass
class Controller:
    """What the handlers use of the controller (hub/context.py), over a real store."""

    store: FleetStore
    identity: Identity
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("test_api_input"))
    version: str = "test"
    is_leader: bool = True
    job_checkpoint_store: str = "/checkpoints/{user}/{job}"
    job_stop_grace_seconds: float = 5.0
    request_lease: timedelta = timedelta(minutes=5)
    gpu_busy_utilization: float = 5.0
    timed: TimedWork | None = None

    def now(self) -> datetime:
        return datetime.now(UTC)

    def checkpoint_places(self, username: str) -> list[str]:
        return [f"/homes/{username}", f"/checkpoints/{username}"]

    def kick(self) -> None:
        return

    async def identify(self, handler: web.RequestHandler) -> Identity | None:
        return self.identity

    async def refresh_memberships(self, max_age: float) -> None:
        return

    async def drain(self, node: str, by: str, why: str) -> None:  # a timed job's, never run
        raise AssertionError(f"no drain of {node} is due in a test")

    async def run_snapshot_retention(self) -> None:
        raise AssertionError("no snapshot retention is due in a test")


def fleet_store(path: Path) -> FleetStore:
    """One project (vision: alice) and one node of 4 A100."""
    engine = db.make_engine(migrated_sqlite(path))
    now = datetime.now(UTC)
    store = FleetStore(engine, "controller-a", lease_ttl=timedelta(hours=1))
    assert store.try_acquire_lease(now)
    store.projects.apply_config(
        now,
        [{"name": "vision", "quotas": {"A100": {"guaranteed": 4}}}],
        [{"name": "pytorch", "default": True}],
        [{"name": "standard", "rank": 100}],
    )
    gpus = tuple(GpuSpec(f"GPU-a1-{i}", i) for i in range(4))
    store.nodes.register_nodes(now, "agent-1", [NodeSpec("a1", "local", "zone-a", "A100", gpus)])
    store.projects.sync_memberships(now, {"vision": ["alice"]})
    return store


async def serve(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free port of this machine; yields its base URL."""
    sock, port = bind_unused_port()
    server = HTTPServer(app)
    server.add_sockets([sock])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        await server.close_all_connections()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the controller's API, as alice, who is an admin (every scope)."""
    alice = Identity("user", "alice", frozenset({scopes.ADMIN, scopes.USE}), by_cookie=False)
    controller = Controller(fleet_store(tmp_path / "gpufleet.sqlite"), alice)
    async for url in serve(web.Application(routes(PREFIX, controller))):
        async with httpx.AsyncClient(base_url=f"{url}{PREFIX}api/v1", timeout=30) as client:
            yield client


@pytest.fixture
async def admin_api(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``api``, with the controller's timed work (APScheduler over the same database)
    running, as on the controller that holds the lease."""
    alice = Identity("user", "alice", frozenset({scopes.ADMIN, scopes.USE}), by_cookie=False)
    controller = Controller(fleet_store(tmp_path / "gpufleet.sqlite"), alice)
    controller.timed = TimedWork(controller, controller.store.engine)
    controller.timed.lead()
    try:
        async for url in serve(web.Application(routes(PREFIX, controller))):
            async with httpx.AsyncClient(base_url=f"{url}{PREFIX}api/v1", timeout=30) as client:
                yield client
    finally:
        controller.timed.scheduler.shutdown(wait=False)


def refused(response: httpx.Response, status: int = 400) -> str:
    """The message of an error answer ``{code, message, details}`` with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()
    assert set(error) == {"code", "message", "details"}
    assert len(error["message"]) < 500, "the message must not echo the input back whole"
    return str(error["message"])


# ------------------------------------------------------------------ path ids
ID_ROUTES = [
    ("GET", "/workloads/{}"),
    ("POST", "/workloads/{}/renew"),
    ("POST", "/workloads/{}/running"),
    ("POST", "/workloads/{}/release"),
    ("POST", "/workloads/{}/hold"),
    ("GET", "/jobs/{}"),
    ("POST", "/jobs/{}/cancel"),
    ("GET", "/jobs/{}/logs"),
    ("GET", "/sessions/{}/activity"),
    ("POST", "/sessions/{}/activity"),
    ("PUT", "/sessions/{}/keep-alive"),
]
BODIES = {"/hold": {"message": "the final snapshot failed"}, "/keep-alive": {"hours": 1}}


def body_for(path: str) -> dict[str, Any]:
    return next((b for end, b in BODIES.items() if path.endswith(end)), {})


@pytest.mark.parametrize(("method", "path"), ID_ROUTES)
@pytest.mark.parametrize("wid", [HUGE, PADDED_ONE, str(2**62 + 1), "9" * 19])
async def test_an_id_no_row_can_have_is_a_400_on_every_route(
    api: httpx.AsyncClient, method: str, path: str, wid: str
) -> None:
    response = await api.request(method, path.format(wid), json=body_for(path))
    assert "is not a valid id: ids are whole numbers up to 2^62" in refused(response)


@pytest.mark.parametrize(("method", "path"), ID_ROUTES)
async def test_an_id_that_could_be_a_row_but_is_not_is_a_404(
    api: httpx.AsyncClient, method: str, path: str
) -> None:
    response = await api.request(method, path.format(2**62), json=body_for(path))
    refused(response, 404)


async def test_a_huge_number_in_a_query_parameter_is_a_400(api: httpx.AsyncClient) -> None:
    message = refused(await api.get("/workloads", params={"offset": HUGE}))
    assert message.startswith("query parameter offset must be a whole number, not '111")


# -------------------------------------------------------------------- counts
@pytest.mark.parametrize("count", [HUGE, PADDED_ONE, "-" + HUGE])
@pytest.mark.parametrize("dry_run", [True, False])
async def test_a_session_count_past_the_digit_limit_is_a_400(
    api: httpx.AsyncClient, count: str, dry_run: bool
) -> None:
    response = await api.post(
        "/sessions", params={"dry_run": "1"} if dry_run else None, json={**SESSION, "gpus": count}
    )
    assert "the GPU count must be a whole number such as 1 or 2 up to" in refused(response)


@pytest.mark.parametrize("field_name", ["gpus", "gpus_per_pod"])
@pytest.mark.parametrize("count", [HUGE, PADDED_ONE])
async def test_a_job_count_past_the_digit_limit_is_a_400(
    api: httpx.AsyncClient, field_name: str, count: str
) -> None:
    response = await api.post("/jobs", json={**JOB, field_name: count})
    assert "the GPU count must be a whole number such as 1 or 2 up to" in refused(response)


@pytest.mark.parametrize(
    ("path", "body", "field_name"),
    [
        ("/sessions", {**SESSION, "gpus": True}, "gpus"),
        ("/jobs", {**JOB, "gpus": True}, "gpus"),
        ("/jobs", {**JOB, "gpus_per_pod": True}, "gpus_per_pod"),
    ],
)
async def test_true_is_not_the_count_1(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], field_name: str
) -> None:
    message = refused(await api.post(path, json=body))
    assert f"{field_name}: must be a whole number such as 1 or 2, not true" in message
    assert (await api.get("/workloads")).json()["total"] == 0  # nothing was queued


@pytest.mark.parametrize(
    ("path", "body", "field_name"),
    [
        ("/agent/xid", {"uuid": "GPU-a1-0", "xid": True}, "xid"),
        ("/projects/vision", {"per_user_gpu_cap": True}, "per_user_gpu_cap"),
        (
            "/agent/pods",
            {"nodes": ["a1"], "pods": [{"workload_id": True, "pod_index": 0, "state": "running"}]},
            "pods.0.workload_id",
        ),
    ],
)
async def test_true_is_no_whole_number_anywhere(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], field_name: str
) -> None:
    method = "PATCH" if path.startswith("/projects") else "POST"
    message = refused(await api.request(method, path, json=body))
    assert f"{field_name}: Input should be a valid integer" in message


async def test_a_count_as_a_form_types_it_is_still_read(api: httpx.AsyncClient) -> None:
    response = await api.post("/sessions", params={"dry_run": "1"}, json={**SESSION, "gpus": "2"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/sessions", {**SESSION, "gpus": " 1"}),
        ("/jobs", {**JOB, "gpus": "1 "}),
        ("/jobs", {**JOB, "gpus": 2, "gpus_per_pod": " 1"}),
    ],
)
async def test_a_count_in_text_with_spaces_is_a_400_saying_to_send_the_digits_alone(
    api: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    message = refused(await api.post(path, json=body))
    assert "must be a whole number such as 1 or 2, not '" in message
    assert message.endswith(": send the digits alone, without spaces")
    assert (await api.get("/workloads")).json()["total"] == 0  # nothing was queued


# --------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("path", "field_name", "body"),
    [
        ("/sessions", "username", SESSION),
        ("/sessions", "server_name", SESSION),
        ("/sessions", "project", SESSION),
        ("/sessions", "gpu_type", SESSION),
        ("/sessions", "profile", SESSION),
        ("/jobs", "project", JOB),
        ("/jobs", "gpu_type", JOB),
        ("/jobs", "name", JOB),
        ("/jobs", "priority", JOB),
    ],
)
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (NUL, "holds a NUL character (U+0000)"),
        (BIDI, "holds the bidirectional control U+202E"),
        ("vision\u2066", "holds the bidirectional control U+2066"),
        ("vision\u200f", "holds the bidirectional control U+200F"),
        ("vision\u061c", "holds the bidirectional control U+061C"),
    ],
)
async def test_a_name_with_nul_or_a_bidi_control_is_a_400_naming_the_field(
    api: httpx.AsyncClient,
    path: str,
    field_name: str,
    body: dict[str, Any],
    text: str,
    problem: str,
) -> None:
    message = refused(await api.post(path, json={**body, field_name: text}))
    assert f"{field_name}: {problem}" in message


@pytest.mark.parametrize(
    ("path", "body", "field_name"),
    [
        (
            "/agent/register",
            {"nodes": [{"name": NUL, "zone": "z", "gpu_type": "A100", "gpus": []}]},
            "nodes.0.name",
        ),
        (
            "/agent/register",
            {"nodes": [{"name": "n", "zone": BIDI, "gpu_type": "A100", "gpus": []}]},
            "nodes.0.zone",
        ),
        ("/agent/heartbeat", {"nodes": [BIDI]}, "nodes.0"),
        ("/agent/xid", {"uuid": NUL, "xid": 79}, "uuid"),
        ("/agent/pods", {"nodes": [NUL]}, "nodes.0"),
    ],
)
async def test_an_agent_name_with_nul_or_a_bidi_control_is_a_400(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], field_name: str
) -> None:
    assert f"{field_name}: holds" in refused(await api.post(path, json=body))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/users/al%00ice/spawn-options"),
        ("GET", "/users/al%E2%80%AEice/spawn-options"),
        ("POST", "/nodes/a%001/cordon"),
        ("PATCH", "/projects/vision%E2%80%AE"),
    ],
)
async def test_a_name_in_the_path_with_nul_or_a_bidi_control_is_a_400(
    api: httpx.AsyncClient, method: str, path: str
) -> None:
    body = {} if method == "PATCH" else None
    assert "; no name does" in refused(await api.request(method, path, json=body))


async def test_a_query_parameter_with_nul_is_a_400(api: httpx.AsyncClient) -> None:
    message = refused(await api.get("/workloads", params={"username": "al\0ice"}))
    assert message == "query parameter 'username' holds a NUL character (U+0000)"


# --------------------------------------------------------------------- times
@pytest.mark.parametrize("place", ["/homes/alice/{user:>300000000}", "/homes/alice/{x}{"])
async def test_a_checkpoint_location_is_taken_as_written_and_never_formatted(
    api: httpx.AsyncClient, place: str
) -> None:
    made = await api.post("/jobs", json={**JOB, "checkpoint_uri": place})
    assert made.status_code == 201, made.text
    assert made.json()["checkpoint_uri"] == place


async def test_a_job_name_that_moves_the_default_checkpoint_location_is_a_400(
    api: httpx.AsyncClient,
) -> None:
    message = refused(await api.post("/jobs", json={**JOB, "name": "../../bob"}))
    assert "'/checkpoints/alice/../../bob' must be an absolute path without .. parts" in message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"checkpoint_uri": "/etc"}, "checkpoint_uri /etc must be in /homes/"),
        ({"env": {"A=B": "x"}}, "env: 'A=B' is not a variable name"),
        ({"env": {"A": "x\0"}}, "env: the value of A holds a NUL character"),
        ({"python": "/etc/passwd"}, "python /etc/passwd is not an executable file"),
        ({"args": ["\0"]}, "args[0] holds a NUL character"),
        ({"cwd": "here"}, "cwd 'here' must be an absolute path"),
    ],
)
async def test_a_job_no_node_could_run_as_asked_is_a_400_saying_what_to_change(
    api: httpx.AsyncClient, fields: dict[str, Any], expected: str
) -> None:
    message = refused(await api.post("/jobs", json={**JOB, **fields}))
    assert message.startswith("the job cannot run as submitted: ") and expected in message


async def test_a_drain_later_than_the_scheduler_can_keep_is_a_400_naming_the_latest(
    admin_api: httpx.AsyncClient,
) -> None:
    # Once in UTC this is past 9999-12-31: APScheduler's conversion overflowed (a 500).
    at = "9999-12-31T23:59:59-14:00"
    message = refused(await admin_api.post("/nodes/a1/drain", json={"at": at}))
    assert message == f"{at} is later than 9999-12-31T23:59:59Z, the latest time a drain takes"
    assert (await admin_api.get("/timed")).json() == {"items": []}


async def test_a_drain_at_the_latest_time_is_kept_as_a_timed_job(
    admin_api: httpx.AsyncClient,
) -> None:
    response = await admin_api.post(
        "/nodes/a1/drain", json={"at": "9999-12-31T23:59:59Z", "reason": "end of an era"}
    )
    assert response.status_code == 202, response.text
    assert response.json()["at"] == "9999-12-31T23:59:59Z"
    listed = (await admin_api.get("/timed")).json()["items"]  # read back from the job store
    assert [job["at"] for job in listed] == ["9999-12-31T23:59:59Z"]


@pytest.mark.parametrize(
    "progress",
    [
        {"step": 5, "step_at": "9999-12-31T23:59:59-14:00"},
        {"checkpoint_started": {"step": 5, "at": "9999-12-31T23:59:59-14:00"}},
        {"checkpoints_saved": [{"uri": "s3://c/5", "step": 5, "at": "0001-01-01T00:00+01:00"}]},
    ],
    ids=["step_at", "checkpoint_started", "checkpoints_saved"],
)
async def test_a_job_progress_time_outside_what_utc_holds_is_a_400(
    api: httpx.AsyncClient, progress: dict[str, Any]
) -> None:
    # A running job's record converts each to UTC: an OverflowError there was a 500.
    body = {"nodes": ["a1"], "progress": [{"workload_id": 1, "pod_index": 0, **progress}]}
    message = refused(await api.post("/agent/pods", json=body))
    assert "is outside the years 1-9999 in UTC" in message


@pytest.mark.parametrize("at", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
async def test_a_gpu_sample_at_no_finite_time_is_a_400(api: httpx.AsyncClient, at: bytes) -> None:
    # Python's and pydantic's JSON readers take NaN and Infinity; no store or page should.
    body = b'{"samples": [{"uuid": "GPU-a1-0", "index": 0, "at": ' + at + b"}]}"
    message = refused(await api.post("/agent/samples", content=body))
    assert "samples.0.at: Input should be a finite number" in message


# --------------------------------------------------------------- media types
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/sessions"),
        ("POST", "/jobs"),
        ("POST", "/workloads/1/release"),
        ("PUT", "/sessions/1/keep-alive"),
        ("PATCH", "/projects/vision"),
        ("POST", "/agent/heartbeat"),
    ],
)
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/xml",
        "application/json-seq",
        "application/json; charset=latin-1",
        "",
    ],
)
async def test_a_write_whose_body_is_not_json_is_a_415(
    api: httpx.AsyncClient, method: str, path: str, content_type: str
) -> None:
    response = await api.request(
        method, path, content=b'{"nodes": []}', headers={"Content-Type": content_type}
    )
    message = refused(response, 415)
    assert response.json()["code"] == "unsupported-media-type"
    assert "send" in message and "JSON" in message


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/json; charset=utf-8"},
        {"Content-Type": "Application/JSON"},
        {},  # no Content-Type at all: read as JSON
    ],
)
async def test_json_with_or_without_a_content_type_is_read(
    api: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    body = SessionRequestIn.model_validate(SESSION).model_dump_json().encode()
    response = await api.post("/sessions", params={"dry_run": "1"}, content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json() == {"valid": True}


async def test_a_write_without_a_body_needs_no_content_type(api: httpx.AsyncClient) -> None:
    response = await api.post("/workloads/12345/renew", headers={"Content-Type": "text/plain"})
    refused(response, 404)  # no such workload: the media type did not matter


# ------------------------------------------------------------ the spawner's client
async def test_the_spawners_client_fails_a_refused_request_with_the_message(
    api: httpx.AsyncClient,
) -> None:
    client = ControllerClient(str(api.base_url), "unused")
    try:
        with pytest.raises(RequestRejected) as caught:
            await client.open_session({**SESSION, "gpus": HUGE}, dry_run=True)
    finally:
        await client.aclose()
    assert caught.value.status == 400
    assert str(caught.value).startswith("the GPU count must be a whole number such as 1 or 2")


class FailingHandler(web.RequestHandler):
    def post(self, workload_id: str) -> None:
        self.set_status(500)
        self.finish({"code": "internal", "message": "internal error; see the controller log"})


async def test_the_spawners_client_reports_a_500_with_its_status_and_words() -> None:
    app = web.Application([(r"/workloads/(\d+)/renew", FailingHandler)])
    async for url in serve(app):
        client = ControllerClient(url, "unused")
        try:
            with pytest.raises(ControllerUnavailable) as caught:
                await client.renew(1)
        finally:
            await client.aclose()
    assert caught.value.status == 500
    assert str(caught.value) == (
        "the gpufleet controller failed (500): internal error; see the controller log"
    )


async def test_ready_says_whether_this_controller_leads(tmp_path: Path) -> None:
    """A Kubernetes readiness probe keeps a standing-by controller out of its Service."""
    anyone = Identity("user", "bob", frozenset(), by_cookie=False)
    controller = Controller(fleet_store(tmp_path / "gpufleet.sqlite"), anyone)
    async for url in serve(web.Application(routes(PREFIX, controller))):
        async with httpx.AsyncClient(base_url=f"{url}{PREFIX}api/v1", timeout=30) as client:
            leading = await client.get("/ready")
            controller.is_leader = False
            standing_by = await client.get("/ready")
    assert (leading.status_code, leading.json()) == (200, {"leader": True})
    assert (standing_by.status_code, standing_by.json()) == (503, {"leader": False})
