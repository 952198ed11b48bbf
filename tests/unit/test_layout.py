"""The checkout's layout: Python run at its root finds the installed ``gpufleet.*``
subpackages, and no two modules of the project import each other (not even lazily, or
only for type checking), so each can be read, tested and replaced on its own."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, Path]:
    """``gpufleet.*`` package -> its folder in the checkout, from pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in folders.items()}


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _imports(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every project module ``module`` imports, wherever the import statement stands."""
    is_package = path.stem == "__init__"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            names = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in known and name != module:
                yield name


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_of_the_project_import_each_other() -> None:
    modules = _modules()
    known = set(modules)
    # A package's __init__ importing its own modules is how packages work, not a circle.
    graph = {
        name: {
            other
            for other in _imports(name, path, known)
            if not (path.stem == "__init__" and other.startswith(name + "."))
        }
        for name, path in modules.items()
    }
    assert len(modules) > 100
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _run_at_root(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_python_at_the_checkouts_root_imports_the_installed_subpackages() -> None:
    done = _run_at_root("-c", "import gpufleet.hub, gpufleet.cli; print(gpufleet.hub.__name__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpufleet.hub"
    script = _run_at_root("-", stdin="import gpufleet.scheduler.plan\nprint('ok')\n")
    assert (script.returncode, script.stdout.strip()) == (0, "ok"), script.stderr


def test_pytest_collects_the_suite_from_the_checkouts_root() -> None:
    done = _run_at_root("-m", "pytest", "--co", "-q", "-p", "no:cacheprovider")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tests collected" in done.stdout.splitlines()[-1]
