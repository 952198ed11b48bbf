"""The shape of the tier the session fixtures start: two clusters and their fake GPU nodes."""

from __future__ import annotations

import os

from .nodes import NodeSpec

CLUSTER_A = "cluster-a"
CLUSTER_B = "cluster-b"
# The same GPU type in both clusters, so a test can fill one and land in the other.
TIER_NODES: dict[str, tuple[NodeSpec, ...]] = {
    CLUSTER_A: (NodeSpec("a-gpu-1", "zone-a", gpus=4), NodeSpec("a-gpu-2", "zone-b", gpus=4)),
    CLUSTER_B: (NodeSpec("b-gpu-1", "zone-c", gpus=4),),
}


def in_ci() -> bool:
    """CI sets CI=true: there a missing tier fails the run instead of skipping."""
    return os.environ.get("CI", "").lower() == "true"
