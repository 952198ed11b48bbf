"""What a job submission may ask of a node that only a look at the machine can tell
(``recovery/job_spec.py`` has the rules that need none): checked at submit, so a researcher
hears at once what to change (a 400) rather than from a pod that fails later. On one
machine the controller's is the node, and the ranks' sandbox shows its ``/usr``, ``/etc``
and ``/opt`` as they are here.
"""

from __future__ import annotations

import os
import stat

from ...recovery.job_spec import control
from ...snapshotter.sandbox import DEFAULT_ROOT


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
