"""What pip builds from the checkout: an install that prints no setuptools warnings, and a
wheel (a regular, non-editable install: the sessions' base environment is one) that holds
every data file the code reads — the pages' templates, the migrations' template, the fake
NVML library's C source, the session's JupyterLab extension."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = CONFIG["tool"]["setuptools"]["package-dir"]
# A Python warning as the interpreter prints it: "<file>:<line>: Category: message".
WARNING = re.compile(r"^\S+:\d+: (\w+): (.*)$", re.MULTILINE)
# setuptools' note that a strict editable install links the files from build/__editable__,
# which scripts/install hides as this does.
EDITABLE_NOTE = "ignore:Editable installation"
# What a checkout holds that is no part of the distribution: caches, build output, and the
# lab extension's sources (its built form ships from share/).
NOT_SHIPPED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "node_modules", "build", "*.egg-info", "labextension"
)


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what a fresh checkout holds, so building writes nothing into this one."""
    tree = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    for folder in {folder.split("/")[0] for folder in PACKAGE_DIRS.values()} | {"share"}:
        shutil.copytree(ROOT / folder, tree / folder, ignore=NOT_SHIPPED)
    return tree


def build(tree: Path, hook: str, out: Path, settings: dict[str, str] | None = None) -> str:
    """Run one PEP 517 hook of setuptools on ``tree``, as pip does; what it printed to
    stderr (where setuptools' warnings go)."""
    out.mkdir()
    code = (
        "import sys, setuptools.build_meta as backend; "
        f"backend.{hook}(sys.argv[1], config_settings={settings!r})"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-W", EDITABLE_NOTE, "-c", code, str(out)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def data_files(tree: Path) -> set[str]:
    """Every file under the packages' folders that is not Python: what the code reads beside
    itself (``Path(__file__).parent / ...``), as its path inside the wheel."""
    found = set()
    for package, folder in PACKAGE_DIRS.items():
        if "/" in folder:
            continue  # a subpackage: its files are found under its top-level folder
        for path in (tree / folder).rglob("*"):
            if path.is_file() and path.suffix != ".py":
                inside = path.relative_to(tree / folder).as_posix()
                found.add("/".join([*package.split("."), inside]))
    return found


def test_the_install_prints_no_setuptools_warnings(source_tree: Path, tmp_path: Path) -> None:
    wheel = build(source_tree, "build_wheel", tmp_path / "wheel")
    editable = build(
        source_tree, "build_editable", tmp_path / "editable", {"editable_mode": "strict"}
    )
    assert WARNING.findall(wheel) == [], wheel
    assert WARNING.findall(editable) == [], editable


def test_the_wheel_holds_every_data_file_the_code_reads(source_tree: Path, tmp_path: Path) -> None:
    build(source_tree, "build_wheel", tmp_path / "out")
    (wheel,) = (tmp_path / "out").glob("gpufleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = data_files(source_tree)
    # Files the code is known to read, so a walk that finds nothing cannot pass.
    assert {
        "gpufleet/hub/templates/page.html",
        "gpufleet/hub/templates/gpufleet-admin.html",
        "gpufleet/state/migrations/script.py.mako",
        "gpufleet/recovery/fake_nvml/fake_nvml.c",
        "gpufleet/py.typed",
    } <= expected
    assert expected - names == set()
    data = f"gpufleet-{CONFIG['project']['version']}.data/data/"
    extension = "share/jupyter/labextensions/@gpufleet/session-notices"
    shipped = {
        path.relative_to(source_tree).as_posix()
        for path in (source_tree / extension).rglob("*")
        if path.is_file()
    }
    assert f"{extension}/package.json" in shipped
    assert {data + name for name in shipped} - names == set()
    # The migrations themselves, which upgrade-db runs from the installed package.
    versions = PACKAGE_DIRS["gpufleet.state.migrations.versions"]
    migrations = {p.name for p in (source_tree / versions).glob("*.py")}
    assert migrations
    prefix = "gpufleet/state/migrations/versions/"
    assert {prefix + name for name in migrations} - names == set()
