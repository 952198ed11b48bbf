"""The rank runner with real processes: GPUs, logs, exit codes, and stopping all of a rank."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.agent.runner import RankExists, RankRunner, RankSpec, UnknownRank
from gpufleet.recovery import processes

GPUS = ("GPU-aaaa", "GPU-bbbb")


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def wait_state(runner: RankRunner, rank_id: str, state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while runner.status(rank_id).state != state:
        assert time.monotonic() < deadline, f"{rank_id} never became {state}"
        time.sleep(0.02)


def wait_for_file(path: Path, text: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.02)


def test_a_rank_gets_its_gpus_and_its_own_logs_and_exit_code(tmp_path: Path) -> None:
    runner = RankRunner(tmp_path / "logs")
    runner.start(
        RankSpec(
            "job7-0",
            python(
                "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES'], "
                "os.environ['NVIDIA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'], "
                "os.environ['RANK']); print('oops', file=sys.stderr); sys.exit(3)"
            ),
            GPUS,
            env={"RANK": "0"},
        )
    )
    wait_state(runner, "job7-0", "exited")
    status = runner.status("job7-0")
    assert (status.exit_code, status.signal) == (3, None)
    assert status.stdout.read_text().split() == [
        "GPU-aaaa,GPU-bbbb",
        "GPU-aaaa,GPU-bbbb",
        "PCI_BUS_ID",
        "0",
    ]
    assert status.stderr.read_text() == "oops\n"
    assert status.ended_at is not None and status.ended_at >= status.started_at


async def test_stop_sends_the_checkpoint_signal_first(tmp_path: Path) -> None:
    runner = RankRunner(tmp_path / "logs")
    status = runner.start(
        RankSpec(
            "job8-0",
            python(
                "import signal, sys, time\n"
                "def save(*_):\n"
                "    print('checkpoint saved', flush=True); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, save)\n"
                "print('training', flush=True)\n"
                "time.sleep(600)\n"
            ),
            GPUS[:1],
        )
    )
    wait_for_file(status.stdout, "training")
    stopped = await runner.stop("job8-0", grace=10)
    assert stopped.state == "stopped" and stopped.exit_code == 0
    assert "checkpoint saved" in stopped.stdout.read_text()


async def test_stop_kills_what_ignores_it_and_what_left_the_process_group(
    tmp_path: Path,
) -> None:
    runner = RankRunner(tmp_path / "logs")
    status = runner.start(
        RankSpec(
            "job9-0",
            python(
                "import signal, subprocess, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "ignore = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(600)'\n"
                "child = subprocess.Popen([sys.executable, '-c', ignore], start_new_session=True)\n"
                "print(child.pid, flush=True)\n"
                "time.sleep(600)\n"
            ),
            GPUS,
        )
    )
    wait_for_file(status.stdout, "\n")
    child = int(status.stdout.read_text())
    marker = runner._ranks["job9-0"].marker
    marked = processes.marked_pids(marker)  # the rank's shell, the rank, its child
    assert len(marked) == 3 and {status.pid, child} <= set(marked)
    assert len({os.getsid(pid) for pid in marked}) == 2  # the child in a session of its own

    stopped = await runner.stop("job9-0", grace=0.5)
    assert stopped.state == "stopped" and stopped.signal == signal.SIGKILL
    assert processes.marked_pids(marker) == []  # the child in its own session too


def test_a_rank_runs_until_nothing_of_it_is_left(tmp_path: Path) -> None:
    runner = RankRunner(tmp_path / "logs")
    status = runner.start(
        RankSpec(
            "job10-0",
            python(
                "import subprocess, sys\n"
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'], "
                "start_new_session=True)\n"
                "print('main done', flush=True)\n"
            ),
        )
    )
    wait_for_file(status.stdout, "main done")
    assert runner.status("job10-0").state == "running"  # its child still holds the GPUs
    wait_state(runner, "job10-0", "exited")
    assert runner.status("job10-0").exit_code == 0


async def test_one_rank_id_runs_once_at_a_time(tmp_path: Path) -> None:
    runner = RankRunner(tmp_path / "logs")
    spec = RankSpec("job11-0", python("import time; time.sleep(600)"))
    runner.start(spec)
    with pytest.raises(RankExists):
        runner.start(spec)
    await runner.stop("job11-0", grace=1)
    assert runner.start(spec).state == "running"  # a restart after a stop is fine
    await runner.stop("job11-0", grace=1)
    with pytest.raises(UnknownRank):
        runner.status("job12-0")


def start_in_another_agent(log_dir: Path, rank_id: str, code: str) -> int:
    """Start rank ``rank_id`` running ``code`` from a runner in a process of its own, which
    then dies by SIGKILL as a crashed agent does; the rank's shell pid."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from gpufleet.agent.runner import RankRunner, RankSpec\n"
        f"status = RankRunner(Path({str(log_dir)!r})).start(RankSpec({rank_id!r}, "
        f"(sys.executable, '-c', {code!r})))\n"
        "print(status.pid, flush=True)\n"
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    agent = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    return int(agent.stdout)


def test_a_rank_outlives_its_agent_and_the_next_one_learns_how_it_ended(tmp_path: Path) -> None:
    go = tmp_path / "go"
    launcher = start_in_another_agent(
        tmp_path / "logs",
        "job20-0",
        "import pathlib, sys, time\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
        "print('done', flush=True); sys.exit(5)\n",
    )
    runner = RankRunner(tmp_path / "logs")
    adopted = runner.adopt("job20-0")
    assert (adopted.state, adopted.pid) == ("running", launcher)  # still alive, now watched
    go.touch()
    wait_state(runner, "job20-0", "exited")
    status = runner.status("job20-0")
    assert (status.exit_code, status.recorded) == (5, True)
    assert status.stdout.read_text() == "done\n"


def test_a_rank_that_ended_while_no_agent_watched_is_reported_as_it_ended(
    tmp_path: Path,
) -> None:
    launcher = start_in_another_agent(tmp_path / "logs", "job21-0", "import sys; sys.exit(0)")
    deadline = time.monotonic() + 20
    while processes.running(launcher, processes.start_ticks(launcher) or 0):
        assert time.monotonic() < deadline, "the rank's shell never ended"
        time.sleep(0.02)  # polled: it records how the rank ended, then exits
    status = RankRunner(tmp_path / "logs").adopt("job21-0")
    assert (status.pid, status.state, status.exit_code, status.recorded) == (
        launcher,
        "exited",
        0,
        True,
    )
    with pytest.raises(UnknownRank):
        RankRunner(tmp_path / "logs").adopt("job22-0")  # never started here


def test_a_rank_whose_shell_was_killed_ends_without_a_recorded_status(tmp_path: Path) -> None:
    launcher = start_in_another_agent(tmp_path / "logs", "job23-0", "import time; time.sleep(600)")
    runner = RankRunner(tmp_path / "logs")
    assert runner.adopt("job23-0").state == "running"
    marker = runner._ranks["job23-0"].marker
    for pid in processes.marked_pids(marker):  # the shell and the rank: nothing records
        os.kill(pid, signal.SIGKILL)
    wait_state(runner, "job23-0", "exited")
    status = runner.status("job23-0")
    assert (status.pid, status.exit_code, status.signal, status.recorded) == (
        launcher,
        None,
        None,
        False,
    )


async def test_a_stop_an_earlier_agent_began_is_carried_on_without_a_second_sigterm(
    tmp_path: Path,
) -> None:
    code = (
        "import signal, sys, time\n"
        "def note(*_):\n"
        "    print('SIGTERM', flush=True)\n"
        "signal.signal(signal.SIGTERM, note)\n"
        "print('training', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    start_in_another_agent(tmp_path / "logs", "job24-0", code)
    first = RankRunner(tmp_path / "logs")
    status = first.adopt("job24-0")
    wait_for_file(status.stdout, "training")
    stopping = asyncio.ensure_future(first.stop("job24-0", grace=60))
    deadline = time.monotonic() + 20
    while "SIGTERM" not in status.stdout.read_text():
        assert time.monotonic() < deadline, "the rank never got its SIGTERM"
        await asyncio.sleep(0.02)
    stopping.cancel()  # this agent dies while the rank saves its checkpoint
    with contextlib.suppress(asyncio.CancelledError):
        await stopping

    signalled = time.monotonic()

    second = RankRunner(tmp_path / "logs")
    assert second.adopt("job24-0").stopping_since is not None
    # Its grace counts from the first SIGTERM, not from this stop: let it pass.
    await asyncio.sleep(max(0.0, signalled + 3.5 - time.monotonic()))
    begun = time.monotonic()
    stopped = await second.stop("job24-0", grace=3)
    assert stopped.state == "stopped"
    assert time.monotonic() - begun < 2.5  # no new grace of 3 s
    assert stopped.stdout.read_text().count("SIGTERM") == 1


def test_a_record_from_before_the_machine_restarted_names_no_running_rank(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    me = os.getpid()  # a live process whose pid and start a record from another boot names
    record = {
        "pid": me,
        "started": processes.start_ticks(me),
        "boot": "another-boot",
        "marker": processes.new_marker(),
        "at": 0.0,
    }
    (logs / "job25-0.launcher").write_text(json.dumps(record))
    status = RankRunner(logs).adopt("job25-0")
    assert (status.state, status.recorded) == ("exited", False)
