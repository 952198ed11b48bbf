"""``ServerStopper``, the one way the controller stops a user's server (the culler,
preemption, the reconciler), against a fake hub API on loopback that answers each
``DELETE`` as the test scripts it, over a real store (SQLite).

What a user would notice: the reason the caller gives is the event recorded, a server
that is already gone is no error, a hub that answers 5xx or not at all is asked again a
bounded number of times and then reported, and an answer that will not change (400, a
missing scope) is not asked again at once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from tornado import web
from tornado.testing import bind_unused_port

from gpufleet.api.events import EventKind
from gpufleet.hub.stopper import ServerStopper, StopOutcome
from gpufleet.scheduler.validation import SessionRequest
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Event

from .test_api_input import fleet_store, serve

TOKEN = "controller-token"
LOG = logging.getLogger("test_server_stopper")


@dataclass
class FakeHub:
    """Answers each stop with the next scripted status (the last one from then on) and
    keeps every request it got: (method, path, Authorization header)."""

    statuses: list[int] = field(default_factory=lambda: [204])
    requests: list[tuple[str, str, str]] = field(default_factory=list)

    def answer(self, handler: web.RequestHandler) -> None:
        request = handler.request
        self.requests.append(
            (request.method or "", request.path, request.headers.get("Authorization", ""))
        )
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        handler.set_status(status)
        handler.finish(None if status == 204 else f"scripted {status}")


class _StopHandler(web.RequestHandler):
    def initialize(self, hub: FakeHub) -> None:
        self.hub = hub

    def delete(self, *_: str) -> None:
        self.hub.answer(self)


@dataclass
class Fixture:
    hub: FakeHub
    store: FleetStore
    url: str
    workload_id: int

    def stopper(self, url: str | None = None, **options: Any) -> ServerStopper:
        return ServerStopper(
            self.url if url is None else url,
            TOKEN,
            self.store,
            LOG,
            lambda: datetime.now(UTC),
            **{"retry_delay": 0.0, **options},
        )

    def events(self) -> list[dict[str, Any]]:
        with self.store.read() as session:
            return [
                {
                    "kind": e.kind,
                    "message": e.message,
                    "reason": e.reason,
                    "cause": e.cause,
                    "workload_id": e.workload_id,
                    "username": e.username,
                    "data": e.data,
                }
                for e in session.scalars(
                    select(Event).where(Event.kind == EventKind.RECONCILED).order_by(Event.id)
                )
            ]


@pytest.fixture
async def fx(tmp_path: Path) -> AsyncIterator[Fixture]:
    """A fake hub API and a store where alice has a session (waiting: its state does not
    matter to a stop)."""
    hub = FakeHub()
    store = fleet_store(tmp_path / "gpufleet.sqlite")
    request = SessionRequest("alice", "", "vision", "A100", 1, None)
    workload = store.workloads.open_session_request(
        datetime.now(UTC), request, timedelta(minutes=5)
    )
    app = web.Application([(r"/hub/api/users/.*", _StopHandler, {"hub": hub})])
    async for url in serve(app):
        yield Fixture(hub, store, f"{url}/hub/api", workload.id)


async def stop_for_the_reconciler(
    stopper: ServerStopper, workload_id: int, server_name: str = ""
) -> StopOutcome:
    return await stopper.stop(
        "alice",
        server_name,
        workload_id=workload_id,
        message="the hub runs alice's server but its workload ended",
        by="reconciler",
        event=EventKind.RECONCILED,
        reason="server-without-gpus",
        data={"repair": "stop-server"},
    )


RECORDED = {
    "kind": "reconciled",
    "message": "the hub runs alice's server but its workload ended",
    "reason": "server-without-gpus",
    "cause": "reconciler",
    "username": "alice",
    "data": {"repair": "stop-server"},
}


@pytest.mark.parametrize("status", [202, 204])
async def test_a_stop_the_hub_takes_records_the_callers_reason_once(
    fx: Fixture, status: int
) -> None:
    fx.hub.statuses = [status]
    outcome = await stop_for_the_reconciler(fx.stopper(), fx.workload_id)
    assert outcome is StopOutcome.STOPPING and outcome.stopped
    assert fx.hub.requests == [("DELETE", "/hub/api/users/alice/server", f"token {TOKEN}")]
    assert fx.events() == [{**RECORDED, "workload_id": fx.workload_id}]


async def test_a_named_server_is_stopped_by_its_quoted_name(fx: Fixture) -> None:
    await stop_for_the_reconciler(fx.stopper(), fx.workload_id, "gpu run/2")
    assert [path for _, path, _ in fx.hub.requests] == [
        "/hub/api/users/alice/servers/gpu%20run%2F2"
    ]


async def test_a_server_already_gone_is_no_error_and_its_stop_is_recorded(fx: Fixture) -> None:
    fx.hub.statuses = [404]
    outcome = await stop_for_the_reconciler(fx.stopper(), fx.workload_id)
    assert outcome is StopOutcome.GONE and outcome.stopped
    assert len(fx.hub.requests) == 1  # not asked again
    assert fx.events() == [{**RECORDED, "workload_id": fx.workload_id}]


async def test_a_stop_with_no_event_records_nothing(fx: Fixture) -> None:
    # The culler and preemption recorded the reason when they decided the stop.
    outcome = await fx.stopper().stop(
        "alice", "", workload_id=fx.workload_id, message="idle for 45 min", by="culler"
    )
    assert outcome is StopOutcome.STOPPING
    assert fx.events() == []


async def test_a_hub_answering_5xx_is_asked_again_until_it_takes_the_stop(fx: Fixture) -> None:
    fx.hub.statuses = [503, 502, 202]
    outcome = await stop_for_the_reconciler(fx.stopper(attempts=3), fx.workload_id)
    assert outcome is StopOutcome.STOPPING
    assert len(fx.hub.requests) == 3
    assert fx.events() == [{**RECORDED, "workload_id": fx.workload_id}]


async def test_a_hub_that_keeps_answering_5xx_is_reported_and_nothing_is_recorded(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    fx.hub.statuses = [500]
    with caplog.at_level(logging.WARNING, LOG.name):
        outcome = await stop_for_the_reconciler(fx.stopper(attempts=3), fx.workload_id)
    assert outcome is StopOutcome.REFUSED and not outcome.stopped
    assert len(fx.hub.requests) == 3
    assert fx.events() == []
    [record] = [r for r in caplog.records if r.name == LOG.name]
    assert record.levelno == logging.WARNING
    said = record.getMessage()
    assert f"alice's server (default) (workload {fx.workload_id})" in said
    assert "500 scripted 500 after 3 attempt(s)" in said
    assert "the reconciler asks again later" in said


async def test_an_answer_that_will_not_change_is_not_asked_again_at_once(fx: Fixture) -> None:
    fx.hub.statuses = [400]
    outcome = await stop_for_the_reconciler(fx.stopper(attempts=3), fx.workload_id)
    assert outcome is StopOutcome.REFUSED
    assert len(fx.hub.requests) == 1
    assert fx.events() == []


async def test_a_missing_scope_is_reported_as_the_scope_to_grant(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    fx.hub.statuses = [403]
    with caplog.at_level(logging.WARNING, LOG.name):
        outcome = await stop_for_the_reconciler(fx.stopper(), fx.workload_id)
    assert outcome is StopOutcome.REFUSED
    [record] = [r for r in caplog.records if r.name == LOG.name]
    assert record.levelno == logging.ERROR
    assert "the gpufleet-controller role needs admin:servers" in record.getMessage()


async def test_a_hub_that_does_not_answer_is_asked_again_then_reported_unreachable(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    sock, port = bind_unused_port()
    sock.close()  # nothing listens there: every connection is refused
    with caplog.at_level(logging.WARNING, LOG.name):
        outcome = await stop_for_the_reconciler(
            fx.stopper(f"http://127.0.0.1:{port}/hub/api", attempts=2), fx.workload_id
        )
    assert outcome is StopOutcome.UNREACHABLE and not outcome.stopped
    assert fx.events() == []
    [record] = [r for r in caplog.records if r.name == LOG.name]
    assert "no answer after 2 attempt(s): ConnectError" in record.getMessage()


async def test_without_a_hub_api_nothing_is_asked_and_the_stop_is_reported(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, LOG.name):
        outcome = await stop_for_the_reconciler(fx.stopper(""), fx.workload_id)
    assert outcome is StopOutcome.UNREACHABLE
    assert fx.hub.requests == []
    [record] = [r for r in caplog.records if r.name == LOG.name]
    assert "no hub API ($JUPYTERHUB_API_URL)" in record.getMessage()


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"attempts": 0}, "attempts must be at least 1, not 0"),
        ({"timeout": 0.0}, "timeout must be positive"),
        ({"retry_delay": -1.0}, "retry_delay not negative"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(
    tmp_path: Path, options: dict[str, Any], problem: str
) -> None:
    store = fleet_store(tmp_path / "gpufleet.sqlite")
    with pytest.raises(ValueError, match=problem):
        ServerStopper("http://hub/api", TOKEN, store, LOG, lambda: datetime.now(UTC), **options)
