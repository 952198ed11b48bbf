"""The idle culler's two figures, on a real hub, controller, agent and sandboxed sessions.

1. **Threshold to GPUs**: alice's 4-GPU session is idle (``always``, a 15 s time-out, no
   warning period) while bob waits for vision's 4 GPUs. From the moment alice's session
   crosses its idle threshold (the ``due_at`` the culler recorded) to bob's admission,
   minus the time of the snapshot itself (the live pass, as its event reports it, plus
   the spawner's final pass, as its release message reports it). Target: at most 2 s.
   The culler runs at its default 30 s interval: it wakes at the threshold, not a round
   later.
2. **Restore to ready**: a session whose home holds a 1.7 GB Python environment (the
   snapshot benchmark's, ``~/.cache/gpufleet-bench/env``) is stopped (the final pass
   snapshots it); its home is then moved away, as on a node that never had it, and the
   session started again: spawn request to the server answering, the restore included.
   Baseline, in the same run: the same session started with its home in place (nothing
   to restore); for scale, ``cp -a`` of the environment to the same disk, with ``sync``.

    .venv/bin/python bench/culler.py [--rounds 3] [--restore-rounds N] [--env DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' hub harness
from tests.integration.harness import Hub, wait_for

CONFIG = """
c.Culling.idle_policies = {
    "default": {"mode": "on-demand"},
    "projects": {"vision": {"mode": "always", "idle_timeout_s": 15, "warn_before_s": 0}},
}
"""
GPUS = {"project": "vision", "gpu_type": "A100-80GB", "gpus": 4}


def events_of(hub: Hub, workload_id: int) -> list[dict[str, Any]]:
    items = hub.controller("GET", "/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e.get("workload_id") == workload_id]


def when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def threshold_to_gpus(hub: Hub, server: str) -> dict[str, float]:
    hub.spawn("alice", server, **GPUS)
    hub.wait_ready("alice", server)
    alice = hub.workload_of("alice", server)
    assert alice is not None
    hub.spawn("bob", server, **GPUS)
    bob = wait_for(
        lambda: (w := hub.workload_of("bob", server)) and w["state"] == "running" and w,
        180,
        "bob running on alice's GPUs",
    )
    evs = events_of(hub, alice["id"])
    cull = next(e for e in evs if e["kind"] == "session-cull")
    live = next(e for e in evs if e["kind"] == "session-snapshot")
    ended = hub.wait_ended(alice, 60)
    live_s = float(re.search(r"in ([\d.]+) s", live["message"]).group(1))  # type: ignore[union-attr]
    final = re.search(r"final snapshot \S+ in ([\d.]+) s", ended["reason"])
    final_s = float(final.group(1)) if final else 0.0
    crossed = when(cull["data"]["due_at"])
    assigned = when(bob["admitted_at"])
    total = (assigned - crossed).total_seconds()
    steps = {
        "cull decided": when(cull["at"]),
        "live pass done": when(live["at"]),
        "GPUs released": when(ended["ended_at"]),
        "bob admitted": assigned,
    }
    print(
        f"  {server}: after the threshold: "
        + ", ".join(f"{k} +{(v - crossed).total_seconds():.2f} s" for k, v in steps.items())
    )
    hub.stop_server("bob", server)
    hub.wait_gone("bob", server)
    return {"total": total, "live": live_s, "final": final_s, "overhead": total - live_s - final_s}


def time_to_ready(hub: Hub, server: str) -> float:
    token = hub.user_token("alice")
    url = f"{hub.url}/user/alice/{server}/api"
    started = time.perf_counter()
    response = hub.spawn("alice", server, **{**GPUS, "gpus": 1})
    assert response.status_code in (201, 202), response.text

    def answering() -> bool:
        try:
            answer = httpx.get(url, headers={"Authorization": f"token {token}"}, timeout=5)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    wait_for(answering, 600, "alice's server answering", interval=0.02)
    return time.perf_counter() - started


def restore_to_ready(hub: Hub, env: Path, server: str) -> dict[str, float]:
    home = hub.data_dir / "homes" / "alice"
    hub.spawn("alice", server, **{**GPUS, "gpus": 1})
    hub.wait_ready("alice", server)
    hub.stop_server("alice", server)
    hub.wait_gone("alice", server)
    target = home / "envs" / "torch"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", str(env), str(target)], check=True)
    baseline = time_to_ready(hub, server)  # home in place: nothing to restore
    stopping = time.perf_counter()
    hub.stop_server("alice", server)  # the final pass snapshots the 1.7 GB home
    hub.wait_gone("alice", server, timeout=600)
    stop_s = time.perf_counter() - stopping
    away = home.with_name("alice-away")
    home.rename(away)  # a node that never had this home
    try:
        restored = time_to_ready(hub, server)
        assert (home / "envs" / "torch" / "pyvenv.cfg").exists(), "the environment is back"
    finally:
        hub.stop_server("alice", server)
        hub.wait_gone("alice", server, timeout=600)
        shutil.rmtree(home, ignore_errors=True)
        away.rename(home)
    # What writing these bytes costs this machine's disk at all: cp -a to the same file
    # system, and sync (the restore writes 1.7 GB there).
    copy = home.parent / "copy-check"
    began = time.perf_counter()
    subprocess.run(["cp", "-a", str(env), str(copy)], check=True)
    subprocess.run(["sync"], check=True)
    copy_s = time.perf_counter() - began
    shutil.rmtree(copy)
    return {"baseline": baseline, "restored": restored, "stop": stop_s, "copy": copy_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--env", type=Path, default=Path.home() / ".cache" / "gpufleet-bench" / "env"
    )
    parser.add_argument(
        "--restore-rounds", type=int, default=None, help="default: --rounds; 0 skips part 2"
    )
    args = parser.parse_args()
    restore_rounds = args.rounds if args.restore_rounds is None else args.restore_rounds
    if restore_rounds and not (args.env / "pyvenv.cfg").exists():
        raise SystemExit(f"{args.env}: run bench/snapshot.py once to create the environment")
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        hub = Hub.create(Path(tmp) / "hub", extra_config=CONFIG)
        try:
            hub.start()
            culls = [threshold_to_gpus(hub, f"c{i}") for i in range(args.rounds)]
            resumes = [restore_to_ready(hub, args.env, f"r{i}") for i in range(restore_rounds)]
        except BaseException:
            print("\n".join(hub.log_path.read_text().splitlines()[-60:]), file=sys.stderr)
            raise
        finally:
            hub.kill_everything()

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"idle threshold -> waiting workload's GPUs assigned, {args.rounds} rounds (median)")
    print(f"  total                       : {median(culls, 'total'):6.2f} s")
    print(f"  live snapshot pass          : {median(culls, 'live'):6.2f} s")
    print(f"  final snapshot pass         : {median(culls, 'final'):6.2f} s")
    worst = max(r["overhead"] for r in culls)
    print(
        f"  beyond the snapshot's time  : {median(culls, 'overhead'):6.2f} s "
        f"(worst {worst:.2f} s; target <= 2 s)"
    )
    if not resumes:
        return
    print(f"restore to ready, a 1.7 GB environment in the home, {restore_rounds} rounds (median)")
    print(f"  start without a snapshot    : {median(resumes, 'baseline'):6.2f} s")
    print(f"  start restoring the snapshot: {median(resumes, 'restored'):6.2f} s")
    print(
        f"  ratio                       : "
        f"{median(resumes, 'restored') / median(resumes, 'baseline'):6.2f}"
    )
    print(f"  stop with its final snapshot: {median(resumes, 'stop'):6.2f} s")
    print(f"  for scale: cp -a + sync of it: {median(resumes, 'copy'):6.2f} s (the same disk)")


if __name__ == "__main__":
    main()
