"""The job pods' launcher (``clusters/pod_launcher.py``): it waits for the master's port,
not its name, with a deadline and words that say what it waited for; a gang's pod runs
torchrun attempt after attempt, as its assignment file says, and ends when no newer
attempt keeps it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.clusters.pod_launcher import (
    MARKER_VARIABLE,
    Forked,
    PreloadedTorchrun,
    RendezvousTimeout,
    Supervisor,
    _kill_marked,
    torchrun_argv,
    wait_for_port,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_it_returns_once_the_port_accepts() -> None:
    clock = Clock()
    answers = iter([False] * 60 + [True])
    said: list[str] = []
    took = wait_for_port(
        "p0.job", 29500, 600, said.append, lambda h, p: next(answers), clock, clock.pause
    )
    assert took == pytest.approx(12.0)
    assert said == ["waiting for the master pod p0.job:29500 (10 s)"]


def test_it_gives_up_at_its_deadline_naming_what_it_waited_for() -> None:
    clock = Clock()
    with pytest.raises(
        RendezvousTimeout,
        match=r"waited 30 s for the master pod p0.job to accept connections on port 29500",
    ):
        wait_for_port("p0.job", 29500, 30, lambda m: None, lambda h, p: False, clock, clock.pause)


def test_a_real_listener_that_appears_late_is_found() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ready = threading.Event()

    def listen_after_the_first_probe() -> None:
        ready.wait(10)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    said: list[str] = []

    def accepts(host: str, p: int) -> bool:
        from gpufleet.clusters.pod_launcher import _accepts

        ok = _accepts(host, p)
        ready.set()  # the first probe was refused: now the master starts listening
        return ok

    thread = threading.Thread(target=listen_after_the_first_probe)
    thread.start()
    try:
        assert wait_for_port("127.0.0.1", port, 30, said.append, accepts) < 30
    finally:
        thread.join()
        listener.close()


def test_torchrun_gets_the_pods_place_in_the_gang() -> None:
    env = {
        "GPUFLEET_PODS": "4",
        "GPUFLEET_POD_INDEX": "3",
        "GPUFLEET_GPUS_PER_POD": "2",
        "GPUFLEET_MASTER_ADDR": "p0.gf-job-1-a1.ns.svc.cluster.local",
        "GPUFLEET_MASTER_PORT": "29500",
        "GPUFLEET_SCRIPT": "/var/run/gpufleet/job/train.py",
    }
    assert torchrun_argv("/usr/bin/python3", env, ["--lr", "0.1"]) == [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=4",
        "--node-rank=3",
        "--nproc-per-node=2",
        "--master-addr=p0.gf-job-1-a1.ns.svc.cluster.local",
        "--master-port=29500",
        "--tee=3",
        "/var/run/gpufleet/job/train.py",
        "--lr",
        "0.1",
    ]


def test_a_job_of_one_pod_rendezvouses_with_itself() -> None:
    env = {
        "GPUFLEET_PODS": "1",
        "GPUFLEET_POD_INDEX": "0",
        "GPUFLEET_GPUS_PER_POD": "4",
        "GPUFLEET_MASTER_ADDR": "localhost",
        "GPUFLEET_MASTER_PORT": "29500",
        "GPUFLEET_SCRIPT": "/var/run/gpufleet/job/train.py",
    }
    assert torchrun_argv("/usr/bin/python3", env, []) == [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--standalone",
        "--nproc-per-node=4",
        "--tee=3",
        "/var/run/gpufleet/job/train.py",
    ]


# ------------------------------------------------------------------ a gang pod's attempts
GANG_ENV = {
    "GPUFLEET_PODS": "3",
    "GPUFLEET_POD_INDEX": "1",
    "GPUFLEET_GPUS_PER_POD": "2",
    "GPUFLEET_MASTER_ADDR": "p0.gf-job-7-a1.ns.svc.cluster.local",
    "GPUFLEET_MASTER_PORT": "29500",
    "GPUFLEET_SCRIPT": "/var/run/gpufleet/job/train.py",
    "GPUFLEET_ATTEMPT": "1",
    "GPUFLEET_KEEP_WAIT_S": "10",
    MARKER_VARIABLE: "m1.1",
}


class FakeTorchrun:
    """A torchrun that runs for ``runs_s`` of the fake clock, then exits with ``status``;
    a signal ends it at once with -signal."""

    def __init__(self, clock: Clock, runs_s: float, status: int) -> None:
        self.clock = clock
        self.ends_at = clock.now + runs_s
        self.status = status
        self.signals: list[int] = []

    def poll(self) -> int | None:
        if self.signals:
            return -self.signals[0]
        return self.status if self.clock.now >= self.ends_at else None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def wait(self) -> int:
        return self.poll() or 0


class Pod:
    """A supervisor over fake torchruns, each started from ``plans`` in turn; ``during``
    maps a time of the fake clock to what happens then (a new assignment written)."""

    def __init__(self, tmp_path: Path, plans: list[tuple[float, int]]) -> None:
        self.clock = Clock()
        self.path = tmp_path / "assignment"
        self.plans = iter(plans)
        self.started: list[tuple[list[str], dict[str, str]]] = []
        self.children: list[FakeTorchrun] = []
        self.events: dict[float, Any] = {}
        self.said: list[str] = []
        self.killed: list[str] = []  # the markers whose processes were killed

    def start(self, argv: list[str], env: dict[str, str]) -> FakeTorchrun:
        self.started.append((argv, env))
        runs_s, status = next(self.plans)
        child = FakeTorchrun(self.clock, runs_s, status)
        self.children.append(child)
        return child

    def pause(self, seconds: float) -> None:
        self.clock.pause(seconds)
        for at in [t for t in self.events if t <= self.clock.now]:
            self.events.pop(at)()

    def assign(self, attempt: int, port: int, addr: str = "127.0.0.9") -> None:
        self.path.write_text(
            json.dumps(
                {
                    "attempt": attempt,
                    "marker": f"m{attempt}.1",
                    "master_addr": addr,
                    "master_port": port,
                    "resume_from": f"s3://ckpt/step-{attempt}",
                }
            )
        )

    def supervisor(self) -> Supervisor:
        return Supervisor(
            GANG_ENV,
            ["--lr", "0.1"],
            self.path,
            start=self.start,  # type: ignore[arg-type]
            accepts=lambda host, port: True,
            clock=self.clock,
            pause=self.pause,
            say=self.said.append,
            kill_marked=self.killed.append,
        )


def _flag(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}="))


def test_a_gang_pod_whose_torchrun_succeeds_ends_with_it(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(5.0, 0)])
    assert pod.supervisor().run() == 0
    [(argv, env)] = pod.started
    assert _flag(argv, "master-addr") == "p0.gf-job-7-a1.ns.svc.cluster.local"
    assert env["GPUFLEET_ATTEMPT"] == "1" and env[MARKER_VARIABLE] == "m1.1"


def test_a_failed_torchrun_is_followed_by_the_attempt_that_keeps_the_pod(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(5.0, 1), (3.0, 0)])
    pod.events[7.0] = lambda: pod.assign(2, 29501)  # two seconds after the failure
    assert pod.supervisor().run() == 0
    (_, first), (argv, env) = pod.started
    assert first["GPUFLEET_ATTEMPT"] == "1"
    assert _flag(argv, "master-addr") == "127.0.0.9"
    assert _flag(argv, "master-port") == "29501"
    assert _flag(argv, "node-rank") == "1"
    assert env["GPUFLEET_ATTEMPT"] == "2"
    assert env[MARKER_VARIABLE] == "m2.1"
    assert env["GPUFLEET_RESUME_FROM"] == "s3://ckpt/step-2"
    assert any("kept for attempt 2" in line for line in pod.said)


def test_a_failed_torchrun_ends_the_pod_when_no_attempt_keeps_it(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(5.0, 1)])
    pod.events[16.0] = lambda: pod.assign(2, 29501)  # after the keep wait: too late
    assert pod.supervisor().run() == 1
    assert len(pod.started) == 1
    assert 15.0 <= pod.clock.now <= 15.5


def test_a_newer_attempt_stops_the_running_torchrun_first(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(100.0, 0), (2.0, 0)])
    pod.events[4.0] = lambda: pod.assign(2, 29501)
    assert pod.supervisor().run() == 0
    assert pod.children[0].signals == [signal.SIGTERM]
    assert pod.killed == ["m1.1"]  # the ranks of attempt 1, whatever their session
    assert pod.started[1][1]["GPUFLEET_ATTEMPT"] == "2"


def test_an_older_or_half_written_assignment_changes_nothing(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(5.0, 1)])
    pod.events[1.0] = lambda: pod.path.write_text('{"attempt": 3, "marker"')
    pod.events[6.0] = lambda: pod.assign(1, 29501)  # the attempt it already runs
    assert pod.supervisor().run() == 1
    assert len(pod.started) == 1


def test_the_pods_own_stop_reaches_torchrun_and_nothing_follows(tmp_path: Path) -> None:
    pod = Pod(tmp_path, [(100.0, 0)])
    supervisor = pod.supervisor()
    pod.events[3.0] = lambda: supervisor.stop(signal.SIGTERM)
    pod.events[5.0] = lambda: pod.assign(2, 29501)
    assert supervisor.run() == 128 + signal.SIGTERM
    assert pod.children[0].signals == [signal.SIGTERM]
    assert len(pod.started) == 1


# ------------------------------------------------------------------ torchrun, preloaded
def test_a_preloaded_torchrun_runs_in_a_fork_with_the_attempts_arguments_and_variables(
    tmp_path: Path,
) -> None:
    said = tmp_path / "said"

    def torchrun(args: list[str]) -> None:
        said.write_text(json.dumps({"args": args, "attempt": os.environ["GPUFLEET_ATTEMPT"]}))
        raise SystemExit(3)

    start = PreloadedTorchrun(load=lambda: torchrun)
    argv = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "train.py"]
    child = start(argv, {"GPUFLEET_ATTEMPT": "2"})
    assert isinstance(child, Forked)
    assert child.wait() == 3
    assert json.loads(said.read_text()) == {"args": ["--nnodes=2", "train.py"], "attempt": "2"}
    assert "GPUFLEET_ATTEMPT" not in os.environ or os.environ["GPUFLEET_ATTEMPT"] != "2"


def test_a_preloaded_torchrun_dies_of_sigterm_not_of_the_launchers_handler() -> None:
    def torchrun(args: list[str]) -> None:
        time.sleep(60)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as the launcher's
    try:
        child = PreloadedTorchrun(load=lambda: torchrun)(["p", "-m", "t"], {})
        child.send_signal(signal.SIGTERM)
        assert child.wait() == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_torch_torchrun_is_started_as_a_command_that_says_why(tmp_path: Path) -> None:
    child = PreloadedTorchrun(load=lambda: None)(
        [sys.executable, "-c", "import sys; sys.exit(5)"], {}
    )
    assert not isinstance(child, Forked)
    assert child.wait() == 5


def test_a_superseded_attempts_ranks_are_found_by_their_marker_and_killed() -> None:
    """torchrun starts each rank in a session of its own: killing its group is not enough."""
    rank = subprocess.Popen(
        ["sleep", "60"],
        env={MARKER_VARIABLE: "m1.0", "PATH": os.environ["PATH"]},
        start_new_session=True,
    )
    other = subprocess.Popen(
        ["sleep", "60"], env={MARKER_VARIABLE: "m2.0", "PATH": os.environ["PATH"]}
    )
    try:
        _kill_marked("m1.0")
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None  # another attempt's, or nobody's: left alone
    finally:
        other.kill()
        other.wait()
