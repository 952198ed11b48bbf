"""The wire contract: the REST API's request and response models and the event kinds.

Pydantic only, and nothing else of the project (DESIGN.md, "The folders"): the controller,
the node agent, the spawners and the light SDK (``pip install gpufleet``, no server extra)
all read the same models from here.
"""

# The release: the API, the agent and the SDK of one release speak the same contract.
__version__ = "0.1.0"
