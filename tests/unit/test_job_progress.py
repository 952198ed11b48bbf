"""Job progress from inside training (issue 21, part 2): the light SDK's reporter
(sdk/reporting.py) against a real HTTP endpoint, the agent's endpoint and merge
(agent/progress.py), and the store's record (scheduler/store/progress.py) on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpufleet import reporting as sdk_progress
from gpufleet.agent.progress import RankReport, merge, progress_app
from gpufleet.scheduler.store.fleet import FleetStore
from gpufleet.scheduler.store.models import Event, JobProgress
from gpufleet.scheduler.store.progress import ProgressReport, Saved, percentile, progress_json

from .test_store import make_store, t, workload
from .test_store_jobs import NODES, PodReport, submit


class Endpoint:
    """A real HTTP endpoint that keeps what it was sent (and can hang or refuse)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.hang = threading.Event()
        self.refuse = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.hang.is_set():
                    time.sleep(3)
                if outer.refuse:
                    self.send_response(503)
                    self.end_headers()
                    return
                outer.received.append((self.headers.get("X-Gpufleet-Marker", ""), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/progress"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    made = Endpoint()
    yield made
    made.close()


def test_a_report_carries_the_latest_step_the_step_times_and_checkpoints(
    endpoint: Endpoint,
) -> None:
    reporter = sdk_progress.Reporter(endpoint.url, "marker-1", interval=3600)
    for step in range(1, 11):
        reporter.progress(step, {"loss": 1.0 / step, "tokens": 512, "note": "not a number"})
        time.sleep(0.01)
    reporter.checkpoint_started(10)
    assert reporter.flush()
    ((marker, body),) = endpoint.received
    assert marker == "marker-1"
    assert body["step"] == 10 and body["step_age_s"] < 1
    assert len(body["step_times_s"]) == 9 and all(0.005 < s < 1 for s in body["step_times_s"])
    assert body["metrics"] == {"loss": 0.1, "tokens": 512.0}  # numbers only
    assert body["checkpoint_started"]["step"] == 10
    assert reporter.flush() and len(endpoint.received) == 1  # nothing new: nothing sent

    reporter.checkpoint_saved("s3://ckpt/alice/train/step-10", 10)
    # A saved checkpoint is sent at once, by the reporter's thread.
    deadline = time.monotonic() + 10
    while len(endpoint.received) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    saved = endpoint.received[1][1]
    assert saved["checkpoint_started"] is None
    assert [(c["uri"], c["step"]) for c in saved["checkpoints_saved"]] == [
        ("s3://ckpt/alice/train/step-10", 10)
    ]


def test_a_step_is_never_held_up_and_a_saved_checkpoint_survives_a_failed_send(
    endpoint: Endpoint,
) -> None:
    reporter = sdk_progress.Reporter(endpoint.url, "m", interval=3600, timeout=0.5)
    endpoint.hang.set()
    reporter.checkpoint_saved("/ckpt/1", 1)  # its thread now waits on the hung endpoint
    started = time.monotonic()
    for step in range(1000):
        reporter.progress(step, {"loss": 0.5})
    assert time.monotonic() - started < 0.5  # 1,000 steps, no waiting on the network
    endpoint.hang.clear()
    endpoint.refuse = True
    reporter.checkpoint_saved("/ckpt/2", 2)
    assert not reporter.flush()
    endpoint.refuse = False
    deadline = time.monotonic() + 10
    while not reporter.flush() and time.monotonic() < deadline:
        time.sleep(0.05)
    saved = [c["step"] for _, body in endpoint.received for c in body["checkpoints_saved"]]
    assert 2 in saved  # said again until it arrived


def test_outside_a_job_and_on_other_local_ranks_the_calls_do_nothing(
    monkeypatch: pytest.MonkeyPatch, endpoint: Endpoint
) -> None:
    for env in ({}, {"LOCAL_RANK": "1"}):
        monkeypatch.setattr(sdk_progress, "_reporter", None)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        monkeypatch.setenv(sdk_progress.URL_VARIABLE, endpoint.url)
        monkeypatch.setenv(sdk_progress.MARKER_VARIABLE, "m")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if not env:
            monkeypatch.delenv(sdk_progress.URL_VARIABLE)
        sdk_progress.progress(1, loss=1.0)
        sdk_progress.checkpoint_saved("/x", 1)
        assert isinstance(sdk_progress._reporter, sdk_progress._Silent)
    assert endpoint.received == []
    monkeypatch.setattr(sdk_progress, "_reporter", None)


# ------------------------------------------------------------ the agent's side
NOW = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)


def test_ages_become_the_agents_times_and_a_saved_checkpoint_ends_the_one_in_flight() -> None:
    first = RankReport.model_validate(
        {
            "step": 100,
            "step_age_s": 2.0,
            "step_times_s": [0.5, 0.6],
            "metrics": {"loss": 2.5},
            "checkpoint_started": {"step": 100, "age_s": 1.0},
        }
    )
    kept = merge(None, first, NOW)
    assert kept["step_at"] == (NOW - timedelta(seconds=2)).isoformat()
    assert kept["checkpoint_started"] == {
        "step": 100,
        "at": (NOW - timedelta(seconds=1)).isoformat(),
    }
    second = RankReport.model_validate(
        {
            "step": 105,
            "step_age_s": 0.0,
            "step_times_s": [0.7],
            "metrics": {"tokens": 9.0},
            "checkpoints_saved": [{"uri": "/c/100", "step": 100, "age_s": 0.5}],
        }
    )
    kept = merge(kept, second, NOW)
    assert kept["step"] == 105 and kept["step_times_s"] == [0.5, 0.6, 0.7]
    assert kept["metrics"] == {"loss": 2.5, "tokens": 9.0}
    assert kept["checkpoint_started"] is None
    assert [c["step"] for c in kept["checkpoints_saved"]] == [100]


async def test_the_agents_endpoint_takes_reports_only_from_its_pods_processes() -> None:
    noted: list[tuple[tuple[int, int], RankReport]] = []
    pods = {"pod-marker": (7, 1)}
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(progress_app(pods.get, lambda pod, r, _now: noted.append((pod, r))))
    server.add_sockets(sockets)
    url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/progress"
    try:
        async with httpx.AsyncClient() as client:
            body = {"step": 3, "step_age_s": 0.1}
            unknown = await client.post(url, json=body, headers={"X-Gpufleet-Marker": "guessed"})
            assert unknown.status_code == 403
            missing = await client.post(url, json=body)
            assert missing.status_code == 403
            bad = await client.post(
                url, json={"step": -1}, headers={"X-Gpufleet-Marker": "pod-marker"}
            )
            assert bad.status_code == 400
            ok = await client.post(url, json=body, headers={"X-Gpufleet-Marker": "pod-marker"})
            assert ok.status_code == 204
    finally:
        server.stop()
    assert [(pod, r.step) for pod, r in noted] == [((7, 1), 3)]


# ------------------------------------------------------------ the store
@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def test_the_store_keeps_a_jobs_progress_and_its_last_checkpoint(store: FleetStore) -> None:
    job = submit(store)
    store.agent_sync(t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], [])
    at = t(20)
    store.agent_sync(
        t(21),
        NODES,
        [],
        [],
        [
            ProgressReport(job, 0, 40, at, [1.0] * 98 + [2.0, 9.0], {"loss": 1.5}, (40, at)),
            ProgressReport(job, 1, 39, at, [1.1], {}),
        ],
    )
    store.agent_sync(
        t(30),
        NODES,
        [],
        [],
        [ProgressReport(job, 0, checkpoints_saved=[Saved("/c/40", 40, t(29))])],
    )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None
        shown = progress_json(row)
        events = session.scalars(select(Event).where(Event.workload_id == job)).all()
    assert shown["last_step"] == 40 and shown["last_step_at"] == at
    assert shown["step_time_p50_s"] == 1.0 and shown["step_time_p99_s"] == 2.0
    assert shown["checkpoint_in_flight"] is None
    assert shown["last_checkpoint"] == {"uri": "/c/40", "step": 40, "at": t(29)}
    assert workload(store, job).last_checkpoint_at == t(29)
    assert [e.message for e in events if e.kind == "job-checkpoint-saved"] == [
        "job train: the checkpoint of step 40 is saved (/c/40)"
    ]
    # An older checkpoint reported late does not replace it.
    store.agent_sync(
        t(31),
        NODES,
        [],
        [],
        [ProgressReport(job, 1, checkpoints_saved=[Saved("/c/30", 30, t(25))])],
    )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None and row.last_checkpoint_uri == "/c/40"


def test_a_report_of_a_job_that_is_not_running_changes_nothing(store: FleetStore) -> None:
    job = submit(store)  # admitted, not running yet
    store.agent_sync(t(12), NODES, [], [], [ProgressReport(job, 0, 5, t(12))])
    with store.read() as session:
        assert session.get(JobProgress, job) is None


@pytest.mark.parametrize(
    ("values", "share", "expected"),
    [
        ([], 0.5, None),
        ([3.0], 0.99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 0.99, 4.0),
    ],
)
def test_percentiles_are_nearest_rank(
    values: list[float], share: float, expected: float | None
) -> None:
    assert percentile(values, share) == expected
