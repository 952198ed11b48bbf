"""What containment costs a spawn and a job's start, a new user's first start, and memory.

In one run, on this machine, with the same code the spawner and the agent run
(docs/containment.md), against a baseline of the same command started as the same uid
without containment:

- **spawn**: preparing a server's sandbox (its layers, home, prefix, passwd entries) and
  starting a command in it as the user through the session's own virtualenv, until that
  command runs (JupyterLab's own start excluded: the command is the interpreter printing
  one line), against ``setpriv`` running the same interpreter directly;
- **job start**: the same for a pod (the agent's layers, log and checkpoint directories, a
  copy of the session's environment pinned for it) with ``env -i``, against the same;
- **first spawn of a new user**: recording the account, making the home and the
  session's virtualenv (once per user and server);
- **memory**: the resident memory of the sandbox's own processes (the shell that waits,
  unshare's shell, bwrap and its init) beside the command, per session.

    .venv/bin/python bench/containment.py [--rounds 10]

Root is needed (the overlay mounts and the switch to the user), and the sessions' base
environment (scripts/build-session-env).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from gpufleet.agent.containment import RankAccount, rank_command, rank_environment
from gpufleet.agent.job_launch import owned_directory, prepare_layers
from gpufleet.snapshotter.sandbox import (
    SandboxDirs,
    default_session_env,
    host_root,
    probe,
    write_identity,
)
from gpufleet.spawner.sandboxing import Containment, SessionDirs, sandboxed_command
from gpufleet.state import db
from gpufleet.state.fleet import FleetStore

BASE = Path(default_session_env())
PREFIX = Path("/opt/gpufleet/env")
UID = 299_990  # a uid of the default sandbox range no bench user of a deployment gets
SAY = ["python", "-c", "print('up')"]


def run_until_up(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd="/")
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or "up" not in done.stdout:
        raise SystemExit(f"the command failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def direct(python: Path) -> list[str]:
    return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--", str(python),
            "-c", "print('up')"]  # fmt: skip


def spawn_round(root: Path, support: object, fresh: bool) -> tuple[float, float]:
    """(contained, baseline) seconds for one start of a server; ``fresh``: a new user."""
    dirs = SessionDirs(root / "sessions" / "bench" / "default")
    home = root / "homes" / "bench"
    if fresh:
        shutil.rmtree(root / "sessions", ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    containment = Containment("bench", UID, UID, "sandbox", BASE, PREFIX)
    env = {"PATH": f"{PREFIX}/bin:{BASE}/bin:/usr/bin:/bin", "HOME": str(home)}
    started = time.perf_counter()
    argv = sandboxed_command(
        support,  # type: ignore[arg-type]
        dirs,
        SAY,
        home=home,
        containment=containment,
        extra_binds=(),
        read_only=(),
        notebook_dir="",
    )
    prepared = time.perf_counter() - started
    contained = prepared + run_until_up(argv, env)
    baseline = run_until_up(direct(BASE / "bin" / "python"), env)
    return contained, baseline


def job_round(root: Path, support: object, pinned: Path) -> tuple[float, float]:
    pod = root / "jobs" / "1" / "pod-0"
    home = root / "homes" / "bench"
    account = RankAccount("bench", UID, UID, home)
    started = time.perf_counter()
    dirs = SandboxDirs(pod / "sandbox")
    for path in (pod, dirs.root):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    ranks = pod / "ranks"
    owned_directory(ranks, UID, UID)
    prepare_layers(dirs, host_root(), account, PREFIX)
    read_only = write_identity(dirs.root, "bench", UID, UID, home)
    env = rank_environment(account, BASE, PREFIX, {}, {"GPUFLEET_JOB_ID": "1"})
    argv = rank_command(
        support,  # type: ignore[arg-type]
        dirs,
        root=host_root(),
        account=account,
        base_env=BASE,
        prefix=PREFIX,
        argv=SAY,
        env=env,
        cwd=home,
        writable=[ranks],
        read_only=read_only,
        pinned=pinned,
    )
    prepared = time.perf_counter() - started
    contained = prepared + run_until_up(argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    baseline = run_until_up(direct(BASE / "bin" / "python"), env)
    return contained, baseline


def first_start(root: Path) -> dict[str, float]:
    """The one-time parts of a new user's first start, each timed on its own."""
    engine = db.make_engine(f"sqlite:///{root / 'bench.sqlite'}")
    db.upgrade(engine)
    store = FleetStore(engine, "bench")
    store.try_acquire_lease(datetime.now(UTC))
    started = time.perf_counter()
    store.accounts.account(datetime.now(UTC), "newcomer")
    account = time.perf_counter() - started
    home = root / "homes" / "newcomer"
    started = time.perf_counter()
    home.mkdir(mode=0o700, parents=True)
    os.chown(home, UID, UID)
    made_home = time.perf_counter() - started
    venv_dir = root / "venv-probe"
    started = time.perf_counter()
    subprocess.run(
        [str(BASE / "bin" / "python"), "-m", "gpufleet.spawner.session_venv", str(venv_dir),
         "--", "true"],
        check=True,
    )  # fmt: skip
    venv = time.perf_counter() - started
    return {"account recorded": account, "home made": made_home, "session venv made": venv}


def sandbox_memory(root: Path, support: object) -> tuple[int, int]:
    """(KiB of the sandbox's own processes, KiB of the command) while a session runs."""
    dirs = SessionDirs(root / "sessions" / "bench" / "default")
    home = root / "homes" / "bench"
    containment = Containment("bench", UID, UID, "sandbox", BASE, PREFIX)
    argv = sandboxed_command(
        support,  # type: ignore[arg-type]
        dirs,
        ["python", "-c", "import time; print('up', flush=True); time.sleep(30)"],
        home=home,
        containment=containment,
        extra_binds=(),
        read_only=(),
        notebook_dir="",
    )
    env = {"PATH": f"{PREFIX}/bin:{BASE}/bin:/usr/bin:/bin", "HOME": str(home)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        tree = _tree(proc.pid)
        rss = {pid: _rss(pid) for pid in tree}
        command = max(rss, key=lambda pid: rss[pid])
        return sum(v for pid, v in rss.items() if pid != command), rss[command]
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["pkill", "-KILL", "-U", str(UID)], check=False)


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += children.get(current, [])
    return found


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: overlay mounts and the switch to the user need it")
    if not (BASE / "bin" / "python").exists():
        raise SystemExit(f"no sessions' base environment at {BASE}: scripts/build-session-env")
    root = Path(tempfile.mkdtemp(prefix="gpufleet-bench-containment-"))
    root.chmod(0o700)
    try:
        support = probe(root)
        print(f"sandbox: {support.mode.value} ({support.reason})")
        first = spawn_round(root, support, fresh=True)
        spawns = [spawn_round(root, support, fresh=False) for _ in range(args.rounds)]
        pinned = root / "pinned"
        shutil.copytree(root / "sessions" / "bench" / "default" / "upper", pinned, symlinks=True)
        jobs = [job_round(root, support, pinned) for _ in range(args.rounds)]
        once = first_start(root)
        wrapper_kib, command_kib = sandbox_memory(root, support)
    finally:
        subprocess.run(["pkill", "-KILL", "-U", str(UID)], check=False)
        shutil.rmtree(root, ignore_errors=True)

    def report(name: str, rounds: list[tuple[float, float]]) -> None:
        contained = statistics.median(c for c, _ in rounds) * 1000
        baseline = statistics.median(b for _, b in rounds) * 1000
        print(
            f"{name}: contained {contained:.0f} ms, baseline {baseline:.0f} ms, "
            f"containment adds {contained - baseline:.0f} ms (ratio {contained / baseline:.2f}; "
            f"target: adds ≤ 150 ms), median of {len(rounds)}"
        )

    report("spawn (server start excluded)", spawns)
    report("job start (torchrun's start excluded)", jobs)
    print(
        f"first spawn of a new user (its venv made in it): {first[0] * 1000:.0f} ms, against "
        f"{first[1] * 1000:.0f} ms without containment; one-time parts: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in once.items())
    )
    print(
        f"memory per session: the sandbox's own processes {wrapper_kib / 1024:.1f} MiB beside "
        f"the command's {command_kib / 1024:.1f} MiB"
    )


if __name__ == "__main__":
    sys.exit(main())
