"""A session's own Python environment over the sessions' base environment.

Run inside the session's sandbox, as the researcher, by the base environment's Python::

    <base>/bin/python -m gpufleet.spawner.session_venv <prefix> -- <command> <args...>

It makes ``<prefix>`` a virtualenv of the base environment's interpreter unless it is one
already, and runs ``<command>`` with it: a console script of the base environment
(``jupyterhub-singleuser``) runs under the session's own interpreter, so kernels,
``%pip install`` and ``python -m pip`` in a terminal install into ``<prefix>``, which the
session's snapshots hold, and never into the base, which every session shares (and sees
read-only).

The session's venv sees the base's packages through a ``.pth`` file (as
``--system-site-packages`` would show a system's): its own come first, so a researcher may
install a newer version of anything. ``pip`` and ``pip3`` in ``<prefix>/bin`` are the base's
pip run by the session's interpreter. Jupyter's configuration and data paths get the base's
after the session's own, so JupyterLab and the lab extensions installed in the base load.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import venv
from pathlib import Path

BASE_PTH = "_gpufleet_base.pth"
_PIP_SHIM = """#!{python}
import runpy
import sys

sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def site_packages(prefix: Path) -> Path:
    """Where a virtualenv at ``prefix`` of this interpreter's version keeps its packages."""
    scheme = sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix)})
    return Path(scheme["purelib"])


def ensure(prefix: Path, base_site: Path) -> Path:
    """Make ``prefix`` a virtualenv over ``base_site`` unless it is one; its Python."""
    python = prefix / "bin" / "python"
    pth = site_packages(prefix) / BASE_PTH
    if not python.exists():
        venv.EnvBuilder(symlinks=True, with_pip=False, clear=False).create(prefix)
    if not pth.exists() or pth.read_text().strip() != str(base_site):
        pth.parent.mkdir(parents=True, exist_ok=True)
        pth.write_text(f"{base_site}\n")
    for name in ("pip", "pip3"):
        shim = prefix / "bin" / name
        if not shim.exists():
            shim.write_text(_PIP_SHIM.format(python=python))
            shim.chmod(0o755)
    return python


def command(python: Path, base_bin: Path, argv: list[str]) -> list[str]:
    """``argv`` as the session runs it: a console script of the base environment under
    the session's own interpreter; anything else as it is."""
    if argv and os.sep not in argv[0] and _is_script(base_bin / argv[0]):
        return [str(python), str(base_bin / argv[0]), *argv[1:]]
    return argv


def _is_script(path: Path) -> bool:
    """Whether ``path`` is a Python console script (not the interpreter, not a binary)."""
    try:
        with path.open("rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        raise SystemExit("usage: python -m gpufleet.spawner.session_venv PREFIX -- COMMAND ...")
    prefix = Path(args[0])
    base_site = Path(sysconfig.get_paths()["purelib"])
    python = ensure(prefix, base_site)
    base_bin = Path(sys.executable).parent
    os.environ["VIRTUAL_ENV"] = str(prefix)
    # Jupyter finds its configuration (which server extensions load: JupyterLab's) and its
    # data (lab extensions) under sys.prefix, the session's own: add the base's after it.
    base = Path(sys.prefix)
    for variable, where in (("JUPYTER_CONFIG_PATH", "etc"), ("JUPYTER_PATH", "share")):
        paths = [p for p in os.environ.get(variable, "").split(os.pathsep) if p]
        os.environ[variable] = os.pathsep.join([*paths, str(base / where / "jupyter")])
    search = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    os.environ["PATH"] = os.pathsep.join(
        dict.fromkeys([str(prefix / "bin"), str(base_bin), *search])
    )
    checkpoint = os.environ.get("GPUFLEET_CHECKPOINT_URI", "")
    if checkpoint.startswith("/"):  # a job's local checkpoints: made by its user, here
        try:
            os.makedirs(checkpoint, exist_ok=True)
        except OSError as e:
            print(
                f"gpufleet: cannot make the checkpoint directory {checkpoint}: "
                f"{e.strerror or e}; choose a checkpoint_uri of your own",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
    argv = command(python, base_bin, args[2:])
    # The shell's conventions, which the recovery loop reads as the user's errors (not
    # retried): 127 for a command not found, 126 for one that cannot run.
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(
            f"gpufleet: {argv[0]} is not in this environment ({prefix} over {base_bin.parent}); "
            "a job runs with its session's interpreter, or its environment's own python",
            file=sys.stderr,
        )
        raise SystemExit(127) from None
    except OSError as e:
        print(
            f"gpufleet: {argv[0]} cannot run ({e.strerror or e}): give an interpreter, such "
            "as the session's own python",
            file=sys.stderr,
        )
        raise SystemExit(126) from None


if __name__ == "__main__":
    main(sys.argv[1:])
