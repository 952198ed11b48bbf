"""Which snapshots to keep: a pure decision over (owner, id, time) records.

Per owner (a user's server), a snapshot is kept when it is one of the ``keep_last`` most
recent, or the most recent of one of the last ``keep_daily`` calendar days (UTC, counted
back from ``now``, today included). Everything else is forgotten: its manifest is deleted,
and its data goes at the next garbage collection unless another snapshot still needs it.
The most recent snapshot of an owner is always kept, whatever the policy says, because it
is what the owner's next start restores.

``retain_and_collect`` applies a policy to every project of a store and collects what
nothing keeps any more; ``retention_pass`` is that, off the event loop, as the
controller's scheduled run (``c.TimedWork.snapshot_retention_schedule``) does it.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import SnapshotNotFound
from .gc import collect_garbage
from .repository import Repository

if TYPE_CHECKING:
    from .store import Store


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


@dataclass(frozen=True)
class RetentionRun:
    forgotten: int  # snapshots the policy did not keep
    deleted_packs: int
    deleted_bytes: int


def retain_and_collect(
    store: Store,
    master: bytes,
    projects: Iterable[str],
    policy: RetentionPolicy,
    margin_s: float,
    now: float,
) -> RetentionRun:
    """Apply the retention policy to every project's repository, then collect the data
    nothing keeps any more (``gpufleet snapshot gc`` for each project). Blocking."""
    forgotten = packs = size = 0
    for project in projects:
        try:
            repository = Repository.open(store, project, master, create=False)
        except SnapshotNotFound:
            continue
        forgotten += len(apply(repository, policy, now))
        report = collect_garbage(repository, margin_s=margin_s, now=now)
        packs += report.deleted_packs
        size += report.deleted_bytes
    return RetentionRun(forgotten, packs, size)


async def retention_pass(
    store: Store,
    master: bytes,
    projects: Iterable[str],
    policy: RetentionPolicy,
    margin_s: float,
    now: float,
) -> str:
    """One retention and collection over every project, in a worker thread; what it did,
    in words (the controller's ``snapshot-retention`` event)."""
    run = await asyncio.to_thread(
        retain_and_collect, store, master, list(projects), policy, margin_s, now
    )
    return (
        f"snapshot retention (keep the last {policy.keep_last}, one a day for "
        f"{policy.keep_daily} days): {run.forgotten} snapshot(s) forgotten, "
        f"{run.deleted_packs} pack(s) of unused data deleted ({run.deleted_bytes} bytes)"
    )
