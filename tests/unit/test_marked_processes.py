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
