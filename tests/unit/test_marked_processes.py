"""Finding every marked process of this machine (the reconciler's view)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from gpufleet.recovery import processes


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_every_live_marked_process_is_found_with_its_marker(tmp_path: Path) -> None:
    one, two = processes.new_marker(), processes.new_marker()
    started = [
        subprocess.Popen(
            ["sleep", "60"],
            env={**os.environ, processes.MARKER_VARIABLE: marker},
            cwd=tmp_path,
            start_new_session=True,
        )
        for marker in (one, two, two)
    ]
    exited = subprocess.Popen(
        ["true"], env={**os.environ, processes.MARKER_VARIABLE: one}, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 10
        while state(exited.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)  # exited, not reaped yet: a zombie holds no GPU and is not listed
        assert state(exited.pid) == "Z"
        found = processes.marked_processes()
        assert {pid: found.get(pid) for pid in (p.pid for p in started)} == {
            started[0].pid: one,
            started[1].pid: two,
            started[2].pid: two,
        }
        assert exited.pid not in found
        assert sorted(processes.marked_pids(two)) == sorted([started[1].pid, started[2].pid])
    finally:
        for proc in (*started, exited):
            proc.kill()
            proc.wait()


def fake_process(proc: Path, pid: int, environ: bytes, state: str, started: int) -> None:
    """``/proc/<pid>`` as the kernel shows a process: its environment and its stat line
    (state in field 3, start time in field 22)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "environ").write_bytes(environ)
    fields = [state, *["0"] * 18, str(started), "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} (python (rank 0)) {' '.join(fields)}\n")


def test_a_process_that_drops_its_marker_while_exiting_still_runs_until_it_is_a_zombie(
    tmp_path: Path,
) -> None:
    marker = processes.new_marker()
    marked = f"{processes.MARKER_VARIABLE}={marker}.0\0HOME=/x\0".encode()
    fake_process(tmp_path, 100, marked, "S", 5000)
    watch = processes.Watch(marker, tmp_path)
    assert watch.alive() == [100]
    # Exiting: its memory (and with it the environment /proc shows) is gone before its
    # files (a GPU's device among them) are closed.
    fake_process(tmp_path, 100, b"", "D", 5000)
    assert processes.marked_pids(marker, tmp_path) == []
    assert watch.alive() == [100]
    fake_process(tmp_path, 100, b"", "Z", 5000)  # over: it holds nothing any more
    assert watch.alive() == []


def test_whoever_ends_a_marker_later_sees_the_processes_an_earlier_scan_saw(
    tmp_path: Path,
) -> None:
    """Two enders in one agent: the runner stopping a pod it took over (the pod's part
    marker) and the leftover sweep (the job's marker). The second began once the first's
    SIGTERM had the ranks exiting; with only what it could see itself it found nothing
    marked, and the GPUs were reported free while a rank was still exiting."""
    marker = processes.new_marker()
    pod = processes.part_marker(marker, 0)
    fake_process(tmp_path, 100, f"{processes.MARKER_VARIABLE}={pod}.0\0".encode(), "S", 5000)
    assert processes.Watch(pod, tmp_path).alive() == [100]
    fake_process(tmp_path, 100, b"", "D", 5000)  # exiting: its environment reads empty
    sweep = processes.Watch(marker, tmp_path)
    assert sweep.alive() == [100]
    fake_process(tmp_path, 100, b"", "Z", 5000)
    assert sweep.alive() == []
    assert processes.Watch(marker, tmp_path).alive() == []


def test_a_pid_handed_out_again_is_not_the_process_that_had_it(tmp_path: Path) -> None:
    fake_process(tmp_path, 7, b"", "R", 100)
    assert processes.running(7, 100, tmp_path)
    assert processes.start_ticks(7, tmp_path) == 100
    assert not processes.running(7, 99, tmp_path)  # another process with the same pid
    assert not processes.running(8, 100, tmp_path)  # gone
    assert processes.start_ticks(8, tmp_path) is None
