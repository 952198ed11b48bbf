"""``gpufleet queue``, ``gpufleet quota``, ``gpufleet nodes``, ``gpufleet cordon NODE``,
``gpufleet uncordon NODE`` and the job commands of ``job_cli``: the controller's API
(through ``gpufleet.client``) as tables, or as JSON with ``--json``. Where the
controller is and the token come from ``--hub-url``/``--api-url`` and ``--token``, else
from the environment as ``Connection.discover`` says (inside a gpufleet session, nothing
is needed).

Exit codes: 0 done; 2 nothing says where the controller is, or no token; 3 the controller
refused (its message is printed: not allowed, no such node, ...); 4 it did not answer;
5 a job waited for ended without succeeding.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .job_cli import JOB_COMMANDS, add_job_commands
from .output import print_json, tree_order

if TYPE_CHECKING:
    from rich.console import Console

    from .client import Client

EXIT_NOT_CONFIGURED = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4


def add_fleet_commands(commands: Any) -> None:
    connection = argparse.ArgumentParser(add_help=False)
    where = connection.add_argument_group("where the controller is")
    where.add_argument("--hub-url", help="the hub's public URL (default: $GPUFLEET_HUB_URL)")
    where.add_argument("--api-url", help="the controller's API URL, if not under the hub's")
    where.add_argument("--token", help="a hub API token (default: $GPUFLEET_TOKEN)")
    connection.add_argument("--json", action="store_true", help="print JSON, not a table")

    queue = commands.add_parser(
        "queue", parents=[connection], help="waiting workloads, their place and why they wait"
    )
    queue.add_argument("--user", help="only this user's (admins); default: yours, or all")
    commands.add_parser(
        "quota",
        parents=[connection],
        help="your projects' quotas and what they use now (admins: the whole tree)",
    )
    commands.add_parser("nodes", parents=[connection], help="nodes, their health and free GPUs")
    for verb, what in (("cordon", "no new work on"), ("uncordon", "new work again on")):
        command = commands.add_parser(verb, parents=[connection], help=f"{what} a node (admins)")
        command.add_argument("node", help="the node's name, as `gpufleet nodes` shows it")
    add_job_commands(commands, connection)


def fleet_command(args: argparse.Namespace, console: Console, err: Console) -> int:
    from .client import ApiError, Client, NotConfigured, Unreachable

    try:
        with Client(args.api_url, args.token, hub_url=args.hub_url) as client:
            return _COMMANDS[args.command](client, args, console)
    except NotConfigured as e:
        err.print(f"[red]{e}[/]")
        return EXIT_NOT_CONFIGURED
    except Unreachable as e:
        err.print(f"[red]{e}[/]")
        return EXIT_UNREACHABLE
    except ApiError as e:
        err.print(f"[red]the controller refused ({e.status} {e.code}):[/] {e.message}")
        return EXIT_REFUSED


def _queue(client: Client, args: argparse.Namespace, console: Console) -> int:
    waiting = client.queue(args.user)
    if args.json:
        return print_json(waiting)
    from rich.table import Table

    table = Table("id", "user", "project", "GPUs", "place", "why it waits", title="queue")
    for w in waiting:
        table.add_row(
            str(w.id),
            w.username,
            w.project,
            f"{w.gpus} × {w.gpu_type}",
            str(w.queue_position or "-"),
            w.reason,
        )
    console.print(table if waiting else "nothing waits")
    return 0


def _quota(client: Client, args: argparse.Namespace, console: Console) -> int:
    projects = client.projects()
    if args.json:
        return print_json(projects)
    from rich.table import Table

    table = Table(
        "project", "GPU type", "used / guaranteed", "may borrow", "waiting", title="quotas"
    )
    for label, p in tree_order(projects):
        if not p.quotas:
            table.add_row(label, "", "", "", "")
        for i, q in enumerate(p.quotas):
            borrow = "any" if q.borrow_limit is None else str(q.borrow_limit)
            table.add_row(
                label if i == 0 else "",
                q.gpu_type,
                f"{q.used} / {q.guaranteed}",
                borrow,
                str(q.waiting or ""),
            )
    console.print(table if projects else "you are in no project: ask an admin to add you")
    return 0


def _nodes(client: Client, args: argparse.Namespace, console: Console) -> int:
    nodes = client.nodes()
    if args.json:
        return print_json(nodes)
    from rich.table import Table

    table = Table("node", "cluster", "zone", "GPU type", "free / GPUs", "health", "cordoned")
    for n in nodes:
        table.add_row(
            n.name,
            n.cluster,
            n.zone,
            n.gpu_type,
            f"{n.free_gpus} / {n.gpus}",
            n.health,
            "yes" if n.cordoned else "",
        )
    console.print(table)
    return 0


def _cordon(client: Client, args: argparse.Namespace, console: Console) -> int:
    cordoning = args.command == "cordon"
    node = client.cordon(args.node) if cordoning else client.uncordon(args.node)
    if args.json:
        return print_json([node])
    if cordoning:
        console.print(
            f"{node.name} is cordoned: no new work goes there; what runs there keeps running "
            f"({node.gpus - node.free_gpus} of {node.gpus} GPUs in use). "
            f"Undo: gpufleet uncordon {node.name}"
        )
    else:
        console.print(f"{node.name} takes new work again ({node.free_gpus} GPUs free).")
    return 0


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Console], int]] = {
    "queue": _queue,
    "quota": _quota,
    "nodes": _nodes,
    "cordon": _cordon,
    "uncordon": _cordon,
    **JOB_COMMANDS,
}
COMMANDS = tuple(_COMMANDS)
