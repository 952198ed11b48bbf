"""Which snapshots to keep: a pure decision over (owner, id, time) records.

Per owner (a user's server), a snapshot is kept when it is one of the ``keep_last`` most
recent, or the most recent of one of the last ``keep_daily`` calendar days (UTC, counted
back from ``now``, today included). Everything else is forgotten: its manifest is deleted,
and its data goes at the next garbage collection unless another snapshot still needs it.
The most recent snapshot of an owner is always kept, whatever the policy says, because it
is what the owner's next start restores.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .repository import Repository


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3
    keep_daily: int = 7

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1: the latest snapshot is always kept")
        if self.keep_daily < 0:
            raise ValueError("keep_daily must be 0 or more days")


@dataclass(frozen=True)
class Dated:
    owner: tuple[str, str]  # (user, server)
    id: str
    created_at: float


@dataclass(frozen=True)
class RetentionDecision:
    keep: dict[str, tuple[str, ...]]  # id -> why ("last 3", "daily 2026-11-30")
    forget: tuple[str, ...]


def decide(snapshots: Sequence[Dated], policy: RetentionPolicy, now: float) -> RetentionDecision:
    by_owner: dict[tuple[str, str], list[Dated]] = defaultdict(list)
    for snapshot in snapshots:
        by_owner[snapshot.owner].append(snapshot)
    today = int(now // 86400)
    keep: dict[str, list[str]] = defaultdict(list)
    forget: list[str] = []
    for owned in by_owner.values():
        owned.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        days_seen: set[int] = set()
        for position, snapshot in enumerate(owned):
            if position < policy.keep_last:
                keep[snapshot.id].append(f"last {policy.keep_last}")
            day = int(snapshot.created_at // 86400)
            if today - day < policy.keep_daily and day not in days_seen:
                days_seen.add(day)
                keep[snapshot.id].append(
                    "daily " + time.strftime("%Y-%m-%d", time.gmtime(day * 86400))
                )
            if snapshot.id not in keep:
                forget.append(snapshot.id)
    return RetentionDecision({k: tuple(v) for k, v in keep.items()}, tuple(sorted(forget)))


def apply(
    repository: Repository, policy: RetentionPolicy, now: float, dry_run: bool = False
) -> list[str]:
    """Forget (delete the manifests of) what ``policy`` does not keep in ``repository``;
    the ids forgotten (or that would be, with ``dry_run``). Their data goes at the next
    garbage collection."""
    refs = repository.snapshots()
    dated = [Dated((r.user, r.server), r.id, repository.read_manifest(r).created_at) for r in refs]
    decision = decide(dated, policy, now)
    by_id = {r.id: r for r in refs}
    if not dry_run:
        for snapshot_id in decision.forget:
            repository.delete_manifest(by_id[snapshot_id])
    return list(decision.forget)
