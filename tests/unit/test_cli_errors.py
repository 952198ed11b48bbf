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


# ------------------------------------------------------------------- simulate
FLEET = """clusters:
  - name: east
    zones:
      - name: a
        pools:
          - {name: p, count: 1, gpus_per_node: 8, gpu_type: A100}
"""
HEADER = b"job_id,submit_s,duration_s,num_gpus,group\n"
# Each run starts Python and reads a two-line trace: well under a second when nothing is
# wrong. A run still going at the deadline is one whose virtual clock never ends.
DEADLINE_S = 60


def simulate(tmp_path: Path, trace: bytes, *options: str) -> tuple[int, str, str]:
    """``gpufleet simulate t.csv`` in ``tmp_path``: its exit code, output and error."""
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "t.csv").write_bytes(trace)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    command = [str(GPUFLEET), "simulate", "t.csv", "--fleet", "fleet.yaml", "--out", "-"]
    try:
        done = subprocess.run(
            [*command, *options],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpufleet simulate {' '.join(options)} still ran after {DEADLINE_S} s")
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, " ".join(done.stderr.split())


@pytest.mark.parametrize("duration", ["nan", "inf", "1e400", "0", "-5"])
def test_a_duration_that_is_no_time_to_run_exits_2_naming_the_line(
    tmp_path: Path, duration: str
) -> None:
    code, _, err = simulate(tmp_path, HEADER + f"a,0,{duration},1,g\n".encode())
    assert code == 2
    assert err == (
        "gpufleet simulate: t.csv:2: duration_s must be a number of seconds more than 0 up "
        f"to 1e10 (about 317 years), not '{duration}'"
    )


def test_a_trace_that_is_not_utf8_exits_2_naming_the_line(tmp_path: Path) -> None:
    trace = HEADER + b"a,0,5,1,g\nb,0,5,1,r\xe9seau\n"  # Latin-1, as an old export writes
    code, _, err = simulate(tmp_path, trace)
    assert code == 2
    assert err == (
        "gpufleet simulate: t.csv:3: not UTF-8 text (byte 0xe9); save the trace as CSV in UTF-8"
    )


def test_a_trace_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # What a spreadsheet's "CSV UTF-8" export writes before the header.
    code, out, err = simulate(tmp_path, b"\xef\xbb\xbf" + HEADER + b"a,0,5,1,g\n")
    assert code == 0, err
    assert [job["job_id"] for job in json.loads(out)["jobs"]] == ["a"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--min-run-time", "nan"],
            "argument --min-run-time: must be a number of seconds from 0 up to 1e10, not 'nan'",
        ),
        (
            ["--job-grace", "1e400"],
            "argument --job-grace: must be a number of seconds from 0 up to 1e10, not '1e400'",
        ),
        (
            ["--checkpoint-interval", "inf"],
            "argument --checkpoint-interval: must be a number of seconds more than 0 up to "
            "1e10, not 'inf'",
        ),
        (
            ["--fault-repair=-inf"],
            "argument --fault-repair: must be a number of seconds from 0 up to 1e10, not '-inf'",
        ),
        (
            ["--fault-rate", "inf"],
            "gpufleet simulate: --fault-rate must be a number of faults per GPU-hour (0 or "
            "more) or 'llama3', not 'inf'",
        ),
        (
            ["--checkpoint-interval", "1e-9"],
            "gpufleet simulate: the trace's jobs run long enough for 5,000,000,000 checkpoints "
            "at one every 1e-09 s, and the replay steps through each: at most 10,000,000; "
            "checkpoint less often (checkpoint_interval_s, --checkpoint-interval) or shorten "
            "the jobs",
        ),
    ],
    ids=["nan", "1e400", "inf-interval", "minus-inf", "inf-rate", "tiny-interval"],
)
def test_an_option_that_would_run_the_clock_forever_exits_2_naming_it(
    tmp_path: Path, options: list[str], message: str
) -> None:
    code, _, err = simulate(tmp_path, HEADER + b"a,0,5,1,g\n", *options)
    assert code == 2
    assert err.endswith(message)


def test_the_options_and_the_trace_share_one_bound_on_seconds() -> None:
    from gpufleet import cli
    from gpufleet.scheduler import inputs

    assert cli.MAX_SECONDS == inputs.MAX_SECONDS


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--days", value, f"must be a number of days more than 0 up to 3650, not '{value}'")
        for value in ("nan", "inf", "1e400", "0", "-1", "3651")
    ]
    + [
        ("--restart", value, f"must be a number of seconds from 0 up to 86400, not '{value}'")
        for value in ("nan", "1e400", "-1")
    ],
)
def test_simulate_faults_refuses_a_time_it_could_never_finish_with_exit_2(
    option: str, value: str, message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET", "JUPYTERHUB"))}
    try:
        done = subprocess.run(
            [str(GPUFLEET), "simulate-faults", "--gpus", "1024", option, value],
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpufleet simulate-faults {option} {value} still ran after {DEADLINE_S} s")
    assert done.returncode == 2
    assert f"argument {option}: {message}" in done.stderr, done.stderr
