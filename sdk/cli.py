"""The ``gpufleet`` command: the queue, quotas, the nodes, cordon and uncordon, and
training jobs (submit, jobs, logs, cancel, projects) through the SDK ``gpufleet.client``
(``fleet_cli.py``, ``job_cli.py``), the what-if simulator (``gpufleet simulate``,
docs/simulator.md), the fault-injection model (``gpufleet simulate-faults``,
``faults_cli.py``) and snapshots (``gpufleet snapshot``, ``snapshot_cli.py``,
docs/snapshots.md).

Exit codes: 0 done; 1 a part of gpufleet this install lacks; 2 bad input (arguments,
trace, fleet or projects file), with a message that names the file and what to fix; 130
interrupted (Ctrl-C); 141 the output's reader went away (``gpufleet logs 7 | head``). The
API commands and the snapshot commands say theirs in their modules. No expected error
prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__, faults_cli, fleet_cli, snapshot_cli

if TYPE_CHECKING:
    from rich.console import Console

    from .scheduler.simulator_report import SimulationResult, Waits

EXIT_MISSING_EXTRA = 1
EXIT_BAD_INPUT = 2


EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # as if killed by SIGPIPE, what shells expect of `cmd | head`


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("gpufleet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read the output stopped reading: nothing more to say, and nothing must be
        # written to the closed pipe when Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpufleet",
        description="gpufleet: share GPUs through JupyterHub. Server side: "
        "`jupyterhub -f jupyterhub_config.py`, `gpufleet-controller upgrade-db`.",
    )
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    fleet_cli.add_fleet_commands(commands)
    _add_simulate(commands)
    faults_cli.add_simulate_faults(commands)
    snapshot_cli.add_snapshot(commands)
    args = parser.parse_args(argv)
    if args.command in fleet_cli.COMMANDS:
        from rich.console import Console

        return fleet_cli.fleet_command(args, Console(), Console(stderr=True))
    if args.command == "simulate":
        return simulate_command(args)
    if args.command == "simulate-faults":
        return faults_cli.simulate_faults_command(args)
    if args.command == "snapshot":
        from rich.console import Console

        return snapshot_cli.snapshot_command(args, Console(), Console(stderr=True))
    parser.print_help()
    return 0


# ---------------------------------------------------------------------- simulate
def _add_simulate(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate",
        help="replay a job trace under a proposed quota configuration",
        description="Replay a job trace on a fleet under a project tree and a policy; "
        "write one JSON record per job and print a summary. Formats: docs/simulator.md.",
    )
    sim.add_argument("trace", type=Path, help="CSV: job_id,submit_s,duration_s,num_gpus,group")
    sim.add_argument("--fleet", type=Path, required=True, help="YAML: clusters, zones, pools")
    sim.add_argument(
        "--projects",
        type=Path,
        help="YAML: the project tree with quotas; without it every group is opportunistic",
    )
    sim.add_argument(
        "--policy",
        choices=("gpufleet", "fifo", "static"),
        default="gpufleet",
        help="gpufleet: guarantees, borrowing, preemption; static: guarantees, no "
        "borrowing; fifo: arrival order, no quotas (default: %(default)s)",
    )
    sim.add_argument(
        "--out",
        type=Path,
        default=Path("simulation.json"),
        help="where to write the JSON result; '-' for standard output, the table then "
        "going to standard error (default: %(default)s)",
    )
    sim.add_argument("--min-run-time", type=_seconds, default=300.0, metavar="SECONDS")
    sim.add_argument("--checkpoint-interval", type=_interval, default=1800.0, metavar="SECONDS")
    sim.add_argument("--session-snapshot", type=_seconds, default=20.0, metavar="SECONDS")
    sim.add_argument("--job-grace", type=_seconds, default=30.0, metavar="SECONDS")
    sim.add_argument(
        "--fault-rate",
        default="0",
        metavar="PER_GPU_HOUR",
        help="inject infrastructure faults into every training job: faults per GPU-hour, "
        "or 'llama3' (Llama 3 405B's: 419 in 54 days on 16,384 GPUs); each is detected "
        "--fault-detect seconds later, the job loses the work since its checkpoint and "
        "restarts at once, spending --fault-restart seconds to start and load it "
        "(default: none)",
    )
    sim.add_argument("--fault-detect", type=_seconds, default=60.0, metavar="SECONDS")
    sim.add_argument("--fault-restart", type=_seconds, default=60.0, metavar="SECONDS")
    sim.add_argument(
        "--fault-repair",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="how long the faulty node (one of the job's) stays out of service once the "
        "fault is found, as if cordoned (default: 0, repaired at once)",
    )
    sim.add_argument(
        "--fault-budget",
        type=int,
        default=3,
        metavar="N",
        help="faults per 1,024 GPUs within a day a job restarts from, as the controller's "
        "job_fault_budget (default: %(default)s)",
    )
    sim.add_argument("--fault-seed", type=int, default=0, metavar="N")
    sim.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="N",
        help="recovery spares: N nodes held back per zone and GPU type for jobs "
        "restarting after a fault, lent to preemptible work meanwhile, as "
        "c.FleetController.recovery_spares = {'*': N} (default: none)",
    )


# scheduler/inputs.py's MAX_SECONDS, which the trace's times share: that module needs the
# server extra, and the options are read before anything says whether it is installed.
MAX_SECONDS = 10**10  # "1e10" in the messages


def _seconds(text: str, least: str = "from 0") -> float:
    """A SECONDS option: a number of seconds up to MAX_SECONDS. NaN, infinity and 1e400
    (which reads as infinity) would run the replay's clock forever; argparse names the
    option and exits 2 with this message."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ((value > 0 if least == "more than 0" else value >= 0) and value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds {least} up to 1e10, not {text!r}"
        )
    return value


def _interval(text: str) -> float:
    return _seconds(text, "more than 0")


def simulate_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    try:
        from .scheduler import inputs, simulator
        from .scheduler.errors import InputError
        from .scheduler.model import ProjectTree
        from .scheduler.simulator_report import result_json
    except ImportError as e:
        print(
            f"gpufleet simulate needs the server extra ({e.name} is missing): "
            "pip install 'gpufleet[server]'",
            file=sys.stderr,
        )
        return EXIT_MISSING_EXTRA
    to_stdout = str(args.out) == "-"
    console = Console(stderr=to_stdout)
    try:
        jobs = inputs.read_trace(args.trace)
        nodes = inputs.read_fleet(args.fleet)
        projects = inputs.read_projects(args.projects) if args.projects else ProjectTree({})
        options = simulator.SimulationOptions(
            session_snapshot_s=args.session_snapshot,
            job_checkpoint_grace_s=args.job_grace,
            checkpoint_interval_s=args.checkpoint_interval,
            min_run_time_s=args.min_run_time,
            fault_rate_per_gpu_hour=_fault_rate(args.fault_rate),
            fault_detect_s=args.fault_detect,
            fault_restart_s=args.fault_restart,
            fault_repair_s=args.fault_repair,
            fault_budget=args.fault_budget,
            fault_seed=args.fault_seed,
            spare_nodes_per_zone=args.spares,
        )
        try:
            result = simulator.simulate(jobs, nodes, projects, args.policy, options)
        except simulator.TraceJobError as e:
            # read_trace numbers data lines from 2 (after the header), in file order.
            line = next(i for i, j in enumerate(jobs, start=2) if j.job_id == e.job_id)
            raise InputError(f"{args.trace}:{line}: {e}") from e
    except InputError as e:
        print(f"gpufleet simulate: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"gpufleet simulate: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    document = json.dumps(result_json(result))
    if to_stdout:
        sys.stdout.write(document + "\n")
    else:
        try:
            args.out.write_text(document + "\n")
        except OSError as e:
            print(f"gpufleet simulate: cannot write {args.out}: {e.strerror}", file=sys.stderr)
            return EXIT_BAD_INPUT
    print_summary(result, console)
    if not to_stdout:
        console.print(f"Result: {args.out}")
    return 0


def _fault_rate(given: str) -> float:
    """--fault-rate: a number of faults per GPU-hour, or 'llama3'. Raises InputError."""
    from .scheduler.errors import InputError
    from .scheduler.simulator_faults import LLAMA3_FAULTS_PER_GPU_HOUR

    if given.strip().lower() == "llama3":
        return LLAMA3_FAULTS_PER_GPU_HOUR
    try:
        rate = float(given)
    except ValueError:
        rate = math.nan
    if not 0 <= rate < math.inf:
        raise InputError(
            "--fault-rate must be a number of faults per GPU-hour (0 or more) or 'llama3', "
            f"not {given!r}"
        )
    return rate


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def print_summary(result: SimulationResult, console: Console) -> None:
    """The summary as tables: totals, then waits and JCT per project and per priority."""
    from rich.table import Table

    s = result.summary
    totals = Table(title=f"Simulation ({result.policy})", show_header=False)
    totals.add_column("metric")
    totals.add_column("value", justify="right")
    for label, value in (
        ("jobs (started / finished)", f"{s.jobs} ({s.started} / {s.finished})"),
        ("never fit (the fleet or the quotas)", str(s.never_fits)),
        ("never started", str(s.never_started)),
        ("GPUs", str(s.gpus)),
        ("makespan", _duration(s.makespan_s)),
        ("GPU utilisation", _share(s.gpu_utilisation)),
        ("GPUs allocated while work waited", _share(s.allocation_while_waiting)),
        ("  most the quotas permit (ceiling)", _share(s.allocation_ceiling_while_waiting)),
        (
            "  the same, less what lend limits keep idle",
            _share(s.allocation_ceiling_within_lend_limits_while_waiting),
        ),
        (
            "  the same, waiting requests counted whole",
            _share(s.allocation_ceiling_whole_requests_while_waiting),
        ),
        (
            "  both: the quotas' tightest bound",
            _share(s.allocation_ceiling_whole_within_lend_limits_while_waiting),
        ),
        *(
            (f"  idle while waiting: {cause}", _share(share))
            for cause, share in sorted(
                s.idle_while_waiting_by_cause.items(), key=lambda item: -item[1]
            )
        ),
        ("time with work waiting", _duration(s.waiting_s)),
        ("wait p50 / p95 / p99", _waits(s.waits)),
        ("mean JCT", _duration(s.mean_jct_s)),
        ("preemptions (most of one job)", f"{s.preemptions} ({s.max_preemptions_per_job})"),
        ("preemptors (over twice their need)", f"{s.preemptors} ({s.preemptors_over_twice_need})"),
        ("GPUs evicted beyond need", str(s.evicted_beyond_need_gpus)),
        ("preemptions while the gang fitted", str(s.preempted_while_fitting)),
        ("lost GPU-hours", f"{s.lost_gpu_hours:.1f}"),
    ):
        totals.add_row(label, value)
    if result.options.get("fault_rate_per_gpu_hour"):
        for label, value in (
            ("faults (GPU-hours they cost)", f"{s.faults} ({s.fault_lost_gpu_hours:.1f})"),
            ("training ETTR mean (GPU-weighted)", _ettr(s)),
        ):
            totals.add_row(label, value)
    console.print(totals)
    console.print(_waits_table("project", s.waits_by_project, s.mean_jct_by_project))
    console.print(_waits_table("priority", s.waits_by_priority, None))


def _ettr(s: Any) -> str:
    mean, weighted = s.mean_effective_training_ratio, s.gpu_weighted_effective_training_ratio
    return f"{_share(mean)} ({_share(weighted)})"


def _waits(w: Waits) -> str:
    return f"{_duration(w.p50)} / {_duration(w.p95)} / {_duration(w.p99)}"


def _waits_table(
    by: str, waits: Mapping[str, Waits], jct: Mapping[str, float | None] | None
) -> Any:
    from rich.table import Table

    table = Table(title=f"Waits by {by}")
    table.add_column(by)
    table.add_column("started", justify="right")
    for column in ("wait p50", "wait p95", "wait p99"):
        table.add_column(column, justify="right")
    if jct is not None:
        table.add_column("mean JCT", justify="right")
    for name, w in waits.items():
        row = [name, str(w.count), _duration(w.p50), _duration(w.p95), _duration(w.p99)]
        if jct is not None:
            row.append(_duration(jct.get(name)))
        table.add_row(*row)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
