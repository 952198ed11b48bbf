"""Scheduling-cycle latency at the scale of the platform gpufleet is modelled on.

4 clusters × 3 zones, 2,000 nodes × 8 GPUs = 16,000 GPUs, 200 projects (10 organisations ×
20 projects, guarantees covering 80% of the fleet), about 90% of the GPUs held by running
workloads, and 10,000 waiting workloads: 70% sessions of 1–8 GPUs, 30% jobs of 16–1,024
GPUs (pods of 8). Every cycle first applies churn through the store — arrivals,
completions (which free GPUs for admissions), a node cordoned or uncordoned — and then a
cycle is timed: applying the changes since the last one to the mirror, ``plan``, and
committing the decisions in one transaction (SQLite file in WAL mode, as embedded).

Baseline, in the same run: the same cycle with the mirror rebuilt from the database
(what a scheduler without an incremental snapshot does every cycle). Target: p99 ≤ 100 ms
on one core. Then the scaling table: 1k/4k/16k/64k GPUs at 10k waiting, and 1k/10k/100k
waiting at 16k GPUs.

World "gang-preemption", at the same scale: the running work is mostly big gangs (64–256
GPUs, pods of 8) of projects far beyond their guarantees and of opportunistic work, and
most of the 10,000 waiting are within their project's guarantee, so every cycle runs
preemption searches and stops victims (the preemptions per cycle are printed). Each
cycle's churn ends the victims stopped the cycle before (their backends report them gone),
completes some work (of the projects within guarantee as much as they reclaim, so the
reclaiming never runs out) and brings new arrivals.

Against another revision (``--against REV``): a git worktree of REV (made once, in
/tmp/gpufleet-bench-<rev>) and this tree each run the worlds in a worker process of this
very file, with ``gpufleet`` resolved to that tree's code through a symlink farm that
mirrors ``package-dir`` of the tree's pyproject.toml. The worlds are built by this bench's
code on both sides (``cycle_worlds.py``; each side's database made by its own migrations);
rounds of cycles run alternately on the two sides, and p50/p99 of each side and the ratio
new/old are printed per world. Target: p99 new/old <= 1.10.

    .venv/bin/python bench/scheduler_cycle.py [--cycles 100] [--quick] [--profile]
    .venv/bin/python bench/scheduler_cycle.py --against main [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from cycle_worlds import T0, WORLDS, World, build, churn

from gpufleet.scheduler.snapshot import Policy

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ one side
class Side:
    """A world's store and clock, cycled round by round (the ``--against`` worker's)."""

    def __init__(self, world: World, path: Path):
        self.world = world
        started = time.perf_counter()
        self.store, self.rng = world.build(path, world.nodes, world.waiting)
        self.build_s = time.perf_counter() - started
        self.policy = Policy(min_run_time_s=300)
        self.now = T0
        started = time.perf_counter()
        self.store.scheduling.scheduling_cycle(
            self.now, self.policy
        )  # the first cycle reads everything
        self.cold_s = time.perf_counter() - started

    def cycles(self, n: int, profiler: cProfile.Profile | None = None) -> dict[str, list[Any]]:
        wall: list[float] = []
        cpu: list[float] = []
        preemptions: list[int] = []
        admissions: list[int] = []
        queue: list[int] = []
        for _ in range(n):
            self.now += timedelta(seconds=self.world.step_s)
            self.world.churn(self.store, self.rng, self.now)
            if profiler:
                profiler.enable()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = self.store.scheduling.scheduling_cycle(self.now, self.policy)
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            if profiler:
                profiler.disable()
            preemptions.append(len(result.plan.preemptions))
            admissions.append(len(result.plan.admissions))
            queue.append(len(result.plan.waiting))
        return dict(wall=wall, cpu=cpu, preemptions=preemptions, admissions=admissions, queue=queue)


def run(nodes: int, waiting: int, cycles: int, profile: bool = False) -> dict[str, float]:
    """The main world's figures, with the baseline: every fifth cycle rebuilds the mirror."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        store, rng = build(Path(tmp) / "bench.sqlite", nodes, waiting)
        built = time.perf_counter() - started
        policy = Policy(min_run_time_s=300)
        now = T0
        started = time.perf_counter()
        store.scheduling.scheduling_cycle(now, policy)  # the first cycle reads everything
        cold = time.perf_counter() - started
        incremental, cpu, rebuilt, plans = [], [], [], []
        profiler = cProfile.Profile() if profile else None
        for i in range(cycles):
            now += timedelta(seconds=1)
            churn(store, rng, now, arrivals=20, completions=20)
            if i % 5 == 4:  # the baseline: every fifth cycle reads the world afresh
                store.scheduling.forget_mirror()
                started = time.perf_counter()
                store.scheduling.scheduling_cycle(now, policy)
                rebuilt.append(time.perf_counter() - started)
                continue
            if profiler:
                profiler.enable()
            started, cpu_started = time.perf_counter(), time.process_time()
            result = store.scheduling.scheduling_cycle(now, policy)
            incremental.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            if profiler:
                profiler.disable()
            plans.append(len(result.plan.waiting))
        if profiler:
            stats = pstats.Stats(profiler).sort_stats("cumulative")
            stats.print_stats(30)
            if os.environ.get("GPUFLEET_BENCH_CALLERS"):
                stats.print_callers(os.environ["GPUFLEET_BENCH_CALLERS"])
        return {
            "gpus": nodes * 8,
            "waiting": waiting,
            "build_s": built,
            "cold_s": cold,
            "p50": statistics.median(incremental) * 1000,
            "p99": _p99(incremental) * 1000,
            "cpu_p50": statistics.median(cpu) * 1000,
            "cpu_p99": _p99(cpu) * 1000,
            "rebuilt_p50": statistics.median(rebuilt) * 1000 if rebuilt else float("nan"),
            "queue": statistics.mean(plans),
        }


def gangs(cycles: int) -> None:
    """The gang-preemption world's figures."""
    world = WORLDS["gang-preemption"]
    with tempfile.TemporaryDirectory() as tmp:
        side = Side(world, Path(tmp) / "bench.sqlite")
        r = side.cycles(cycles)
    pre = r["preemptions"]
    print(f"gang-preemption: {world.title}, {cycles} cycles")
    print(f"  database built in {side.build_s:.1f} s; first cycle {side.cold_s * 1000:.0f} ms")
    print(
        f"  cycle p50 {statistics.median(r['wall']) * 1000:.1f} ms, p99 "
        f"{_p99(r['wall']) * 1000:.1f} ms; CPU p50 {statistics.median(r['cpu']) * 1000:.1f} ms, "
        f"p99 {_p99(r['cpu']) * 1000:.1f} ms"
    )
    print(
        f"  preemptions per cycle: mean {statistics.mean(pre):.1f}, min {min(pre)}, "
        f"max {max(pre)}, in {sum(1 for p in pre if p)} of {len(pre)} cycles; "
        f"admissions per cycle mean {statistics.mean(r['admissions']):.1f}; "
        f"waiting {r['queue'][-1]}"
    )
    print()
    sys.stdout.flush()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# ------------------------------------------------------------------ --against
def worktree(rev: str) -> tuple[Path, str]:
    """A git worktree of ``rev`` in /tmp/gpufleet-bench-<rev> (made, or moved to ``rev``'s
    commit when it is there already); its path and the commit."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    path = Path(tempfile.gettempdir()) / f"gpufleet-bench-{re.sub(r'[^A-Za-z0-9._-]', '-', rev)}"
    if not (path / ".git").exists():
        _git("worktree", "add", "--detach", str(path), commit)
    elif _git("-C", str(path), "rev-parse", "HEAD").strip() != commit:
        _git("-C", str(path), "checkout", "--quiet", "--detach", commit)
    return path, commit


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


def package_farm(tree: Path, into: Path) -> Path:
    """A folder to put first on ``sys.path`` so that ``gpufleet`` is ``tree``'s code, as
    the strict editable install maps it: ``package-dir`` of the tree's pyproject.toml, by
    symlinks (the top package's files one by one, every other package's folder whole
    unless it lies inside its parent's already)."""
    setuptools = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: Mapping[str, str] = setuptools["package-dir"]
    top = into / "gpufleet"
    top.mkdir(parents=True)
    for entry in (tree / mapping["gpufleet"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        if package == "gpufleet":
            continue
        parent, last = package.rsplit(".", 1)
        if parent in mapping and Path(mapping[parent]) / last == Path(folder):
            continue  # inside its parent's folder, which is linked whole
        link = into.joinpath(*package.split("."))
        if (
            link.exists()
            or link.is_symlink()
            or any(p.is_symlink() for p in link.parents if into in p.parents)
        ):
            raise SystemExit(f"{tree}: package {package} cannot be mapped by symlinks")
        link.symlink_to(tree / folder)
    return into


class Worker:
    """This file run as a worker (``--worker``) over one tree's code: one world, cycled a
    round at a time on request."""

    def __init__(self, label: str, tree: Path, world: str, farm: Path):
        self.label, self.tree = label, tree
        env = dict(os.environ, PYTHONPATH=str(farm), PYTHONDONTWRITEBYTECODE="")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", world],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.preemptions: list[int] = []
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        self.ready = self._answer()

    def round(self, cycles: int) -> None:
        self._ask({"cycles": cycles})
        result = self._answer()
        self.wall += result["wall"]
        self.cpu += result["cpu"]
        self.preemptions += result["preemptions"]

    def close(self) -> None:
        if self.process.poll() is None:
            self._ask({"quit": True})
            self.process.wait(timeout=60)

    def _ask(self, message: Mapping[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                answer: dict[str, Any] = json.loads(line[len(ANSWER) :])
                return answer
        raise SystemExit(f"the {self.label} worker stopped (exit status {self.process.wait()})")


ANSWER = "@@bench "


def worker(world: str, out: IO[str]) -> None:
    """The worker's side of ``Worker``: build, then a round per request, until told to quit."""
    import gpufleet.scheduler.plan as plan_module

    with tempfile.TemporaryDirectory() as tmp:
        side = Side(WORLDS[world], Path(tmp) / "bench.sqlite")
        code = str(Path(plan_module.__file__).resolve().parents[1])
        out.write(
            ANSWER + json.dumps({"build_s": side.build_s, "cold_s": side.cold_s, "code": code})
        )
        out.write("\n")
        out.flush()
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("quit"):
                return
            out.write(ANSWER + json.dumps(side.cycles(int(request["cycles"]))) + "\n")
            out.flush()


def against(rev: str, worlds: list[str], rounds: int, cycles: int) -> None:
    """Each world on this tree (new) and on ``rev`` (old), rounds interleaved."""
    old_tree, commit = worktree(rev)
    print(f"new: {ROOT} (this tree, as it is on disk)")
    print(f"old: {rev} = {commit[:12]}, worktree {old_tree}")
    print(f"{rounds} rounds of {cycles} cycles per side and world, alternating new/old")
    with tempfile.TemporaryDirectory() as tmp:
        farms = {
            "new": package_farm(ROOT, Path(tmp) / "new"),
            "old": package_farm(old_tree, Path(tmp) / "old"),
        }
        for world in worlds:
            print()
            print(f"world {world}: {WORLDS[world].title}")
            sides = {
                "new": Worker("new", ROOT, world, farms["new"]),
                "old": Worker("old", old_tree, world, farms["old"]),
            }
            try:
                for side in sides.values():  # both build at once; nothing is timed yet
                    side.wait_ready()
                for label, side in sides.items():
                    print(
                        f"  {label}: gpufleet.scheduler from {side.ready['code']}; built in "
                        f"{side.ready['build_s']:.1f} s, first cycle {side.ready['cold_s']:.1f} s"
                    )
                    sys.stdout.flush()
                for r in range(rounds):
                    order = ("new", "old") if r % 2 == 0 else ("old", "new")
                    for label in order:
                        sides[label].round(cycles)
            finally:
                for side in sides.values():
                    side.close()
            for label, side in sides.items():
                pre = side.preemptions
                print(
                    f"  {label}: cycle p50 {statistics.median(side.wall) * 1000:.1f} ms, "
                    f"p99 {_p99(side.wall) * 1000:.1f} ms; CPU p50 "
                    f"{statistics.median(side.cpu) * 1000:.1f} ms, p99 "
                    f"{_p99(side.cpu) * 1000:.1f} ms; preemptions per cycle mean "
                    f"{statistics.mean(pre):.1f} (min {min(pre)}, max {max(pre)}; in "
                    f"{sum(1 for p in pre if p)} of {len(pre)} cycles)"
                )
            new, old = sides["new"], sides["old"]
            ratio = _p99(new.wall) / _p99(old.wall)
            cpu_ratio = _p99(new.cpu) / _p99(old.cpu)
            verdict = "ok" if ratio <= 1.10 else "OVER"
            print(
                f"  p99 new/old {ratio:.2f} (target <= 1.10: {verdict}); "
                f"CPU p99 new/old {cpu_ratio:.2f}"
            )
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, help="cycles per world (100; --quick: 30)")
    parser.add_argument("--quick", action="store_true", help="the main points only")
    parser.add_argument("--profile", action="store_true", help="profile the main point's cycles")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="compare with REV's code (a worktree in /tmp), rounds interleaved",
    )
    parser.add_argument("--rounds", type=int, help="--against: rounds per side (5; --quick: 3)")
    parser.add_argument(
        "--world",
        action="append",
        choices=sorted(WORLDS),
        help="--against: only this world (repeatable; default: all)",
    )
    parser.add_argument("--worker", choices=sorted(WORLDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, sys.stdout)
        return
    cycles = args.cycles or ((18 if args.against else 30) if args.quick else 100)
    if args.against:
        rounds = args.rounds or (3 if args.quick else 5)
        against(args.against, args.world or list(WORLDS), rounds, max(1, cycles // rounds))
        return
    args.cycles = cycles
    gangs(cycles)
    main_point = run(2000, 10_000, args.cycles, args.profile)
    m = main_point
    print(
        f"16,000 GPUs, 10,000 waiting, {args.cycles} cycles under churn "
        "(20 arrivals, 20 completions, 1 node change per cycle)"
    )
    print(
        f"  database built in {m['build_s']:.1f} s; "
        f"first cycle (reads everything) {m['cold_s'] * 1000:.0f} ms"
    )
    print(
        f"  cycle p50 {m['p50']:.1f} ms, p99 {m['p99']:.1f} ms "
        f"(target p99 <= 100 ms: ratio {m['p99'] / 100:.2f})"
    )
    print(
        f"  cycle CPU time p50 {m['cpu_p50']:.1f} ms, p99 {m['cpu_p99']:.1f} ms "
        "(the process's own time: less noisy on a shared machine)"
    )
    print(
        f"  baseline, the mirror rebuilt from the database each cycle: p50 "
        f"{m['rebuilt_p50']:.0f} ms (incremental: {m['rebuilt_p50'] / m['p50']:.1f}x faster)"
    )
    if args.quick:
        return
    print()
    print(
        f"{'GPUs':>7} {'waiting':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU p50':>8} {'CPU p99':>8} "
        f"{'rebuilt p50 ms':>15}"
    )
    points = [(125, 10_000), (500, 10_000), (2000, 10_000), (8000, 10_000)]
    points += [(2000, 1_000), (2000, 100_000)]
    for nodes, waiting in points:
        cycles = max(10, args.cycles // (4 if nodes * 8 * waiting > 2e8 else 1))
        r = m if (nodes, waiting) == (2000, 10_000) else run(nodes, waiting, cycles)
        print(
            f"{int(r['gpus']):>7} {int(r['waiting']):>8} {r['p50']:>8.1f} {r['p99']:>8.1f} "
            f"{r['cpu_p50']:>8.1f} {r['cpu_p99']:>8.1f} {r['rebuilt_p50']:>15.0f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
