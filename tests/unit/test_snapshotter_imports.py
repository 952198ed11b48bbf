"""The snapshotter imports nothing of the project but ``api`` (DESIGN.md, "The folders"):
the agent, the culler, the spawners and the controller call it, never the other way round.
Read from the source, lazy imports and those made only for type checking included."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTTER = ROOT / "snapshotter"
ALLOWED = ("snapshotter", "api")


def project_imports(path: Path, source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a ``gpufleet`` module in ``source``, a module of
    the snapshotter at ``path``: relative imports resolved against ``gpufleet.snapshotter``."""
    package = ["gpufleet", "snapshotter", *path.relative_to(SNAPSHOTTER).parent.parts]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            # ``from .. import culler``, ``from gpufleet import hub``: the names are modules.
            top = stem == "gpufleet"
            names = [f"{stem}.{alias.name}" for alias in node.names] if top else [stem]
        else:
            continue
        for name in names:
            if name == "gpufleet" or name.startswith("gpufleet."):
                yield node.lineno, name


def forbidden(path: Path, source: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in project_imports(path, source)
        if name.split(".")[1:2] not in ([folder] for folder in ALLOWED)
    ]


def test_the_snapshotter_imports_only_the_api_of_the_project() -> None:
    modules = sorted(SNAPSHOTTER.rglob("*.py"))
    assert SNAPSHOTTER / "runner.py" in modules
    problems = [p for path in modules for p in forbidden(path, path.read_text())]
    assert problems == [], (
        "snapshotter/ may import only gpufleet.api (DESIGN.md, 'The folders'); what it "
        "needs of a caller (a process finder, a database row) is passed in:\n" + "\n".join(problems)
    )


def test_the_reader_finds_imports_of_other_folders_however_they_are_written() -> None:
    runner = SNAPSHOTTER / "runner.py"
    source = """
from ..culler.errors import CullerError
from .. import recovery
import gpufleet.scheduler.store.snapshots
from gpufleet import api, hub
from ..api.events import EventKind
from .errors import SnapshotError

def later():
    from ..recovery.processes import marked_process_details
    from . import store
"""
    assert forbidden(runner, source) == [
        "snapshotter/runner.py:2 imports gpufleet.culler.errors",
        "snapshotter/runner.py:3 imports gpufleet.recovery",
        "snapshotter/runner.py:4 imports gpufleet.scheduler.store.snapshots",
        "snapshotter/runner.py:5 imports gpufleet.hub",
        "snapshotter/runner.py:10 imports gpufleet.recovery.processes",
    ]
