"""The session side of the idle culler: gpufleet.culler.session_extension in a real JupyterLab.

Each server runs from the virtualenv on loopback, with HOME and the Jupyter directories in a
temporary folder, and reports to a fake controller that this module runs in a thread: it
records every request and answers with the notices a test sets. The browser test loads the
committed prebuilt bundle of @gpufleet/session-notices (share/jupyter/labextensions).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import websocket
from playwright.sync_api import Browser, expect

from ..ports import free_port
from . import browser as ui
from .harness import REPO, wait_for

pytestmark = pytest.mark.integration

API_PREFIX = "/services/gpufleet/api/v1"
WORKLOAD = "42"
HUB_TOKEN = "server-token-" + uuid.uuid4().hex
BUNDLE = REPO / "share/jupyter/labextensions/@gpufleet/session-notices"
IDLE_WARNING = "This session has been idle for 45 min and will be stopped at 14:02"
START_TIMEOUT = 120.0  # JupyterLab takes several seconds on a busy two-core machine
REPORT_WARNING = "could not report activity to the controller"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float = field(default_factory=time.monotonic)


class FakeController:
    """The controller's session endpoints on loopback: records requests, answers notices."""

    def __init__(self) -> None:
        self.requests: list[Seen] = []
        self.notices: list[dict[str, Any]] = []
        self.keep_alive_answer: tuple[int, dict[str, Any]] | None = None
        self.notice_poll_s: float | None = None
        self.lock = threading.Lock()
        self.port = 0
        self.server: ThreadingHTTPServer | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{API_PREFIX}"

    def start(self) -> None:
        controller = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.answer(*controller.handle("POST", self))

            def do_PUT(self) -> None:
                self.answer(*controller.handle("PUT", self))

            def do_GET(self) -> None:
                self.answer(*controller.handle("GET", self))

            def answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Close the port: connections are refused until start() opens it again."""
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    def handle(self, method: str, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, Any]]:
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length) or b"null")
        with self.lock:
            self.requests.append(Seen(method, request.path, dict(request.headers), body))
            session = f"{API_PREFIX}/sessions/{WORKLOAD}"
            if method in ("POST", "GET") and request.path == f"{session}/activity":
                answer = {"notices": self.notices, "keep_alive_until": None}
                if self.notice_poll_s is not None:
                    answer["notice_poll_s"] = self.notice_poll_s
                return 200, {**answer, "keep_alive_max_s": 4 * 3600.0}
            if method == "PUT" and request.path == f"{session}/keep-alive":
                return self.keep_alive_answer or (200, {"keep_alive_until": body["until"]})
        return 404, {"error": "not_found", "message": request.path}

    def seen(self, method: str, suffix: str) -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.method == method and r.path.endswith(suffix)]

    def reports(self) -> list[Seen]:
        return self.seen("POST", "/activity")

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()


@dataclass
class Session:
    """A Jupyter server process with the extension on, as the spawner would start it."""

    url: str
    token: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, root: Path, controller_url: str, interval: float, app: str) -> Session:
        for folder in ("home", "notebooks", "config", "data", "runtime"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        port, token = free_port(), uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "GPUFLEET"))}
        env.update(
            HOME=str(root / "home"),
            JUPYTER_CONFIG_DIR=str(root / "config"),
            JUPYTER_DATA_DIR=str(root / "data"),
            JUPYTER_RUNTIME_DIR=str(root / "runtime"),
            IPYTHONDIR=str(root / "home" / ".ipython"),
            GPUFLEET_CONTROLLER_API_URL=controller_url,
            GPUFLEET_WORKLOAD_ID=WORKLOAD,
            GPUFLEET_ACTIVITY_INTERVAL=str(interval),
            JUPYTERHUB_API_TOKEN=HUB_TOKEN,
        )
        log_path = root / "server.log"
        options = [
            *f"--no-browser --allow-root --ip=127.0.0.1 --port={port}".split(),
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root / 'notebooks'}",
            "--ServerApp.jpserver_extensions=gpufleet.culler.session_extension=True",
            f"--LabServerApp.extra_labextensions_path={BUNDLE.parent.parent}",
        ]
        proc = subprocess.Popen(
            [sys.executable, "-m", app, *options],
            cwd=root,
            env=env,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        session = cls(f"http://127.0.0.1:{port}", token, log_path, proc)
        wait_for(session.ready, START_TIMEOUT, f"{app} on port {port} ({log_path})", 0.5)
        return session

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"server exited: {self.log_text()[-3000:]}"
        try:
            return self.api("GET", "/api/status").status_code == 200
        except httpx.TransportError:
            return False

    def api(self, method: str, path: str, body: Any = None, token: bool = True) -> httpx.Response:
        headers = {"Authorization": f"token {self.token}"} if token else {}
        return httpx.request(method, self.url + path, json=body, headers=headers, timeout=30)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def controller() -> Iterator[FakeController]:
    instance = FakeController()
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def lab(controller: FakeController, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """JupyterLab reporting every half second."""
    session = Session.start(tmp_path_factory.mktemp("lab"), controller.api_url, 0.5, "jupyterlab")
    yield session
    session.stop()


def kernel_states(report: Seen, kernel_id: str) -> list[str]:
    return [k["execution_state"] for k in report.body["kernels"] if k["id"] == kernel_id]


def parse_time(text: str) -> datetime:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text)


def test_reports_activity_periodically_with_the_server_token(
    lab: Session, controller: FakeController
) -> None:
    controller.clear()
    reports = wait_for(lambda: r if len(r := controller.reports()) >= 5 else None, 30, "reports")
    gaps = [b.at - a.at for a, b in itertools.pairwise(reports)]
    assert statistics.median(gaps) > 0.4, gaps  # every half second, not a flood
    for report in reports:
        assert report.path == f"{API_PREFIX}/sessions/{WORKLOAD}/activity"
        assert report.headers["Authorization"] == f"token {HUB_TOKEN}"
        assert set(report.body) == {
            "kernels",
            "terminals",
            "user_activity",
            "user_action",
            "sent_at",
        }
        parse_time(report.body["sent_at"])

    terminal = lab.api("POST", "/api/terminals").json()["name"]
    kernel = lab.api("POST", "/api/kernels", {"name": "python3"}).json()["id"]
    try:
        with_both = wait_for(
            lambda: [r for r in controller.reports() if r.body["terminals"] and r.body["kernels"]],
            30,
            "a report with the kernel and the terminal",
        )[-1]
        (seen_kernel,) = with_both.body["kernels"]
        assert seen_kernel["id"] == kernel and seen_kernel["name"] == "python3"
        assert seen_kernel["connections"] == 0
        parse_time(seen_kernel["last_activity"])
        (seen_terminal,) = with_both.body["terminals"]
        assert seen_terminal["name"] == terminal
        parse_time(seen_terminal["last_activity"])
    finally:
        lab.api("DELETE", f"/api/kernels/{kernel}")
        lab.api("DELETE", f"/api/terminals/{terminal}")


def test_keep_alive_passes_the_controllers_answer_through(
    lab: Session, controller: FakeController
) -> None:
    assert lab.api("GET", "/gpufleet/notices", token=False).status_code == 403
    assert lab.api("POST", "/gpufleet/keep-alive", {"hours": 1}, token=False).status_code == 403
    bad = lab.api("POST", "/gpufleet/keep-alive", {"hours": -1})
    assert bad.status_code == 400 and "hours" in bad.json()["message"]
    controller.clear()
    until = "2030-01-31T18:00:00Z"
    ok = lab.api("POST", "/gpufleet/keep-alive", {"until": until})
    assert (ok.status_code, ok.json()) == (200, {"keep_alive_until": until})
    (put,) = controller.seen("PUT", "/keep-alive")
    assert put.path == f"{API_PREFIX}/sessions/{WORKLOAD}/keep-alive"
    assert put.body == {"until": until}
    assert put.headers["Authorization"] == f"token {HUB_TOKEN}"

    refusal = {"error": "keep_alive_too_long", "message": "At most 4 h in project vision"}
    controller.keep_alive_answer = (400, refusal)
    try:
        refused = lab.api("POST", "/gpufleet/keep-alive", {"hours": 100})
        assert (refused.status_code, refused.json()) == (400, refusal)
    finally:
        controller.keep_alive_answer = None


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    with ui.chromium() as instance:
        yield instance


@pytest.mark.browser
def test_jupyterlab_shows_the_warning_and_keeps_the_session_alive(
    lab: Session, controller: FakeController, chromium: Browser, tmp_path: Path
) -> None:
    restored = "Restored from the snapshot of 09:14"
    controller.notices = [
        {
            "id": "idle-1",
            "level": "warning",
            "message": IDLE_WARNING,
            "deadline": "2030-01-31T14:02:00Z",
        },
        {"id": "restored-1", "level": "info", "message": restored, "deadline": None},
    ]
    wait_for(lambda: len(lab.api("GET", "/gpufleet/notices").json()["notices"]) == 2, 30, "notices")
    controller.clear()
    context = ui.new_context(chromium, lab.url)
    try:
        page = context.new_page()
        page.goto(f"/lab?token={lab.token}")
        expect(page.get_by_text(IDLE_WARNING)).to_be_visible(timeout=ui.LAB_TIMEOUT_MS)
        expect(page.get_by_text(restored)).to_be_visible()
        page.screenshot(path=tmp_path / "idle-warning.png")

        controller.notices = []  # the controller withdraws its notices once kept alive
        clicked = datetime.now(UTC)
        page.get_by_role("button", name="Keep alive 1 hour").click()
        (put,) = wait_for(lambda: controller.seen("PUT", "/keep-alive"), 30, "a keep-alive PUT")
        asked = parse_time(put.body["until"]) - clicked
        assert timedelta(minutes=59) < asked < timedelta(minutes=61), asked
        expect(page.get_by_text("This session will be kept running until")).to_be_visible()
        # A poll of the notices finds the other one withdrawn too, and dismisses it.
        expect(page.get_by_text(restored)).to_have_count(0, timeout=ui.LAB_TIMEOUT_MS)
    finally:
        context.close()
        controller.notices = []


def test_an_unreachable_controller_leaves_the_server_working(
    lab: Session, controller: FakeController
) -> None:
    controller.notices = [{"id": "info-1", "level": "info", "message": "hello", "deadline": None}]
    wait_for(lambda: lab.api("GET", "/gpufleet/notices").json()["notices"], 30, "notices")
    log_start = len(lab.log_text())
    controller.stop()
    down_since = time.monotonic()
    try:
        wait_for(lambda: REPORT_WARNING in lab.log_text()[log_start:], 30, "a warning")
        assert lab.api("GET", "/api/status").status_code == 200
        kernel = lab.api("POST", "/api/kernels", {"name": "python3"})
        assert kernel.status_code == 201, kernel.text
        assert lab.api("DELETE", f"/api/kernels/{kernel.json()['id']}").status_code == 204
        # The last word of the controller is still served.
        assert lab.api("GET", "/gpufleet/notices").json()["notices"][0]["id"] == "info-1"
        refused = lab.api("POST", "/gpufleet/keep-alive", {"hours": 1})
        assert refused.status_code == 502
        assert refused.json()["error"] == "controller_unreachable"
        # Reports fail every half second; the warning is logged once a minute at most.
        wait_for(lambda: time.monotonic() - down_since > 3, 30, "several failed reports")
    finally:
        controller.clear()
        controller.start()  # the same port again
    wait_for(controller.reports, 30, "reports after the controller is back")
    log = lab.log_text()[log_start:]
    assert log.count(REPORT_WARNING) == 1, log
    wait_for(lambda: "reachable again" in lab.log_text()[log_start:], 30, "the recovery line")
    assert lab.proc.poll() is None


def connect(session: Session, kernel_id: str) -> websocket.WebSocket:
    """The kernel's websocket, as JupyterLab opens it (the server then asks for kernel info)."""
    ws_url = session.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
    header = [f"Authorization: token {session.token}"]
    return websocket.create_connection(ws_url, header=header, timeout=30)


def execute(connection: websocket.WebSocket, code: str) -> None:
    header = dict(msg_id=uuid.uuid4().hex, msg_type="execute_request", session="t", version="5.3")
    content = dict(code=code, silent=False, store_history=False, allow_stdin=False)
    message = dict(header=header, parent_header={}, metadata={}, content=content, channel="shell")
    connection.send(json.dumps(message))


def test_a_kernel_turning_busy_or_idle_is_reported_at_once(tmp_path: Path) -> None:
    controller = FakeController()
    controller.start()
    # An hour between regular reports: what arrives in the test is caused by the kernel.
    session = Session.start(tmp_path, controller.api_url, 3600, "jupyter_server")
    try:
        wait_for(controller.reports, 60, "the report at start-up")
        kernel = session.api("POST", "/api/kernels", {"name": "python3"}).json()["id"]

        def reports_of(state: str, after: float = 0) -> list[Seen]:
            return [
                r
                for r in controller.reports()
                if r.at > after and kernel_states(r, kernel) == [state]
            ]

        # A new kernel is reported at once: "starting" until a client connects, or already
        # "idle" when it got there before the extension looked.
        wait_for(
            lambda: [r for r in controller.reports() if kernel_states(r, kernel)],
            60,
            "a report of the new kernel",
        )
        connection = connect(session, kernel)
        try:
            wait_for(lambda: reports_of("idle"), 60, "a report of the kernel, idle")
            sent = time.monotonic()
            execute(connection, "import time; time.sleep(3)")
            busy = wait_for(lambda: reports_of("busy"), 20, "a report of the kernel, busy")[0]
            # About a second (0.9 s here); the margin is for a busy two-core machine.
            assert busy.at - sent < 3, f"busy reported after {busy.at - sent:.2f} s"
            wait_for(lambda: reports_of("idle", busy.at), 30, "a report of it idle again")
            (seen,) = [k for k in busy.body["kernels"] if k["id"] == kernel]
            assert seen["connections"] == 1
        finally:
            connection.close()
        assert len(controller.reports()) < 10  # prompt reports, not a stream
    finally:
        session.stop()
        controller.stop()


def test_what_its_user_does_is_reported_and_the_pages_polling_is_not(tmp_path: Path) -> None:
    controller = FakeController()
    controller.start()
    session = Session.start(tmp_path, controller.api_url, 0.5, "jupyter_server")
    try:
        wait_for(controller.reports, 60, "the report at start-up")
        # What an open JupyterLab asks again and again: nothing a person did.
        for path in ("/api/contents", "/api/kernels", "/api/sessions", "/api/terminals"):
            assert session.api("GET", path).status_code == 200
        assert session.api("GET", "/gpufleet/notices").status_code == 200
        controller.clear()
        quiet = wait_for(lambda: r if len(r := controller.reports()) >= 2 else None, 30, "reports")
        assert [(r.body["user_activity"], r.body["user_action"]) for r in quiet] == [
            (None, "")
        ] * len(quiet)

        before = datetime.now(UTC)
        file = {"type": "file", "format": "text", "content": "results of run 7"}
        assert session.api("PUT", "/api/contents/notes.txt", file).status_code == 201
        saved = wait_for(
            lambda: [r for r in controller.reports() if r.body["user_action"] == "file"],
            30,
            "a report of the file saved",
        )[0]
        assert parse_time(saved.body["user_activity"]) >= before
        # Reading it back, or listing its folder, changes nothing.
        assert session.api("GET", "/api/contents/notes.txt").status_code == 200
        controller.clear()
        wait_for(lambda: len(controller.reports()) >= 2, 30, "two more reports")
        assert {r.body["user_activity"] for r in controller.reports()} == {
            saved.body["user_activity"]
        }

        # JupyterLab says when its user last typed, clicked or scrolled.
        assert (
            session.api("POST", "/gpufleet/input", {"seconds_ago": 2}, token=False).status_code
            == 403
        )
        bad = session.api("POST", "/gpufleet/input", {"seconds_ago": "soon"})
        assert bad.status_code == 400
        assert bad.json()["message"] == 'send {"seconds_ago": <seconds since the last input>}'
        sent = datetime.now(UTC)
        assert session.api("POST", "/gpufleet/input", {"seconds_ago": 0.5}).status_code == 204
        typed = wait_for(
            lambda: [r for r in controller.reports() if r.body["user_action"] == "input"],
            30,
            "a report of the input",
        )[0]
        said = parse_time(typed.body["user_activity"]) - (sent - timedelta(seconds=0.5))
        assert abs(said) < timedelta(seconds=2), said
    finally:
        session.stop()
        controller.stop()


def test_while_a_warning_stands_a_users_action_is_reported_at_once(tmp_path: Path) -> None:
    controller = FakeController()
    controller.notices = [
        {
            "id": "idle-8",
            "level": "warning",
            "message": IDLE_WARNING,
            "deadline": "2030-01-31T14:02:00Z",
        }
    ]
    controller.start()
    # An hour between regular reports: what arrives in the test is caused by the save.
    session = Session.start(tmp_path, controller.api_url, 3600, "jupyter_server")
    try:
        wait_for(controller.reports, 60, "the report at start-up, which brings the warning")
        wait_for(lambda: session.api("GET", "/gpufleet/notices").json()["notices"], 10, "it held")
        controller.clear()
        file = {"type": "file", "format": "text", "content": "back at work"}
        saved_at = time.monotonic()
        assert session.api("PUT", "/api/contents/draft.txt", file).status_code == 201
        report = wait_for(
            lambda: [r for r in controller.reports() if r.body["user_action"] == "file"],
            20,
            "a report of the save",
        )[0]
        # About a second (the least gap between two prompt reports); margin for the machine.
        assert report.at - saved_at < 3, f"reported after {report.at - saved_at:.2f} s"
    finally:
        session.stop()
        controller.stop()


def test_a_browser_looking_for_notices_gets_the_controllers_latest_word(tmp_path: Path) -> None:
    controller = FakeController()
    controller.notice_poll_s = 1.5  # a project whose warning stands for 6 s
    controller.start()
    # An hour between reports: only the browser's looks can bring a new notice in time.
    session = Session.start(tmp_path, controller.api_url, 3600, "jupyter_server")
    try:
        wait_for(controller.reports, 60, "the report at start-up")
        first = session.api("GET", "/gpufleet/notices").json()
        assert first["notices"] == [] and first["poll_s"] == 1.5
        warning = {"id": "idle-7", "level": "warning", "message": IDLE_WARNING, "deadline": None}
        controller.notices = [warning]
        # Within one poll period (and without waiting for the next report) the look finds it.
        seen = wait_for(
            lambda: session.api("GET", "/gpufleet/notices").json()["notices"], 5, "the warning"
        )
        assert seen == [warning]
        assert len(controller.reports()) == 1 and controller.seen("GET", "/activity")
        # Looks within the period are answered from what the extension holds.
        controller.clear()
        for _ in range(5):
            session.api("GET", "/gpufleet/notices")
        assert len(controller.seen("GET", "/activity")) <= 1
    finally:
        session.stop()
        controller.stop()


def test_without_a_controller_the_extension_serves_empty_notices(tmp_path: Path) -> None:
    session = Session.start(tmp_path, "", 0.5, "jupyter_server")
    try:
        notices = session.api("GET", "/gpufleet/notices")
        assert notices.json() == {
            "notices": [],
            "keep_alive_until": None,
            "keep_alive_max_s": None,
            "poll_s": 10.0,
        }
        refused = session.api("POST", "/gpufleet/keep-alive", {"hours": 1})
        assert refused.status_code == 503 and refused.json()["error"] == "not_configured"
        assert "not reporting activity" in session.log_text()
    finally:
        session.stop()


def test_the_prebuilt_bundle_is_complete_and_installed_by_pyproject() -> None:
    package = json.loads((BUNDLE / "package.json").read_text())
    assert package["name"] == "@gpufleet/session-notices"
    assert (BUNDLE / package["jupyterlab"]["_build"]["load"]).is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    data_files = pyproject["tool"]["setuptools"]["data-files"]
    listed = {
        path.relative_to(REPO)
        for patterns in data_files.values()
        for pattern in patterns
        for path in REPO.glob(pattern)
    }
    assert {p.relative_to(REPO) for p in BUNDLE.rglob("*") if p.is_file()} == listed
    assert all(Path(target) == Path(p).parent for target, ps in data_files.items() for p in ps)
