"""What a job submission may ask of a node, checked at submit so a researcher hears at
once what to change (a 400) rather than from a pod that fails later; the node agent checks
the same again (``agent/job_launch.py``), for whatever reaches a node anyway.

Pure, but for :func:`interpreter_problem`, which looks at the controller's own machine:
on one machine that is the node, and the ranks' sandbox shows its ``/usr``, ``/etc`` and
``/opt`` as they are here.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence

from ...recovery.checkpoints import location_problem

# A variable name as POSIX shells and ``env`` take it: a name holding ``=`` would reach the
# rank as another variable (``A=B=x`` is ``A`` set to ``B=x``).
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _control(text: str) -> bool:
    return "\0" in text or any(ord(c) < 32 and c not in "\t" for c in text)


def spec_problems(
    *,
    env: Mapping[str, str],
    args: Sequence[str],
    python: str,
    cwd: str,
    checkpoint_uri: str,
    checkpoint_places: Iterable[str],
) -> list[str]:
    """Everything wrong with a submission's launch fields, each saying what to change."""
    problems = []
    for name, value in env.items():
        if not VARIABLE_NAME.fullmatch(name):
            problems.append(
                f"env: {name!r} is not a variable name (letters, digits and _, not starting "
                "with a digit)"
            )
        if "\0" in value:
            problems.append(f"env: the value of {name} holds a NUL character")
    for index, arg in enumerate(args):
        if "\0" in arg:
            problems.append(f"args[{index}] holds a NUL character")
    for field, path in (("python", python), ("cwd", cwd)):
        if path and _control(path):
            problems.append(f"{field} holds a control character")
        elif path and not path.startswith("/"):
            problems.append(f"{field} {path!r} must be an absolute path")
    if checkpoint_uri:
        problem = location_problem(checkpoint_uri, checkpoint_places)
        if problem:
            problems.append(problem)
    return problems


def interpreter_problem(python: str) -> str | None:
    """Why ``python`` cannot run the ranks, where this machine can tell: it is here and not
    an executable file (a path only the job's own environment holds is left to the node,
    whose launcher then exits 126 or 127, a user error that is not retried)."""
    if not python or _control(python) or not python.startswith("/"):
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
