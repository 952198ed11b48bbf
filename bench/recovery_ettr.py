"""Effective training time ratio (ETTR) under Llama 3's fault rates, in one run: a
16,384-GPU and a 1,024-GPU job, each on a fleet without and with spare nodes, for
gpufleet's recovery (the controller's classify and next_attempt), torchrun's
restart-on-any-failure and manual restarts (``gpufleet.recovery.faults``). The fixed
costs are the same for every policy and printed under each table. Targets: ETTR >= 95 %
at 16,384 GPUs and >= 98.5 % at 1,024 (with spares).

    .venv/bin/python bench/recovery_ettr.py [--seeds 20] [--days 54] [--spares 2]
"""

from __future__ import annotations

import argparse

from rich.console import Console

from gpufleet.faults_cli import print_ettr, restart_seconds
from gpufleet.recovery.faults import Costs, ettr_table

TARGETS = {16384: 0.95, 1024: 0.985}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--spares", type=int, default=2)
    args = parser.parse_args()
    console = Console()
    for gpus, target in TARGETS.items():
        costs = Costs(restart_s=restart_seconds(gpus))
        for spares in (0, args.spares):
            table = ettr_table(gpus, spares, costs, seeds=args.seeds, days=args.days)
            print_ettr(gpus, spares, costs, table, console)
            ours = table["gpufleet"].ettr
            console.print(
                f"gpufleet / restart-any: {ours / table['restart-any'].ettr:.3f}×, "
                f"gpufleet / manual: {ours / table['manual'].ettr:.3f}×; target "
                f"{target:.1%}: {'met' if ours >= target else 'NOT met'}\n",
                highlight=False,
            )


if __name__ == "__main__":
    main()
