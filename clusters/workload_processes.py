"""Marking the processes of a workload a spawner starts, and ending them all.

Every process of a session carries ``MARKER_VARIABLE=<marker>`` in its environment: the
local spawner sets it on the server it starts, the Kubernetes spawner leaves it to the pod
(the manifest sets it in the container). ``new_marker`` is a fresh one for each start, sent
with the request so the controller records it before any process carries it.
``end_all(marker)`` SIGTERMs every process group carrying it, then SIGKILLs what remains,
and says whether nothing of it runs any more: only then may the GPUs be released.

The rules themselves live in ``gpufleet.recovery.processes``, which the node agent (job
ranks, the GPU read-back) and the controller's reconciler use too, so "nothing of it runs
any more" is written once; the spawners reach them through here (DESIGN.md's import table).
"""

from __future__ import annotations

from ..recovery.processes import MARKER_VARIABLE, end_all, new_marker

__all__ = ["MARKER_VARIABLE", "end_all", "new_marker"]
