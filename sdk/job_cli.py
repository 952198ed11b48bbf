"""``gpufleet submit``, ``jobs``, ``logs``, ``trace``, ``cancel`` and, for admins,
``projects``: training jobs and the project tree through the SDK, in the style of
``fleet_cli`` (which runs them, with its connection options, ``--json`` and exit codes).
``submit --wait`` and ``logs -f`` add one: 5, the job ended without succeeding;
interrupted (Ctrl-C) they exit 130 and the job goes on.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .output import job_state, print_json, tree_order

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from .api.schemas import QuotaUsageOut
    from .client import Client

EXIT_JOB_FAILED = 5
EXIT_INTERRUPTED = 130


def add_job_commands(commands: Any, connection: argparse.ArgumentParser) -> None:
    submit = commands.add_parser(
        "submit",
        parents=[connection],
        help="run a script as a training job (torchrun, one rank per GPU)",
        description="Submit SCRIPT as a training job: GPUS in pods of --gpus-per-pod (default: "
        "a whole node's worth), every pod in one zone, each running SCRIPT under torchrun with "
        "this Python. Options go before SCRIPT; what follows it goes to the script.",
    )
    submit.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    submit.add_argument("--gpu-type", required=True, help="e.g. A100-80GB")
    submit.add_argument("--project", required=True, help="the project whose quota it uses")
    submit.add_argument("--gpus-per-pod", type=int, help="GPUs per pod (one node each)")
    submit.add_argument("--priority", help="a priority class (default: the project's)")
    submit.add_argument("--name", default="", help="a name (checkpoints are kept under it)")
    submit.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra variables"
    )
    submit.add_argument("--checkpoint-uri", default="", help="where checkpoints go")
    submit.add_argument("--python", help="the interpreter for the ranks (default: this one)")
    submit.add_argument("--wait", action="store_true", help="wait until it ends; exit 5 unless ok")
    submit.add_argument("script", help="the entry script (a .py file)")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    jobs = commands.add_parser("jobs", parents=[connection], help="your jobs, newest first")
    jobs.add_argument("--user", help="this user's (admins); default: yours, or all for admins")
    jobs.add_argument("--running", action="store_true", help="only those not ended")

    logs = commands.add_parser("logs", parents=[connection], help="a job's output, per rank")
    logs.add_argument("job", type=int)
    logs.add_argument("--rank", type=int, default=0, help="a global rank (default 0)")
    logs.add_argument("--stderr", action="store_true", help="its stderr, not its stdout")
    logs.add_argument("-f", "--follow", action="store_true", help="until the job ends")

    trace = commands.add_parser(
        "trace",
        parents=[connection],
        help="every rank's Python stacks: taken now from a running job, else the last ones",
        description="Print where each rank of JOB is: a running job's stacks are taken now "
        "(py-spy on its nodes; its owner or an admin); an ended job's are the last ones "
        "taken (a hang's, before its gang was stopped). --recorded lists those taken before.",
    )
    trace.add_argument("job", type=int)
    trace.add_argument(
        "--recorded", action="store_true", help="only the traces already taken, newest first"
    )
    trace.add_argument("--full", action="store_true", help="every thread's frames, not just where")

    cancel = commands.add_parser("cancel", parents=[connection], help="stop a job's every rank")
    cancel.add_argument("job", type=int)

    commands.add_parser(
        "projects",
        parents=[connection],
        help="the project tree with quotas, weights and priorities (admins: all of it)",
    )


def _submit(client: Client, args: argparse.Namespace, console: Console) -> int:
    from .client import GpufleetError

    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise GpufleetError(f"--env {item!r}: write NAME=VALUE")
        env[name] = value
    job = client.submit(
        file=args.script,
        args=args.script_args,
        gpus=args.gpus,
        gpu_type=args.gpu_type,
        project=args.project,
        gpus_per_pod=args.gpus_per_pod,
        priority=args.priority,
        name=args.name,
        env=env,
        checkpoint_uri=args.checkpoint_uri,
        python=args.python,
    )
    if args.json and not args.wait:
        return print_json([job])
    if not args.json:
        console.print(
            f"job {job.id} ({job.name}) submitted: {job.gpus} × {job.gpu_type} as {job.pods} "
            f"pod(s) of {job.gpus_per_pod} in project {job.project}; now {job.state}: "
            f"{job.reason}\n"
            f"  see it:    gpufleet jobs\n"
            f"  its output: gpufleet logs {job.id} -f\n"
            f"  stop it:   gpufleet cancel {job.id}\n"
            f"  checkpoints: {job.checkpoint_uri}"
        )
    if not args.wait:
        return 0
    try:
        ended = client.wait(job)
    except KeyboardInterrupt:
        console.print(
            f"stopped waiting; job {job.id} goes on. Follow it: gpufleet logs {job.id} -f; "
            f"stop it: gpufleet cancel {job.id}",
            highlight=False,
        )
        return EXIT_INTERRUPTED
    if args.json:
        print_json([ended])
    else:
        console.print(f"job {ended.id} {ended.outcome}: {ended.reason}")
    return 0 if ended.outcome == "succeeded" else EXIT_JOB_FAILED


def _jobs(client: Client, args: argparse.Namespace, console: Console) -> int:

    states = ["pending", "admitted", "running", "stopping"] if args.running else []
    found = client.jobs(states, args.user)
    if args.json:
        return print_json(found)
    from rich.table import Table

    table = Table("id", "name", "user", "project", "GPUs", "state", "age", "what happened last")
    now = datetime.now(UTC)
    for job in found:
        state = job_state(job)
        if job.state == "pending" and job.queue_position:
            state = f"{state} #{job.queue_position}"
        table.add_row(
            str(job.id),
            job.name,
            job.username,
            job.project,
            f"{job.gpus} × {job.gpu_type}" + (f" ({job.pods} pods)" if job.pods > 1 else ""),
            state,
            _age(now - job.created_at),
            job.reason,
        )
    console.print(table if found else "no jobs: submit one with `gpufleet submit`")
    return 0


def _logs(client: Client, args: argparse.Namespace, console: Console) -> int:
    stream = "stderr" if args.stderr else "stdout"
    for piece in client.logs(args.job, args.rank, stream, follow=args.follow):
        sys.stdout.write(piece)
        sys.stdout.flush()
    if not args.follow:
        return 0
    job = client.job(args.job)
    console.print(f"job {job.id} {job.outcome}: {job.reason}", highlight=False)
    return 0 if job.outcome == "succeeded" else EXIT_JOB_FAILED


def _trace(client: Client, args: argparse.Namespace, console: Console) -> int:
    job = client.job(args.job)
    if job.state == "running" and not args.recorded:
        traces = [client.trace(job)]
    else:
        traces = client.traces(job)
        if not args.recorded:
            traces = traces[:1]
    if args.json:
        return print_json(traces)
    if not traces:
        console.print(f"job {job.id} has no traces: it is {job.state}, and none were taken")
        return 0
    from rich.markup import escape

    for trace in traces:
        console.print(
            f"[bold]trace {trace.id}[/bold] of job {job.id}, attempt {trace.attempt} "
            f"({'the hang' if trace.why == 'hang' else 'asked by ' + escape(trace.asked_by)}, "
            f"{trace.asked_at:%Y-%m-%d %H:%M:%S} UTC)"
        )
        for pod in trace.pods:
            for rank in pod.ranks:
                where = escape(rank.where or "no Python frame")
                said = f"no stacks: {escape(rank.error)}" if rank.error else f"in {where}"
                console.print(f"  rank {rank.rank} (pod {pod.pod} on {pod.node}) {said}")
                if args.full and rank.text:
                    console.print(escape(rank.text.rstrip()), highlight=False)
        if trace.missing_pods:
            console.print(f"  pods that did not answer: {trace.missing_pods}")
    return 0


def _cancel(client: Client, args: argparse.Namespace, console: Console) -> int:

    job = client.cancel(args.job)
    if args.json:
        return print_json([job])
    if job.state == "ended":
        console.print(f"job {job.id} cancelled: {job.reason}")
    else:
        console.print(
            f"job {job.id} is stopping: its ranks got SIGTERM (save a checkpoint and exit); "
            f"its GPUs are released once every rank is gone. Watch: gpufleet jobs"
        )
    return 0


def _projects(client: Client, args: argparse.Namespace, console: Console) -> int:

    projects = client.projects()
    if args.json:
        return print_json(projects)
    from rich.table import Table

    table = Table(
        "project",
        "GPU type",
        "guaranteed",
        "borrow",
        "lend",
        "weight",
        "priority",
        "per-user cap",
        title="projects",
    )
    for label, p in tree_order(projects):
        quotas: list[QuotaUsageOut | None] = [*p.quotas] or [None]
        for i, q in enumerate(quotas):
            first = i == 0
            table.add_row(
                label if first else "",
                q.gpu_type if q else "",
                str(q.guaranteed) if q else "",
                _limit(q.borrow_limit) if q else "",
                _limit(q.lend_limit) if q else "",
                f"{p.fair_share_weight:g}" if first else "",
                p.default_priority if first else "",
                str(p.per_user_gpu_cap or "") if first else "",
            )
    console.print(table if projects else "no projects")
    return 0


def _limit(value: int | None) -> str:
    return "any" if value is None else str(value)


def _age(delta: Any) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


JOB_COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Console], int]] = {
    "submit": _submit,
    "jobs": _jobs,
    "logs": _logs,
    "trace": _trace,
    "cancel": _cancel,
    "projects": _projects,
}
