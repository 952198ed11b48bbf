"""What a training job may ask of a node, as rules: the controller applies them at submit
(a 400 saying what to change) and the node agent again before it makes anything for a pod
(for whatever reaches a node anyway). Pure.

A job's script name, interpreter, working directory, arguments and environment are the
researcher's choice and reach a command line, a path and an environment the node agent (as
root) builds: each must arrive as asked or not at all. A variable name holding ``=`` would
reach the rank as another variable (``A=B=x`` is ``A`` set to ``B=x``), a NUL cannot pass
through ``execve`` at all, and a script name with a ``/`` would be written elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePosixPath

from .checkpoints import location_problem

# A variable name as POSIX shells and ``env`` take it.
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def control(text: str) -> bool:
    """Whether ``text`` holds a NUL or a control character other than a tab."""
    return any(ord(c) < 32 and c != "\t" for c in text)


def launch_problems(
    *,
    script_name: str,
    env: Mapping[str, str],
    args: Sequence[str],
    python: str,
    cwd: str,
    checkpoint_uri: str,
    checkpoint_places: Iterable[str],
) -> list[str]:
    """Everything wrong with a job's launch fields, each saying what to change; the
    checkpoint location checked against the places its user's checkpoints may lie."""
    problems = []
    if PurePosixPath(script_name).name != script_name or script_name in ("", ".", ".."):
        problems.append(f"script_name {script_name!r} must be a plain file name such as train.py")
    elif control(script_name):
        problems.append("script_name holds a control character")
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
        if path and control(path):
            problems.append(f"{field} holds a control character")
        elif path and not path.startswith("/"):
            problems.append(f"{field} {path!r} must be an absolute path")
    if checkpoint_uri:
        problem = location_problem(checkpoint_uri, checkpoint_places)
        if problem:
            problems.append(problem)
    return problems
