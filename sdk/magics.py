"""Notebook magics: ``%load_ext gpufleet``, then

    %%train --gpus 2 --gpu-type A100-80GB --project vision [--pods 2] [--priority P] [--name N]
    <the entry script: runs on every rank under torchrun, with this kernel's Python>

    %jobs               your jobs
    %logs JOB [-f] [--rank R] [--stderr]
    %cancel JOB

``%%train`` submits the cell and returns at once: a status table under the cell follows
the job (its place in the queue and why, then its ranks, then the result) from a
background thread, so the kernel runs other cells meanwhile. Every failure is a readable
message (``UsageError``), never a traceback. The controller and the token are found as
``gpufleet.client.Connection.discover`` says: inside a gpufleet session, by themselves.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import DisplayHandle, display

from .api.jobs import JobOut
from .client import Client, GpufleetError
from .output import job_state


class JobStatus:
    """What the table under a ``%%train`` cell shows: one job as it stands."""

    def __init__(self, job: JobOut, problem: str = ""):
        self.job = job
        self.problem = problem

    def rows(self) -> list[tuple[str, str]]:
        job = self.job
        rows = [
            ("job", f"{job.id} ({job.name}) · {job.gpus} × {job.gpu_type} in {job.project}"),
            ("state", job_state(job)),
        ]
        if job.state == "pending":
            place = f"#{job.queue_position} " if job.queue_position else ""
            rows.append(("queue", f"{place}{job.reason}"))
        else:
            rows.append(("what happened last", job.reason))
        for pod in job.pod_states:
            ranks = f"ranks {pod.ranks[0]}-{pod.ranks[-1]}" if len(pod.ranks) > 1 else "rank "
            if len(pod.ranks) == 1:
                ranks += str(pod.ranks[0])
            code = f" (exit {pod.exit_code})" if pod.exit_code is not None else ""
            where = f" on {pod.node}" if pod.node else ""
            rows.append((f"pod {pod.pod}", f"{ranks}{where}: {pod.state}{code}"))
        if job.state == "ended":
            rows.append(("logs", f"%logs {job.id} (add --rank R, --stderr)"))
        if self.problem:
            rows.append(("note", self.problem))
        return rows

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
            f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in self.rows()
        )
        return f"<table class='gpufleet-job'>{cells}</table>"

    def __repr__(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.rows())


@magics_class
class FleetMagics(Magics):
    @magic_arguments()
    @argument("--gpus", type=int, required=True, help="GPUs in all")
    @argument("--gpu-type", required=True, help="e.g. A100-80GB")
    @argument("--project", required=True, help="the project whose quota it uses")
    @argument("--pods", type=int, default=None, help="split the GPUs into this many pods")
    @argument("--priority", default=None, help="a priority class")
    @argument("--name", default="", help="the job's name (its checkpoints are kept under it)")
    @cell_magic
    def train(self, line: str, cell: str) -> None:
        """Submit this cell as a training job and follow it below the cell."""
        args = _parse(self.train, line)
        per_pod = None
        if args.pods is not None:
            if args.pods < 1 or args.gpus % args.pods:
                raise UsageError(f"--pods {args.pods} must divide --gpus {args.gpus}")
            per_pod = args.gpus // args.pods
        with _readable_errors():
            client = Client()  # closed by the thread that follows the job
            try:
                job = client.submit(
                    cell,
                    gpus=args.gpus,
                    gpu_type=args.gpu_type,
                    project=args.project,
                    gpus_per_pod=per_pod,
                    priority=args.priority,
                    name=args.name,
                )
            except GpufleetError:
                client.close()
                raise
        handle = display(JobStatus(job), display_id=True)
        assert isinstance(handle, DisplayHandle)
        # A daemon: shutting the kernel down must not wait for the job to end.
        threading.Thread(
            target=_follow,
            args=(client, job, handle.update),
            name=f"gpufleet-job-{job.id}",
            daemon=True,
        ).start()

    @line_magic
    def jobs(self, line: str) -> None:
        """Your jobs, newest first."""
        with _readable_errors(), Client() as client:
            found = client.jobs()
        if not found:
            print("no jobs yet: submit one with %%train")
            return
        for job in found:
            print(
                f"{job.id:>6}  {job.name:<24} {job.gpus:>3} × {job.gpu_type:<12} "
                f"{job_state(job)}: {job.reason}"
            )

    @magic_arguments()
    @argument("job", type=int)
    @argument("-f", "--follow", action="store_true", help="until the job ends")
    @argument("--rank", type=int, default=0)
    @argument("--stderr", action="store_true")
    @line_magic
    def logs(self, line: str) -> None:
        """One rank's output (rank 0's stdout by default)."""
        args = _parse(self.logs, line)
        stream = "stderr" if args.stderr else "stdout"
        with _readable_errors(), Client() as client:
            for piece in client.logs(args.job, args.rank, stream, follow=args.follow):
                print(piece, end="", flush=True)

    @magic_arguments()
    @argument("job", type=int)
    @line_magic
    def cancel(self, line: str) -> None:
        """Stop every rank of a job; its GPUs are released once they are gone."""
        args = _parse(self.cancel, line)
        with _readable_errors(), Client() as client:
            job = client.cancel(args.job)
        print(f"job {job.id}: {job.state} ({job.reason})")


def _parse(magic: Callable[..., Any], line: str) -> Any:
    try:
        return parse_argstring(magic, line)
    except UsageError:
        raise
    except SystemExit as e:  # argparse's way of refusing
        raise UsageError(f"could not read the arguments {line!r}") from e


@contextmanager
def _readable_errors() -> Iterator[None]:
    try:
        yield
    except GpufleetError as e:
        raise UsageError(str(e)) from None


def _follow(client: Client, job: JobOut, show: Callable[[JobStatus], None]) -> None:
    """Update the cell's table at every change of the job until it has ended."""
    try:
        for current in client.watch(job):
            show(JobStatus(current))
    except GpufleetError as e:
        show(JobStatus(job, f"stopped following the job: {e}"))
    finally:
        client.close()


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(FleetMagics)
