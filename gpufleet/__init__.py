"""gpufleet: share scarce GPUs among researchers through JupyterHub.

The root package holds the light client side (SDK, CLI, notebook magics); the server parts
are the subpackages ``gpufleet.hub``, ``gpufleet.scheduler``, ``gpufleet.spawner`` and others,
installed with the ``server`` extra.
"""

__version__ = "0.1.0"
