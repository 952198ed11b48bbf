"""The circuit breaker on automated cordons: ``may_cordon(recent, nodes, policy)``.

A fault that takes many nodes at once (a bad driver rolled out, a switch that lies, a
monitoring bug) must not let the recovery loop cordon a whole cluster. So automated node
cordons stop once those made within ``window_s`` would exceed ``share`` of the cluster's
nodes (NVSentinel stops at 50 % in 5 minutes, Karpenter's node repair at 20 %), and stay
stopped — the breaker open — until an admin resets it. A node cordoned by the loop and
uncordoned since no longer counts. Cordons by people are never held back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BreakerPolicy:
    share: float = 0.5  # of a cluster's nodes ...
    window_s: float = 300.0  # ... cordoned by the loop within this long

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1 or self.window_s <= 0:
            raise ValueError(f"the breaker needs 0 < share <= 1 and a window over 0 s, not {self}")


def may_cordon(recent: int, nodes: int, policy: BreakerPolicy) -> bool:
    """Whether one more automated cordon keeps the loop's recent cordons (``recent``, still
    cordoned) within the policy's share of the cluster's ``nodes``."""
    return recent + 1 <= policy.share * nodes
