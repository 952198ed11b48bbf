"""``gpufleet queue``, ``gpufleet quota``, ``gpufleet nodes``, ``gpufleet cordon NODE``,
``gpufleet uncordon NODE`` and the job commands of ``job_cli``: the controller's API
(through ``gpufleet.client``) as tables, or as JSON with ``--json``. Where the
controller is and the token come from ``--hub-url``/``--api-url`` and ``--token``, else
from the environment as ``Connection.discover`` says (inside a gpufleet session, nothing
is needed).

Errors are handled here, in one place, and printed as one line naming the command's own
flags, never as a traceback. Exit codes: 0 done; 2 bad input (an argument, the entry
script of ``submit``), nothing says where the controller is, a URL that is not one, or no
token; 3 the controller refused (its message is printed: not allowed, no such node, ...);
4 it did not answer; 5 a job waited for ended without succeeding; 130 interrupted (Ctrl-C;
a job submitted keeps going).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .job_cli import JOB_COMMANDS, add_job_commands
from .output import print_json, tree_order

if TYPE_CHECKING:
    from rich.console import Console

    from .client import ApiError, Client, NotConfigured

EXIT_BAD_INPUT = 2
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
    drain = commands.add_parser(
        "drain",
        parents=[connection],
        help="cordon a node and stop what runs there: jobs restart elsewhere, sessions are "
        "snapshotted and stopped (admins)",
    )
    drain.add_argument("node", help="the node's name, as `gpufleet nodes` shows it")
    drain.add_argument("--reason", default="", help="why, for the events people read")
    drain.add_argument(
        "--at", help="drain later: HH:MM (the next such time, UTC) or an ISO date and time"
    )
    recycle = commands.add_parser(
        "recycle",
        parents=[connection],
        help="drain a node, recycle it once it is empty, then diagnose it; it returns to "
        "service if the diagnostics pass (admins)",
    )
    recycle.add_argument("node", help="the node's name, as `gpufleet nodes` shows it")
    recycle.add_argument("--reason", default="", help="why, for the events people read")
    reset = commands.add_parser(
        "reset-breaker",
        parents=[connection],
        help="let the recovery loop cordon faulty nodes of a cluster again, once the cause "
        "of its many cordons is understood (admins)",
    )
    reset.add_argument("cluster", help="the cluster's name, as `gpufleet nodes` shows it")
    add_job_commands(commands, connection)


def fleet_command(args: argparse.Namespace, console: Console, err: Console) -> int:
    from rich.markup import escape

    from .client import ApiError, Client, GpufleetError, NotConfigured, Unreachable

    def fail(message: str, code: int) -> int:
        err.print(
            f"[red]gpufleet {args.command}:[/] {escape(message)}", highlight=False, soft_wrap=True
        )
        return code

    try:
        with Client(args.api_url, args.token, hub_url=args.hub_url) as client:
            return _COMMANDS[args.command](client, args, console)
    except NotConfigured as e:
        return fail(not_configured(e), EXIT_NOT_CONFIGURED)
    except Unreachable as e:
        return fail(str(e), EXIT_UNREACHABLE)
    except ApiError as e:
        return fail(refusal(e, args.command), EXIT_REFUSED)
    except GpufleetError as e:  # bad input found here: a missing script, a bad --env
        return fail(str(e), EXIT_BAD_INPUT)


# The CLI's words for the SDK's arguments and for the fields of the API's bodies.
FLAGS = {"api_url": "--api-url", "hub_url": "--hub-url", "token": "--token"}
SUBMIT_FIELDS = {
    "project": "--project",
    "gpu_type": "--gpu-type",
    "gpus": "--gpus",
    "gpus_per_pod": "--gpus-per-pod",
    "priority": "--priority",
    "name": "--name",
    "env": "--env",
    "checkpoint_uri": "--checkpoint-uri",
    "python": "--python",
    "script": "SCRIPT",
    "script_name": "SCRIPT's file name",
    "args": "the script's arguments",
}


def not_configured(e: NotConfigured) -> str:
    """The SDK's ``NotConfigured`` in the command's words (its flags, not ``hub_url=``)."""
    if e.missing == "token":
        return (
            "no token: create one on the hub's Token page (/hub/token on the hub) and give "
            "it with --token, or set $GPUFLEET_TOKEN"
        )
    if e.source:
        return (
            f"{FLAGS.get(e.source, e.source)} {e.value!r} is not a URL: give the hub's "
            "address with http:// or https://, e.g. --hub-url https://hub.example.org"
        )
    return (
        "where is the gpufleet controller? Give --hub-url (the hub's public URL, e.g. "
        "https://hub.example.org) or set $GPUFLEET_HUB_URL; inside a gpufleet session it is "
        "found by itself"
    )


def refusal(e: ApiError, command: str) -> str:
    """The controller's refusal, its field names turned into the command's flags."""
    said = f"the controller refused ({e.status} {e.code}): {e.message}"
    problems = e.details if isinstance(e.details, list) else []
    fields = SUBMIT_FIELDS if command == "submit" else {}
    if fields and problems and all(isinstance(p, dict) and "field" in p for p in problems):
        said = f"the controller refused ({e.status} {e.code}): " + "; ".join(
            f"{_flag(str(p['field']), fields)}: {p.get('problem', '')}" for p in problems
        )
    if e.status == 401:
        said += (
            " (the token was not accepted: create one on the hub's Token page and give it "
            "with --token, or set $GPUFLEET_TOKEN)"
        )
    return said


def _flag(field: str, fields: dict[str, str]) -> str:
    head, _, rest = field.partition(".")
    flag = fields.get(head)
    if flag is None:
        return field or "the request"
    return f"{flag} ({rest})" if rest else flag


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
            ", ".join(
                [n.health]
                + ([n.maintenance] if n.maintenance else [])
                + ([f"{len(n.leftover_gpus)} held for a lost pod"] if n.leftover_gpus else [])
            ),
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


def _drain(client: Client, args: argparse.Namespace, console: Console) -> int:
    if args.at:
        job = client.drain_at(args.node, args.at, args.reason)
        if args.json:
            return print_json([job])
        at = job.at.isoformat(timespec="minutes") if job.at else "?"
        console.print(f"{args.node} will be drained at {at} (timed job {job.id}).")
        return 0
    node = client.drain(args.node, args.reason)
    if args.json:
        return print_json([node])
    console.print(
        f"{node.name} is draining: cordoned, its jobs restart elsewhere and its sessions "
        f"are snapshotted and stop ({node.gpus - node.free_gpus} of {node.gpus} GPUs still "
        f"in use). Undo the cordon: gpufleet uncordon {node.name}"
    )
    return 0


def _reset_breaker(client: Client, args: argparse.Namespace, console: Console) -> int:
    breakers = client.reset_breaker(args.cluster)
    if args.json:
        return print_json(breakers)
    console.print(f"The recovery loop cordons faulty nodes of {args.cluster} again.")
    return 0


def _recycle(client: Client, args: argparse.Namespace, console: Console) -> int:
    node = client.recycle(args.node, args.reason)
    if args.json:
        return print_json([node])
    console.print(
        f"{node.name} is draining; it is recycled once empty ({node.gpus - node.free_gpus} of "
        f"{node.gpus} GPUs still in use), then diagnosed, and returns to service if the "
        f"diagnostics pass. Follow it with: gpufleet nodes"
    )
    return 0


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Console], int]] = {
    "queue": _queue,
    "quota": _quota,
    "nodes": _nodes,
    "cordon": _cordon,
    "uncordon": _cordon,
    "drain": _drain,
    "recycle": _recycle,
    "reset-breaker": _reset_breaker,
    **JOB_COMMANDS,
}
COMMANDS = tuple(_COMMANDS)
