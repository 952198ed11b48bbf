"""The ``gpufleet`` command. Researcher and admin commands (submit, jobs, queue, nodes, ...)
come with the SDK; today it reports its version and where the server commands are."""

from __future__ import annotations

import argparse

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpufleet",
        description="gpufleet: share GPUs through JupyterHub. Server side: "
        "`jupyterhub -f jupyterhub_config.py`, `gpufleet-controller upgrade-db`.",
    )
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
