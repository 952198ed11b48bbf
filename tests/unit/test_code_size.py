"""The project's size rule: no function of its source over 80 lines and no module over 800
(STYLE.md), so each reads as one responsibility. Migrations and tests are not held to it;
a literal table may be, through ``ALLOWED`` with its reason. Python is measured by its
syntax tree (a function from its ``def`` line to its last line, nested ones on their own
too); the session extension's TypeScript by its modules' lines."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800
# Folders that are not the project's source: environments, build output, tools, tests, and
# migrations (each one a literal record of a schema step, never edited again).
SKIPPED = {
    ".venv",
    "build",
    "dist",
    "node_modules",
    "tests",
    "migrations",
    "__pycache__",
    "share",  # the session extension as built (scripts/build-labextension)
}
TYPESCRIPT = ("culler/labextension/src",)

# (path, qualified function name, or "" for the module) -> why it may be longer. An entry
# that is no longer over the limit must go: it would hide the next one that grows.
ALLOWED: dict[tuple[str, str], str] = {}


def _sources(suffixes: tuple[str, ...]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIPPED and not d.startswith(".") and "egg-info" not in d
        )
        for name in sorted(filenames):
            if name.endswith(suffixes):
                yield Path(dirpath) / name


def _python_sources() -> Iterator[Path]:
    yield from _sources((".py",))
    for script in sorted((ROOT / "scripts").iterdir()):  # the Python ones by their #! line
        with script.open("rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and b"python" in first:
            yield script


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """Each function's qualified name, first line and length, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            yield name, node.lineno, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _oversized() -> dict[tuple[str, str], str]:
    """Everything over the limits, by (path, function or ""), with what it measures."""
    found: dict[tuple[str, str], str] = {}
    for path in _python_sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found[(rel, "")] = f"{rel} has {lines} lines (at most {MAX_MODULE_LINES})"
        for name, first, length in _functions(ast.parse(text, rel)):
            if length > MAX_FUNCTION_LINES:
                found[(rel, name)] = (
                    f"{rel}:{first} {name}() has {length} lines (at most {MAX_FUNCTION_LINES})"
                )
    for folder in TYPESCRIPT:
        for path in sorted((ROOT / folder).rglob("*.ts*")):
            rel = path.relative_to(ROOT).as_posix()
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                found[(rel, "")] = f"{rel} has {lines} lines (at most {MAX_MODULE_LINES})"
    return found


def test_no_function_over_80_lines_and_no_module_over_800() -> None:
    over = _oversized()
    unallowed = [said for key, said in sorted(over.items()) if key not in ALLOWED]
    assert not unallowed, (
        "split these by responsibility, each piece a function (or module) whose name says "
        "what it decides or does; a literal table may instead go in ALLOWED with its "
        "reason:\n" + "\n".join(unallowed)
    )


def test_the_allow_list_names_only_what_is_still_over() -> None:
    stale = sorted(key for key in ALLOWED if key not in _oversized())
    assert not stale, (
        f"no longer over the limits, remove them from ALLOWED in {Path(__file__).name}: {stale}"
    )


def test_the_rule_sees_every_kind_of_function() -> None:
    source = "\n".join(
        [
            "class A:",
            "    def method(self):",
            *["        x = 1"] * 80,
            "    async def coroutine(self):",
            "        def inner():",
            *["            y = 2"] * 79,
            "def short(): pass",
        ]
    )
    assert [(n, length) for n, _, length in _functions(ast.parse(source))] == [
        ("A.method", 81),
        ("A.coroutine", 81),
        ("A.coroutine.inner", 80),
        ("short", 1),
    ]
