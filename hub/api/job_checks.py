"""What a job submission may ask of a node, checked at submit so a researcher hears at
once what to change (a 400) rather than from a pod that fails later: the rules of
``recovery/job_spec.py``, which the node agent applies again (``agent/job_launch.py``), and
:func:`interpreter_problem`, which looks at the controller's own machine (on one machine
that is the node, and the ranks' sandbox shows its ``/usr``, ``/etc`` and ``/opt`` as they
are here).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence

from ...recovery.job_spec import control, launch_problems
from ...snapshotter.sandbox import DEFAULT_ROOT


def spec_problems(
    *,
    script_name: str,
    env: Mapping[str, str],
    args: Sequence[str],
    python: str,
    cwd: str,
    checkpoint_uri: str,
    checkpoint_places: Iterable[str],
) -> list[str]:
    """Everything wrong with a submission's launch fields (``recovery/job_spec.py``), each
    saying what to change."""
    return launch_problems(
        script_name=script_name,
        env=env,
        args=args,
        python=python,
        cwd=cwd,
        checkpoint_uri=checkpoint_uri,
        checkpoint_places=checkpoint_places,
    )


def interpreter_problem(python: str) -> str | None:
    """Why ``python`` cannot run the ranks, where this machine can tell: it lies in the
    host directories every sandbox shows (``/usr``, ``/etc``, ``/opt``...) and is not an
    executable file there. Nothing else is looked at, so an answer tells a researcher
    nothing of the machine a sandbox would not show them; a path only the job's own
    environment holds is left to the node, whose launcher then exits 126 or 127, a user
    error that is not retried."""
    if not python or control(python) or not python.startswith("/"):
        return None
    top = python.split("/")[1]
    if top not in DEFAULT_ROOT or ".." in python.split("/"):
        return None
    try:
        info = os.stat(python)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o111:
        return (
            f"python {python} is not an executable file: give the interpreter the ranks run "
            "with (sys.executable in your session), or leave it out for the job's environment's"
        )
    return None
