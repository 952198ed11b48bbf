"""``gpufleet simulate-faults``: the effective training time ratio (ETTR) one long job
keeps under injected faults, for gpufleet's recovery and two baselines
(``gpufleet.recovery.faults``; docs/recovery.md, "Fault injection")."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from .recovery.faults import Costs, Outcome, Policy

EXIT_BAD_INPUT = 2


def add_simulate_faults(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate-faults",
        help="one training job under Llama 3's fault rates: ETTR per recovery policy",
        description="Inject faults (Llama 3's classes and rates) into one training job on a "
        "virtual clock and print the effective training time ratio gpufleet's recovery, "
        "torchrun's restart-on-any-failure and manual restarts keep.",
    )
    sim.add_argument("--gpus", type=int, required=True, help="the job's GPUs")
    sim.add_argument("--spares", type=int, default=0, help="spare nodes kept in its zone")
    sim.add_argument(
        "--days", type=_days, default=54.0, help="how long it trains (more than 0, up to 3650)"
    )
    sim.add_argument("--seeds", type=int, default=20, help="runs averaged (default 20)")
    sim.add_argument(
        "--restart",
        type=_restart,
        default=None,
        metavar="SECONDS",
        help="time to restart its processes and load its checkpoint (default: 60 s at "
        "16,384 GPUs and more, 15 s at 1,024 and fewer, in proportion between)",
    )


def _bounded(text: str, least: float, most: float, what: str, above: bool) -> float:
    """A number of ``what`` from ``least`` (excluded where ``above``) up to ``most``: NaN,
    infinity and 1e400 (which reads as infinity) would run the model's clock forever, so
    argparse names the option and exits 2 with this message."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ((value > least if above else value >= least) and value <= most):
        start = f"more than {least:g}" if above else f"from {least:g}"
        raise argparse.ArgumentTypeError(
            f"must be a number of {what} {start} up to {most:g}, not {text!r}"
        )
    return value


def _days(text: str) -> float:
    return _bounded(text, 0, 3650, "days", above=True)


def _restart(text: str) -> float:
    return _bounded(text, 0, 86400, "seconds", above=False)


def restart_seconds(gpus: int) -> float:
    """The issue's fixed costs: 15 s at 1,024 GPUs, 60 s at 16,384, linear between."""
    share = min(1.0, max(0.0, (gpus - 1024) / (16384 - 1024)))
    return 15.0 + 45.0 * share


def simulate_faults_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .recovery.faults import Costs, ettr_table

    if args.gpus < 1 or args.spares < 0 or args.days <= 0 or args.seeds < 1:
        print(
            "gpufleet simulate-faults: --gpus and --seeds must be at least 1, --spares at "
            "least 0 and --days more than 0",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    costs = Costs(
        restart_s=args.restart if args.restart is not None else restart_seconds(args.gpus)
    )
    table = ettr_table(args.gpus, args.spares, costs, seeds=args.seeds, days=args.days)
    print_ettr(args.gpus, args.spares, costs, table, Console())
    return 0


def print_ettr(
    gpus: int, spares: int, costs: Costs, table: Mapping[Policy, Outcome], console: Console
) -> None:
    from rich.table import Table

    shown = Table(
        "policy",
        "ETTR",
        "faults",
        "down h",
        "lost h",
        "checkpoint h",
        "given up",
        title=f"{gpus:,} GPUs, {spares} spare node(s) in its zone",
    )
    for policy, outcome in table.items():
        shown.add_row(
            policy,
            f"{outcome.ettr:.2%}",
            str(outcome.faults),
            f"{outcome.down_s / 3600:.1f}",
            f"{outcome.lost_s / 3600:.1f}",
            f"{outcome.checkpoint_s / 3600:.1f}",
            str(outcome.gave_up),
        )
    console.print(shown)
    console.print(
        f"Fixed costs: {costs.checkpoint_s:.0f} s asynchronous checkpoints at Young's "
        f"interval, {costs.restart_s:.0f} s restart and checkpoint load, "
        f"{costs.node_loss_timeout_s:.0f} s node-loss timeout, NCCL timeout "
        f"{costs.nccl_timeout_s:.0f} s, a person's response {costs.human_median_s / 60:.0f} min "
        f"median (lognormal), repair of a node {costs.repair_s / 60:.0f} min, silent data "
        f"corruption noticed after {costs.silent_detect_s / 60:.0f} min.",
        highlight=False,
    )
