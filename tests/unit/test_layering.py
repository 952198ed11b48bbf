"""Every folder imports only what DESIGN.md's table ("The folders") allows it, so no two
import each other in a circle. Read from the source with ``ast``: imports inside functions
and those made only for type checking count too, so a lazy import cannot slip past.

The root package (``sdk/``) is the light install: at module level it imports ``api``
alone; a command that needs server parts imports them inside the command (and says which
extra to install), and those imports are its only exception."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_PACKAGE = "sdk"  # installed as ``gpufleet`` itself
# What each folder may import of the project (DESIGN.md, "The folders").
ALLOWED: dict[str, frozenset[str]] = {
    "api": frozenset(),
    "scheduler": frozenset(),
    "recovery": frozenset(),
    "snapshotter": frozenset({"api"}),
    "state": frozenset({"api", "scheduler", "recovery"}),
    "clusters": frozenset({"api", "scheduler", "recovery", "snapshotter", "state"}),
    "culler": frozenset({"api", "scheduler", "snapshotter", "state"}),
    "agent": frozenset({"api", "recovery", "snapshotter"}),
    "spawner": frozenset({"api", ROOT_PACKAGE, "clusters", "snapshotter"}),
    "hub": frozenset(
        {"api", "scheduler", "recovery", "snapshotter", "state", "clusters", "culler", "agent"}
        | {"spawner", ROOT_PACKAGE}
    ),
    ROOT_PACKAGE: frozenset({"api"}),
}
# Imports that break the table today, each with what is left to do; the test fails once one
# is no longer needed, so the list only shrinks.
PENDING: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    target: str  # the project folder imported ("" for the root package's own modules)
    lazy: bool  # inside a function, or only for the type checker (never run)


def folder_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _package(path: Path) -> list[str]:
    """The dotted package ``path`` is installed in, as ``gpufleet.*`` names it."""
    parts = list(path.relative_to(ROOT).parent.parts)
    if parts[0] == ROOT_PACKAGE:
        parts = parts[1:]
    return ["gpufleet", *parts]


def _target(module: str) -> str:
    """The folder an imported ``gpufleet...`` module belongs to."""
    parts = [*module.split(".")[1:], ""]
    if parts[0] not in ALLOWED:
        return ROOT_PACKAGE  # gpufleet, gpufleet.client, gpufleet.reporting, ...
    return parts[0]


def imports_of(path: Path, source: str | None = None) -> Iterator[Import]:
    """The project imports of the module at ``path`` (its text: ``source``, else the file)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package = _package(path)
    lazy_lines = {
        child.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _type_checking(node)
        for child in ast.walk(node)
        if isinstance(child, ast.Import | ast.ImportFrom)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            # ``from gpufleet import hub``: the names may be modules.
            names = [f"{stem}.{a.name}" for a in node.names] if stem == "gpufleet" else [stem]
        else:
            continue
        for name in names:
            if name == "gpufleet" or name.startswith("gpufleet."):
                yield Import(path, node.lineno, _target(name), node.lineno in lazy_lines)


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``, whose imports only the type checker makes."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def sources() -> Iterator[Path]:
    for folder in ALLOWED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "node_modules" not in path.parts:
                yield path


def breaches(pending_seen: set[tuple[str, str]] | None = None) -> list[str]:
    found = []
    for path in sources():
        folder = folder_of(path)
        for imported in imports_of(path):
            if imported.target == folder or imported.target in ALLOWED[folder]:
                continue
            if (folder, imported.target) in PENDING:
                if pending_seen is not None:
                    pending_seen.add((folder, imported.target))
                continue
            if folder == ROOT_PACKAGE and imported.lazy:
                continue  # a command's server part, imported when the command runs
            where = f"{path.relative_to(ROOT)}:{imported.line}"
            found.append(f"{where}: {folder} imports {imported.target}")
    return found


def test_every_folder_imports_only_what_the_design_table_allows() -> None:
    pending: set[tuple[str, str]] = set()
    found = breaches(pending)
    assert not found, "\n".join(found)
    assert pending == PENDING.keys(), "no longer needed: take it out of PENDING"


def test_the_table_has_no_circle() -> None:
    left = dict(ALLOWED)
    while left:  # take away the folders that import nothing still left: a circle stays
        bottom = [folder for folder, targets in left.items() if not targets & left.keys()]
        assert bottom, f"these import each other in a circle: {sorted(left)}"
        for folder in bottom:
            del left[folder]


def test_a_forbidden_import_is_found_lazy_or_not() -> None:
    """The reader itself: the culler importing the hub, at module level or inside a
    function, and the root package importing the scheduler at module level, are breaches;
    the root package's command importing it inside a function is lazy."""
    culler, sdk = ROOT / "culler" / "example.py", ROOT / "sdk" / "example.py"
    cases = [
        (culler, "from gpufleet.hub import app\n", "hub", False),
        (culler, "def f():\n    from ..hub import stopper\n", "hub", True),
        (culler, "from gpufleet import hub\n", "hub", False),
        (sdk, "from .scheduler import plan\n", "scheduler", False),
        (sdk, "def run():\n    from .scheduler import plan\n", "scheduler", True),
        (sdk, "if TYPE_CHECKING:\n    from .scheduler import plan\n", "scheduler", True),
        (ROOT / "state" / "x.py", "from ..scheduler.plan import plan\n", "scheduler", False),
    ]
    for path, text, target, lazy in cases:
        (imported,) = list(imports_of(path, text))
        assert (imported.target, imported.lazy) == (target, lazy), text
