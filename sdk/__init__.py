"""gpufleet: share scarce GPUs among researchers through JupyterHub.

The root package holds the light client side (SDK, CLI, notebook magics); the server parts
are the subpackages ``gpufleet.hub``, ``gpufleet.scheduler``, ``gpufleet.spawner`` and others,
installed with the ``server`` extra.
"""

from .api import __version__
from .reporting import attempt, checkpoint_saved, checkpoint_started, progress, resume_from

__all__ = [
    "__version__",
    "attempt",
    "checkpoint_saved",
    "checkpoint_started",
    "progress",
    "resume_from",
]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext gpufleet``: the notebook magics (``gpufleet.magics``)."""
    from .magics import load_ipython_extension as load

    load(ipython)
