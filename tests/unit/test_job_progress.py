"""Job progress from inside training: the light SDK's reporter
(sdk/reporting.py) against a real HTTP endpoint, the agent's endpoint and merge
(agent/progress.py), and the store's record (state/progress.py) on SQLite and
PostgreSQL."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpufleet import reporting as sdk_progress
from gpufleet.agent.peers import Caller, ReportRefused
from gpufleet.agent.progress import RankReport, merge, progress_app
from gpufleet.api.jobs import JobProgressOut, PodProgressIn
from gpufleet.recovery.classify import JobProgress as JobProgressSeen
from gpufleet.recovery.classify import RecoveryPolicy, hang_of
from gpufleet.state import db
from gpufleet.state.fleet import FleetStore
from gpufleet.state.models import Event, JobProgress, Workload
from gpufleet.state.progress import (
    HISTORY_POINTS,
    ProgressReport,
    Saved,
    add_point,
    history_points,
    merge_report,
    new_progress,
    percentile,
    progress_json,
)

from .test_store import make_store, t, workload
from .test_store_jobs import NODES, PodReport, submit


class Endpoint:
    """A real HTTP endpoint that keeps what it was sent (and can hang or refuse)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.hang = threading.Event()
        self.arrived = threading.Event()  # a report reached the endpoint (maybe held there)
        self.refuse = False
        # An answer to a report with a checkpoint: a refusal (403), or a 200 saying it
        # was left out, as the agent gives them.
        self.on_checkpoint: tuple[int, str] | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.arrived.set()
                if outer.hang.is_set():
                    time.sleep(3)
                if outer.refuse:
                    self.send_response(503)
                    self.end_headers()
                    return
                outer.received.append((self.headers.get("X-Gpufleet-Marker", ""), body))
                if outer.on_checkpoint is not None and body["checkpoints_saved"]:
                    status, text = outer.on_checkpoint
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(text.encode())))
                    self.end_headers()
                    self.wfile.write(text.encode())
                    return
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


@pytest.mark.parametrize(
    "answer",
    [
        (403, "403: the report does not come from the account this pod's ranks run as"),
        (200, "checkpoint /tmp/x is left out: it is not inside this job's checkpoint location"),
    ],
)
def test_a_report_the_agent_refuses_or_cuts_is_said_once_and_never_holds_up_the_next(
    endpoint: Endpoint, capsys: pytest.CaptureFixture[str], answer: tuple[int, str]
) -> None:
    endpoint.on_checkpoint = answer
    reporter = sdk_progress.Reporter(endpoint.url, "marker-1", interval=3600)
    reporter.checkpoint_saved("/tmp/x", 10)
    reporter.flush()
    for step in (11, 12):
        reporter.progress(step, {})
        reporter.flush()
    sent = [body for _, body in endpoint.received]
    # The checkpoint went once; the steps after it arrived without it.
    assert [(b["step"], len(b["checkpoints_saved"])) for b in sent] == [(None, 1), (11, 0), (12, 0)]
    said = capsys.readouterr().err
    assert said.count(answer[1]) == 1, said


def test_a_relative_checkpoint_path_is_sent_absolute(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    reporter = sdk_progress.Reporter(endpoint.url, "marker-1", interval=3600)
    reporter.checkpoint_saved("ckpt/step-10.pt", 10)
    reporter.checkpoint_saved("s3://bucket/step-11", 11)
    assert reporter.flush()
    uris = [c["uri"] for c in endpoint.received[0][1]["checkpoints_saved"]]
    assert uris == [str(tmp_path / "ckpt" / "step-10.pt"), "s3://bucket/step-11"]


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


def test_the_flush_at_exit_waits_for_the_last_report_still_in_flight(
    endpoint: Endpoint,
) -> None:
    """A rank's last step and checkpoint go out on the reporter's thread as the script
    ends; the flush at exit must not find "nothing new" and let the process end mid-send."""
    reporter = sdk_progress.Reporter(endpoint.url, "m", interval=3600, timeout=10)
    endpoint.hang.set()
    reporter.progress(24, {}, epoch=1)
    reporter.checkpoint_saved("/ckpt/epoch-1", 24, epoch=1)  # wakes the thread
    assert endpoint.arrived.wait(10)  # the thread's report is held at the endpoint
    assert reporter.flush()  # what atexit runs
    assert [(b["step"], b["epoch"], len(b["checkpoints_saved"])) for _, b in endpoint.received] == [
        (24, 1, 1)
    ]


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
    callers: list[Caller | None] = []

    def pod_of(marker: str, caller: Caller | None) -> tuple[int, int]:
        callers.append(caller)  # what the kernel says of the calling socket
        if marker != "pod-marker":
            raise ReportRefused("no pod of this machine carries that marker")
        return (7, 1)

    def own(pod: tuple[int, int], report: RankReport) -> tuple[RankReport, list[str]]:
        kept = [c for c in report.checkpoints_saved if c.uri.startswith("/c/")]
        left_out = [f"{c.uri} is left out" for c in report.checkpoints_saved if c not in kept]
        return report.model_copy(update={"checkpoints_saved": kept}), left_out

    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(progress_app(pod_of, own, lambda pod, r, _now: noted.append((pod, r))))
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
            # A checkpoint outside the job's location is left out, the rest is taken.
            elsewhere = {
                "step": 4,
                "checkpoints_saved": [
                    {"uri": "/other/1", "step": 1, "age_s": 0},
                    {"uri": "/c/2", "step": 2, "age_s": 0},
                ],
            }
            partly = await client.post(
                url, json=elsewhere, headers={"X-Gpufleet-Marker": "pod-marker"}
            )
            assert (partly.status_code, partly.text) == (200, "/other/1 is left out\n")
    finally:
        server.stop()
    assert [(pod, r.step) for pod, r in noted] == [((7, 1), 3), ((7, 1), 4)]
    assert [c.uri for c in noted[1][1].checkpoints_saved] == ["/c/2"]
    # This test's own process opened every connection: the kernel names its socket.
    assert callers and all(c is not None and c.uid == os.getuid() for c in callers)


# ------------------------------------------------------------ the store
@pytest.fixture
def store(engine: Engine) -> FleetStore:
    return make_store(engine)


def test_the_store_keeps_a_jobs_progress_and_its_last_checkpoint(store: FleetStore) -> None:
    job = submit(store)
    store.jobs.agent_sync(
        t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], []
    )
    at = t(20)
    store.jobs.agent_sync(
        t(21),
        NODES,
        [],
        [],
        [
            ProgressReport(job, 0, 40, at, [1.0] * 98 + [2.0, 9.0], {"loss": 1.5}, (40, at)),
            ProgressReport(job, 1, 39, at, [1.1], {}),
        ],
    )
    store.jobs.agent_sync(
        t(30),
        NODES,
        [],
        [],
        [ProgressReport(job, 0, checkpoints_saved=[Saved("/ckpt/carol/train/40", 40, t(29))])],
    )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None
        shown = progress_json(row)
        events = session.scalars(select(Event).where(Event.workload_id == job)).all()
    assert shown["last_step"] == 40 and shown["last_step_at"] == at
    assert shown["step_time_p50_s"] == 1.0 and shown["step_time_p99_s"] == 2.0
    assert shown["checkpoint_in_flight"] is None
    assert shown["last_checkpoint"] == {
        "uri": "/ckpt/carol/train/40",
        "step": 40,
        "epoch": None,
        "at": t(29),
    }
    assert shown["checkpoints_saved"] == 1 and shown["checkpoints_saved_by_attempt"] == {1: 1}
    assert workload(store, job).last_checkpoint_at == t(29)
    # A checkpoint is progress, not an event: the job's events stay its life's turns.
    assert [e.kind for e in events] == ["requested", "admitted", "started"]
    # An older checkpoint reported late does not replace it.
    store.jobs.agent_sync(
        t(31),
        NODES,
        [],
        [],
        [ProgressReport(job, 1, checkpoints_saved=[Saved("/ckpt/carol/train/30", 30, t(25))])],
    )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None and row.last_checkpoint_uri == "/ckpt/carol/train/40"


def test_a_report_of_a_job_that_is_not_running_changes_nothing(store: FleetStore) -> None:
    job = submit(store)  # admitted, not running yet
    store.jobs.agent_sync(t(12), NODES, [], [], [ProgressReport(job, 0, 5, t(12))])
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


# ------------------------------------------------------------ the merge, alone
def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


def detached(attempt: int = 1) -> tuple[Workload, JobProgress]:
    return Workload(id=7, attempt=attempt), new_progress(7, NOW)


def test_a_step_counter_that_restarts_every_epoch_is_progress_and_no_hang() -> None:
    # 1,000 steps an epoch, numbered from 0 in each, one a second; a report every 5 s.
    job, row = detached()
    for second in range(0, 1705, 5):
        epoch, step = divmod(second, 1000)
        at = NOW + seconds(second)
        report = ProgressReport(7, 0, step, at, [1.0] * 5 if second else [], epoch=epoch)
        merge_report(job, row, report, at, first=second == 0)
    assert (row.last_epoch, row.last_step, row.last_step_at) == (1, 700, NOW + seconds(1700))
    seen = JobProgressSeen(
        started_at=NOW.timestamp(),
        last_step_at=row.last_step_at.timestamp(),
        p99_step_s=percentile(row.step_times, 0.99),
    )
    # Ten minutes after epoch 0's highest step, the job still steps every second.
    assert hang_of(seen, (NOW + seconds(1705)).timestamp(), RecoveryPolicy()) is None
    hang = hang_of(seen, (NOW + seconds(2301)).timestamp(), RecoveryPolicy())
    assert hang is not None and (hang.kind, hang.quiet_s) == ("step", 601)


def test_a_step_without_a_number_is_progress_and_its_loss_is_charted() -> None:
    job, row = detached()
    for second, loss in ((0, 2.0), (5, 1.5), (10, float("nan"))):
        at = NOW + seconds(second)
        report = ProgressReport(7, 0, step_at=at, metrics={"loss": loss})
        merge_report(job, row, report, at, first=second == 0)
    assert row.last_step is None and row.last_step_at == NOW + seconds(10)
    # A loss gone NaN is a gap in the chart, and stays NaN in the metrics.
    assert [(p.at, p.step, p.loss) for p in history_points(row)] == [
        (NOW, None, 2.0),
        (NOW + seconds(5), None, 1.5),
        (NOW + seconds(10), None, None),
    ]
    shown = JobProgressOut(**progress_json(row))
    assert str(shown.metrics["loss"]) == "nan"
    assert JobProgressOut.model_validate_json(shown.model_dump_json()).last_step is None


def test_the_history_keeps_at_most_its_points_spread_over_the_jobs_whole_life() -> None:
    history: dict[str, Any] = {}
    for second in range(20_000):
        history = add_point(history, [float(second), second, None, 1.0 / (second + 1)], keep=64)
        assert len(history["points"]) <= 64
    points, every = history["points"], history["every_s"]
    assert points[0][0] == 0 and points[-1][0] == 19_999  # the first and the latest
    assert len(points) >= 32
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(points[:-1])]
    assert all(every <= gap <= 2 * every for gap in gaps), (every, gaps)
    # A report from another node that arrives late takes its place in time.
    late = add_point(
        {"every_s": 0.0, "points": [[1.0, 1, None, None], [3.0, 3, None, None]]},
        [2.0, 2, None, None],
    )
    assert [p[0] for p in late["points"]] == [1.0, 2.0, 3.0]
    assert HISTORY_POINTS >= 64


def test_reports_of_one_moment_keep_the_step_further_on_and_an_epoch_orders_too() -> None:
    job, row = detached()
    merge_report(job, row, ProgressReport(7, 0, 40, NOW), NOW, first=True)
    merge_report(job, row, ProgressReport(7, 1, 39, NOW), NOW, first=False)
    assert row.last_step == 40
    merge_report(job, row, ProgressReport(7, 1, 3, NOW, epoch=2), NOW, first=False)
    assert (row.last_epoch, row.last_step) == (2, 3)
    # An older report that arrives late changes nothing.
    merge_report(job, row, ProgressReport(7, 0, 90, NOW - seconds(1)), NOW, first=False)
    assert (row.last_epoch, row.last_step) == (2, 3)


# ------------------------------------------------------------ the SDK and the agent
def test_a_counter_that_restarts_every_epoch_times_steps_only_within_an_epoch(
    endpoint: Endpoint,
) -> None:
    reporter = sdk_progress.Reporter(endpoint.url, "marker-1", interval=3600)
    for epoch in range(2):
        for step in range(5):
            reporter.progress(step, {}, epoch)
            time.sleep(0.01)
    reporter.progress(None, {"loss": 0.5})  # a step without a number keeps the last ones
    reporter.checkpoint_saved("/ckpt/e1", 4, epoch=1)
    assert reporter.flush()
    body = endpoint.received[-1][1]
    assert (body["epoch"], body["step"]) == (1, 4)
    # Four step times in each epoch: none from step 4 of epoch 0 to step 0 of epoch 1.
    assert len(body["step_times_s"]) == 8
    assert all(0.005 < s < 1 for s in body["step_times_s"])
    assert [(c["step"], c["epoch"]) for c in body["checkpoints_saved"]] == [(4, 1)]
    # The agent takes it as it is.
    assert RankReport.model_validate(body).epoch == 1


def test_a_report_without_an_epoch_does_not_name_one() -> None:
    # An agent or a controller older than the epoch refuses a key it does not know.
    reporter = sdk_progress.Reporter("http://127.0.0.1:9/progress", "m", interval=3600)
    reporter.progress(3, {})
    reporter.checkpoint_saved("/c", 3)
    body = reporter.take()
    assert body is not None and "epoch" not in body
    assert "epoch" not in body["checkpoints_saved"][0]
    kept = merge(None, RankReport.model_validate({"step": 3, "step_age_s": 0.0}), NOW)
    assert "epoch" not in kept


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda: sdk_progress.progress(-1), ValueError, "the step must be a whole number from 0"),
        (lambda: sdk_progress.progress(2.5), ValueError, "the step must be a whole number"),
        (lambda: sdk_progress.progress(3, epoch="one"), TypeError, "the epoch must be a whole"),
        (lambda: sdk_progress.checkpoint_saved("/c", 3, epoch=-2), ValueError, "the epoch"),
        (lambda: sdk_progress.checkpoint_started(True), ValueError, "the step must be"),
    ],
)
def test_a_step_or_epoch_that_is_no_whole_number_is_refused_saying_so(
    monkeypatch: pytest.MonkeyPatch, call: Any, error: type[Exception], says: str
) -> None:
    # Outside a job too: a script that runs on a laptop runs the same in a job.
    monkeypatch.setattr(sdk_progress, "_reporter", sdk_progress._Silent())
    with pytest.raises(error, match=says):
        call()
    sdk_progress.progress()  # no number at all is a step too
    sdk_progress.progress(3.0, epoch=1, loss=0.5)  # a whole float will do


def test_the_agent_keeps_the_epoch_and_a_step_without_a_number() -> None:
    numbered = {
        "step": 7,
        "epoch": 2,
        "step_age_s": 1.0,
        "checkpoints_saved": [{"uri": "/c/e2", "step": 7, "epoch": 2, "age_s": 0.0}],
    }
    kept = merge(None, RankReport.model_validate(numbered), NOW)
    assert (kept["step"], kept["epoch"]) == (7, 2)
    assert kept["checkpoints_saved"][0]["epoch"] == 2
    # A rank that never numbers its steps: its calls are progress all the same.
    kept = merge(kept, RankReport.model_validate({"step_age_s": 0.5}), NOW)
    assert kept["step"] is None and "epoch" not in kept
    assert kept["step_at"] == (NOW - timedelta(seconds=0.5)).isoformat()
    # What the agent sends, the controller takes.
    sent = json.dumps({"workload_id": 1, "pod_index": 0, **kept})
    shown = PodProgressIn.model_validate_json(sent)
    assert shown.step is None and shown.checkpoints_saved[0].epoch == 2


# ------------------------------------------------------------ the store, checkpoints
def test_a_checkpoint_adds_no_event_and_counts_once_whichever_pod_reports_it(
    store: FleetStore,
) -> None:
    job = submit(store)
    store.jobs.agent_sync(
        t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], []
    )

    def saved(at: float, pod: int, *checkpoints: Saved) -> None:
        store.jobs.agent_sync(
            t(at), NODES, [], [], [ProgressReport(job, pod, checkpoints_saved=checkpoints)]
        )

    saved(21, 0, Saved("/ckpt/carol/train/e0", 1000, t(20), epoch=0))
    saved(
        22, 1, Saved("/ckpt/carol/train/e0", 1000, t(20.5), epoch=0)
    )  # the other pod's word on it
    # The same step number, an epoch later: another checkpoint.
    saved(41, 0, Saved("/ckpt/carol/train/e1", 1000, t(40), epoch=1))
    saved(42, 1, Saved("/ckpt/carol/train/old", 500, t(15), epoch=0))  # an older one, late
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None
        shown = progress_json(row)
        kinds = session.scalars(select(Event.kind).where(Event.workload_id == job)).all()
    assert shown["checkpoints_saved"] == 2 and shown["checkpoints_saved_by_attempt"] == {1: 2}
    assert shown["last_checkpoint"] == {
        "uri": "/ckpt/carol/train/e1",
        "step": 1000,
        "epoch": 1,
        "at": t(40),
    }
    assert workload(store, job).last_checkpoint_at == t(40)
    assert list(kinds) == ["requested", "admitted", "started"]


def test_a_loss_gone_nan_is_kept_and_breaks_no_sync(store: FleetStore) -> None:
    # JSON has no NaN: PostgreSQL refused the whole sync, every pod's report with it.
    job = submit(store)
    store.jobs.agent_sync(
        t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], []
    )
    nan = ProgressReport(job, 0, 40, t(20), [], {"loss": float("nan"), "tokens": 512.0})
    store.jobs.agent_sync(t(21), NODES, [], [], [nan, ProgressReport(job, 1, 40, t(20))])
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None
        shown = JobProgressOut(**progress_json(row))
        points = history_points(row)
    assert str(shown.metrics["loss"]) == "nan" and shown.metrics["tokens"] == 512.0
    assert [(p.step, p.loss) for p in points] == [(40, None), (40, None)]


def test_the_migration_counts_the_checkpoints_saved_before_it_by_attempt(
    engine: Engine, store: FleetStore
) -> None:
    job = submit(store)
    store.jobs.agent_sync(
        t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], []
    )
    store.jobs.agent_sync(t(13), NODES, [], [], [ProgressReport(job, 0, 1, t(13))])
    with Session(engine) as session, session.begin():
        for at, kind, data in (
            (20, "job-checkpoint-saved", {"step": 10}),
            (30, "job-checkpoint-saved", {"step": 20}),
            (40, "job-restarting", {"attempt": 2}),
            (50, "job-checkpoint-saved", {"step": 30}),
        ):
            session.add(Event(at=t(at), kind=kind, message="", workload_id=job, data=data))
    db.downgrade(engine, "0019")
    db.upgrade(engine)
    with Session(engine) as session:
        row = session.get(JobProgress, job)
        assert row is not None and row.checkpoints_saved == {"1": 2, "2": 1}
        assert row.history == {} and row.last_epoch is None


def test_the_store_takes_a_checkpoint_to_resume_from_only_inside_the_jobs_location(
    store: FleetStore,
) -> None:
    job = submit(store)  # its location: /ckpt/carol/train
    store.jobs.agent_sync(
        t(12), NODES, [PodReport(job, 0, "running"), PodReport(job, 1, "running")], []
    )
    elsewhere = [
        Saved("/ckpt/bob/train/step-90", 90, t(20)),
        Saved("/ckpt/carol/train/../../bob/train/step-91", 91, t(21)),
        Saved("s3://ckpt/carol/train/step-92", 92, t(22)),
    ]
    store.jobs.agent_sync(
        t(23), NODES, [], [], [ProgressReport(job, 0, checkpoints_saved=elsewhere)]
    )
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is None or progress_json(row)["last_checkpoint"] is None
    own = Saved("/ckpt/carol/train/step-40", 40, t(30))
    store.jobs.agent_sync(t(31), NODES, [], [], [ProgressReport(job, 0, checkpoints_saved=[own])])
    with store.read() as session:
        row = session.get(JobProgress, job)
        assert row is not None and row.last_checkpoint_uri == "/ckpt/carol/train/step-40"
