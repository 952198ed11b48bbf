"""The culler imports only the folders DESIGN.md's table allows it (``api``, ``scheduler``,
``snapshotter``, ``state``) and nothing of the hub: stopping a server is a port it is
given (``culler/ports.py``). Read from the source, lazy imports and those made only for
type checking included, so an import inside a function cannot slip past."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CULLER = ROOT / "culler"
ALLOWED = ("api", "scheduler", "snapshotter", "state")


def project_imports(path: Path, source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a ``gpufleet`` module in ``source``, a module of
    the culler package at ``path``: relative imports resolved against ``gpufleet.culler``."""
    package = ["gpufleet", "culler", *path.relative_to(CULLER).parent.parts]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            # ``from .. import hub``, ``from gpufleet import hub``: the names are modules.
            top = stem == "gpufleet"
            names = [f"{stem}.{alias.name}" for alias in node.names] if top else [stem]
        else:
            continue
        for name in names:
            if name == "gpufleet" or name.startswith("gpufleet."):
                yield node.lineno, name


def forbidden(path: Path, source: str) -> list[str]:
    found = []
    for line, name in project_imports(path, source):
        folder = name.split(".")[1] if "." in name else ""
        if folder not in ("culler", *ALLOWED):
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def test_the_culler_imports_nothing_of_the_hub_nor_beyond_its_row_of_the_table() -> None:
    modules = sorted(CULLER.rglob("*.py"))
    assert CULLER / "loop.py" in modules
    problems = [p for path in modules for p in forbidden(path, path.read_text())]
    assert problems == [], (
        "culler/ may import only gpufleet."
        + ", gpufleet.".join(ALLOWED)
        + " (DESIGN.md, 'The folders'); a server is stopped through the ServerStops port "
        "the controller passes in:\n" + "\n".join(problems)
    )


def test_the_reader_finds_hub_imports_however_they_are_written() -> None:
    loop = CULLER / "loop.py"
    source = """
from ..hub.hubapi import stop_server
from .. import hub
import gpufleet.hub.app
from gpufleet.hub import stopper
from gpufleet import api, hub

def later():
    from ..hub import victims
    from .policy import decide
    from ..snapshotter import runner
"""
    assert forbidden(loop, source) == [
        "culler/loop.py:2 imports gpufleet.hub.hubapi",
        "culler/loop.py:3 imports gpufleet.hub",
        "culler/loop.py:4 imports gpufleet.hub.app",
        "culler/loop.py:5 imports gpufleet.hub",
        "culler/loop.py:6 imports gpufleet.hub",
        "culler/loop.py:9 imports gpufleet.hub",
    ]
