"""The ``gpufleet`` command's expected errors: one line on stderr in the command's own words
(its flags, not the SDK's arguments), the documented exit code, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpufleet.cli import main
from gpufleet.client import ApiError
from gpufleet.fleet_cli import refusal

GPUFLEET = Path(sys.executable).parent / "gpufleet"
SUBMIT = ["submit", "--gpus", "1", "--gpu-type", "A100-80GB", "--project", "vision"]


@pytest.fixture(autouse=True)
def _no_ambient_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands read these; a test's outcome must not depend on the caller's shell."""
    for name in list(os.environ):
        if name.startswith(("GPUFLEET", "JUPYTERHUB")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "300")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, " ".join(err.split())


def test_submitting_a_missing_script_names_it_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    where = ["--token", "t", "--hub-url", f"http://127.0.0.1:{closed_port()}"]
    missing = tmp_path / "nope.py"
    code, err = run(capsys, *SUBMIT, *where, str(missing))
    assert code == 2
    assert f"gpufleet submit: cannot read the entry script {missing}: No such file" in err
    binary = tmp_path / "weights.py"
    binary.write_bytes(b"\x80\xff" * 10)
    code, err = run(capsys, *SUBMIT, *where, str(binary))
    assert code == 2 and "is not text" in err
    code, err = run(capsys, *SUBMIT, "--env", "NOEQUALS", *where, str(binary))
    assert code == 2 and "--env 'NOEQUALS': write NAME=VALUE" in err


def test_what_to_set_is_said_with_the_commands_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "nodes")
    assert code == 2
    assert "--hub-url" in err and "$GPUFLEET_HUB_URL" in err and "hub_url" not in err
    code, err = run(capsys, "nodes", "--hub-url", "https://hub.example.org")
    assert code == 2
    assert "--token" in err and "$GPUFLEET_TOKEN" in err and "token=" not in err
    code, err = run(capsys, "queue", "--hub-url", "hub.example.org", "--token", "t")
    assert code == 2 and "--hub-url 'hub.example.org' is not a URL" in err
    code, err = run(capsys, "queue", "--api-url", "http://[", "--token", "t")
    assert code == 2 and "--api-url 'http://[' is not a URL" in err


def test_a_silent_controller_exits_4(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(
        capsys, "nodes", "--hub-url", f"http://127.0.0.1:{closed_port()}", "--token", "t"
    )
    assert code == 4 and "did not answer" in err


def test_the_controllers_field_names_become_the_submit_flags() -> None:
    body_error = ApiError(
        400,
        "bad-request",
        "the request body is not valid: gpus_per_pod: Input should be greater than 0",
        [
            {"field": "gpus_per_pod", "problem": "Input should be greater than 0"},
            {"field": "env.X", "problem": "String should have at most 4096 characters"},
        ],
    )
    said = refusal(body_error, "submit")
    assert "--gpus-per-pod: Input should be greater than 0" in said
    assert "--env (X): String should" in said and "gpus_per_pod" not in said
    assert "--token" in refusal(ApiError(401, "unauthenticated", "no valid token"), "nodes")
    assert refusal(ApiError(404, "not-found", "no node x"), "cordon").endswith("no node x")


class Stub(BaseHTTPRequestHandler):
    """Not the controller: whatever the test puts in ``answers`` (path → (status, body));
    a path answered with ``None`` holds its request until ``release`` is set."""

    answers: dict[str, tuple[int, str, str] | None] = {}
    seen: list[str] = []
    release = threading.Event()

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.seen.append(path)
        answer = self.answers.get(path, (404, "application/json", '{"code": "not-found"}'))
        if answer is None:
            self.release.wait(60)
            return
        status, kind, body = answer
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[str]:
    Stub.answers, Stub.seen = {}, []
    Stub.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    # server_close joins the handler threads (held requests are released first), so none
    # of them outlives its test and writes to the next test's ``seen``.
    server.daemon_threads = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api/v1"
    Stub.release.set()
    server.shutdown()
    server.server_close()


def test_an_answer_that_is_not_json_is_a_refusal_not_a_traceback(
    capsys: pytest.CaptureFixture[str], stub: str
) -> None:
    Stub.answers["/api/v1/nodes"] = (200, "text/html", "<html>a login page</html>")
    code, err = run(capsys, "nodes", "--api-url", stub, "--token", "t")
    assert code == 3 and "is this the gpufleet controller's API?" in err


def cli(*args: str) -> subprocess.Popen[str]:
    """The command as a terminal's foreground process has it: SIGINT at its default. An
    ignored SIGINT survives exec (and Python then never raises KeyboardInterrupt); the test
    runner's process may have it ignored, for reasons of its own. coreutils' ``env``
    resets it and execs the command (no ``preexec_fn``: unsafe beside the stub's threads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    return subprocess.Popen(
        ["env", "--default-signal=INT", str(GPUFLEET), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_reader_that_goes_away_ends_the_output_quietly(stub: str) -> None:
    # A log without end: the command writes until its reader has gone.
    log = {"rank": 0, "stream": "stdout", "offset": 0, "next_offset": 0, "complete": False}
    log |= {"data": "a line of output\n" * 10_000}
    Stub.answers["/api/v1/jobs/7/logs"] = (200, "application/json", json.dumps(log))
    reader = cli("logs", "7", "--api-url", stub, "--token", "t")
    assert reader.stdout is not None
    assert reader.stdout.readline() == "a line of output\n"
    reader.stdout.close()  # as `gpufleet logs 7 | head -1` does
    _, err = reader.communicate(timeout=60)
    assert reader.returncode == 141 and err == ""


def test_ctrl_c_while_following_exits_130_without_a_traceback(stub: str) -> None:
    Stub.answers["/api/v1/jobs/8/logs"] = None  # a long poll that does not end
    follower = cli("logs", "8", "-f", "--api-url", stub, "--token", "t")
    deadline = time.monotonic() + 30
    while "/api/v1/jobs/8/logs" not in Stub.seen:
        assert time.monotonic() < deadline, "the command never asked for the log"
        assert follower.poll() is None, follower.communicate()
        time.sleep(0.05)
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 130
    assert "Traceback" not in err and "interrupted" in err
