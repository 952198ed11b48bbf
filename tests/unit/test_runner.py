"""The rank runner with real processes: GPUs, logs, exit codes, and stopping all of a rank."""

from __future__ import annotations

import signal
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
    assert set(processes.marked_pids(marker)) == {status.pid, child}  # two sessions

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
