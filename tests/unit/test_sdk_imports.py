"""The light SDK (``pip install gpufleet``, no extra) imports no server part: not the
server's dependencies, not the project's server subpackages. The commands that need them
import them when run (tests/integration/test_light_install.py installs it for real)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Import names of the server extra's distributions (pyproject.toml) and the project's
# server subpackages.
SERVER_MODULES = [
    "jupyterhub",
    "jupyterlab",
    "jupyter_server",
    "tornado",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "prometheus_client",
    "yaml",
    "pynvml",
    "pyfastcdc",
    "blake3",
    "zstandard",
    "cryptography",
    "boto3",
    "botocore",
    "kubespawner",
    "kubernetes_asyncio",
    "apscheduler",
]
SERVER_PACKAGES = [
    f"gpufleet.{name}"
    for name in ["hub", "scheduler", "spawner", "culler", "snapshotter", "recovery", "agent"]
]
LIGHT_MODULES = [
    "gpufleet",
    "gpufleet.client",
    "gpufleet.cli",
    "gpufleet.magics",
    "gpufleet.reporting",
]

# Refuses every server import in a fresh interpreter, then imports the light modules and
# runs ``gpufleet --help``.
PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    SERVER_MODULES, SERVER_PACKAGES, LIGHT_MODULES = {names}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            server = name.split(".")[0] in SERVER_MODULES or any(
                name == p or name.startswith(p + ".") for p in SERVER_PACKAGES
            )
            if server:
                raise ImportError(f"server module {{name}} imported", name=name)

    sys.meta_path.insert(0, Refuse())
    for module in LIGHT_MODULES:
        importlib.import_module(module)
    from gpufleet.cli import main
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0, e.code
    """
)


def test_the_sdk_the_cli_and_the_magics_import_no_server_part() -> None:
    code = PROBE.format(names=(SERVER_MODULES, SERVER_PACKAGES, LIGHT_MODULES))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: gpufleet" in done.stdout
