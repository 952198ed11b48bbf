"""The culler loop in the controller: gather each running session's signals, ``decide``,
and carry the decision out — warn, mark idle, clear the mark, or cull.

A cull goes: warning → live snapshot pass while the server runs (the culler's own process
of ``gpufleet snapshot``), started when the warning is given so that it is done by the
time the warning announced → at that time, stop through the hub API (the ``ServerStops``
port the controller gives it, ``culler/ports.py``) → the spawner stops every process,
takes the final incremental pass and only then releases the GPUs (``spawner/local.py``)
→ the scheduler gives them to the waiting workload. If the live pass fails the session is
not stopped (unless its policy says ``stop_without_snapshot``); it is tried again after
``retry_after`` seconds.

The culler reads and writes the database through the store and reads the hub's activity;
it imports nothing of the hub and never imports the scheduler's core: marking a session
idle is a row the scheduler reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..api.events import EventKind
from ..snapshotter import runner as snapshots
from ..snapshotter.listing import SnapshotRecord, index_key
from ..snapshotter.settings import StoreAccess
from ..state.operations import NodeOperationStore
from ..state.sessions import CulledSession, SessionActivityStore
from ..state.snapshots import SnapshotStore
from .policy import Action, Cause, Decision, IdlePolicy, Session, Signals, decide, resolve
from .ports import ServerStops


class CullerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.rounds = Counter(
            "gpufleet_culler_rounds",
            "Rounds of the culler over the running sessions",
            registry=registry,
        )
        self.culls = Counter(
            "gpufleet_culls", "Sessions culled, by reason", ["reason"], registry=registry
        )
        self.cull_failures = Counter(
            "gpufleet_cull_failures",
            "Culls that did not stop the session, by step",
            ["step"],
            registry=registry,
        )
        self.idle_gpu_seconds = Counter(
            "gpufleet_idle_gpu_seconds",
            "GPU-seconds held by sessions idle for longer than the culler's grace period",
            ["project"],
            registry=registry,
        )
        self.reclaimed_gpu_seconds = Counter(
            "gpufleet_reclaimed_gpu_seconds",
            "GPU-seconds of idle sessions' GPUs given back: each culled session's GPUs "
            "times how long it had been idle when culled",
            ["project"],
            registry=registry,
        )
        # Every series exists from the start, so dashboards show 0 rather than no data.
        for cause in (Cause.IDLE, Cause.MAX_AGE):
            self.culls.labels(cause.value)
        for step in ("live-snapshot", "stop"):
            self.cull_failures.labels(step)
        self.snapshot_seconds = Histogram(
            "gpufleet_session_snapshot_seconds",
            "Duration of session snapshot passes",
            ["pass_"],
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )

    def know_projects(self, projects: list[str]) -> None:
        """Start each project's idle and reclaimed GPU-seconds at 0."""
        for project in projects:
            self.idle_gpu_seconds.labels(project)
            self.reclaimed_gpu_seconds.labels(project)


@dataclass
class _LivePass:
    """A live pass started ahead of the stop a warning announced (``due_at``)."""

    due_at: datetime
    task: asyncio.Task[None]


class CullerState(Protocol):
    """The repositories the culler uses (``state.fleet.FleetStore`` holds them all)."""

    sessions: SessionActivityStore
    snapshots: SnapshotStore
    node_operations: NodeOperationStore


class IdleCuller:
    def __init__(
        self,
        store: CullerState,
        policies: Mapping[str, Any],
        *,
        stopper: ServerStops,
        hub_api_url: str,
        hub_api_token: str,
        snapshot_settings: StoreAccess | None,
        registry: CollectorRegistry,
        log: logging.Logger,
        now: Callable[[], datetime],
        interval: float = 30.0,
        retry_after: float = 300.0,
        idle_grace: float = 300.0,
        notify: Callable[[Iterable[int]], None] | None = None,
        node_claim_seconds: float = 30.0,
    ):
        self.store = store
        self.policies = policies
        self.stopper = stopper
        self.hub_api_url = hub_api_url
        self.headers = {"Authorization": f"token {hub_api_token}"}
        self.snapshot_settings = snapshot_settings
        self.metrics = CullerMetrics(registry)
        self.log = log
        self.now = now
        self.interval = interval
        self.retry_after = retry_after
        self.idle_grace = idle_grace
        self.notify = notify  # workloads changed: wakes long polls (the node agents')
        self.node_claim_seconds = node_claim_seconds
        self._policy_cache: dict[tuple[str, str], IdlePolicy] = {}
        self._kicked = asyncio.Event()
        self._culling: dict[int, asyncio.Task[None]] = {}
        self._failed_at: dict[int, float] = {}  # workload -> monotonic time of a failed cull
        # Stops the hub accepted: the spawner's final pass may take a while, and the session
        # is not culled twice meanwhile.
        self._stopping: set[int] = set()
        # Live passes taken during a warning, for the stop at the time it announced; every
        # pass still running is held here too (the event loop keeps only weak references).
        self._live_passes: dict[int, _LivePass] = {}
        self._passes_running: set[asyncio.Task[None]] = set()
        self._last_round: float | None = None
        self._next_check: datetime | None = None

    # ----------------------------------------------------------------- policy
    def policy_for(self, project: str, profile: str = "") -> IdlePolicy:
        key = (project, profile)
        if key not in self._policy_cache:
            self._policy_cache[key] = resolve(self.policies, project, profile)
        return self._policy_cache[key]

    def check_policies(self, projects: list[str]) -> None:
        """Fail at start, naming the bad key, rather than at the first idle session."""
        for project in ["", *projects]:
            self.policy_for(project)
        for profile in self.policies.get("profiles", {}):
            self.policy_for("", profile)

    def kick(self) -> None:
        self._kicked.set()

    # ------------------------------------------------------------------ loop
    async def run(self, is_leader: Callable[[], bool]) -> None:
        while True:
            if is_leader():
                try:
                    await self.run_once()
                except (httpx.HTTPError, OSError) as e:
                    self.log.warning("culler round failed: %s", e)
                except Exception:
                    self.log.exception("culler round failed")
            self._kicked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kicked.wait(), self._until_next_round())

    async def run_once(self) -> list[tuple[int, Decision]]:
        """One round over every running session: what was decided for each."""
        sessions = await asyncio.to_thread(self.store.sessions.culler_sessions)
        # The hub's activity counts only for sessions whose extension never reported.
        unreported = any(s.reported_at is None for s in sessions)
        activity = await self._hub_activity() if unreported else {}
        now = self.now()
        elapsed = self._elapsed()
        decided = []
        self._next_check = None
        running = {s.workload_id for s in sessions}
        self._stopping &= running
        for workload_id in self._live_passes.keys() - running:
            self._live_passes.pop(workload_id)
        for s in sessions:
            policy = self.policy_for(s.project, s.profile)
            signals = Signals(
                hub_activity=activity.get((s.username, s.server_name)),
                kernel_activity=s.kernel_activity,
                terminal_activity=s.terminal_activity,
                user_activity=s.user_activity,
                user_action=s.user_action,
                gpu_activity=s.gpu_activity,
                kernels_busy=s.kernels_busy,
                reported_at=s.reported_at,
                keep_alive_until=s.keep_alive_until,
            )
            view = Session(
                s.workload_id, s.started_at, s.idle_since is not None, s.warned_at, s.warned_stop_at
            )
            decision = decide(view, signals, policy, now)
            decided.append((s.workload_id, decision))
            if decision.recheck_at is not None and (
                self._next_check is None or decision.recheck_at < self._next_check
            ):
                self._next_check = decision.recheck_at
            if decision.last_active and (now - decision.last_active).total_seconds() > (
                self.idle_grace
            ):
                self.metrics.idle_gpu_seconds.labels(s.project).inc(s.gpus * elapsed)
            await self._act(s, decision, policy, now)
        self.metrics.rounds.inc()
        return decided

    def _until_next_round(self) -> float:
        """The interval, or less when a session's decision changes sooner."""
        wait = self.interval
        if self._next_check is not None:
            wait = min(wait, (self._next_check - self.now()).total_seconds() + 0.05)
        return max(wait, 0.1)

    def _elapsed(self) -> float:
        now = time.monotonic()
        elapsed = (
            0.0 if self._last_round is None else min(now - self._last_round, 10 * self.interval)
        )
        self._last_round = now
        return elapsed

    async def _act(
        self, s: CulledSession, decision: Decision, policy: IdlePolicy, now: datetime
    ) -> None:
        action = decision.action
        if decision.pending is Action.CULL and decision.due_at is not None:
            self._start_live_pass(s, decision.due_at)
        if action is Action.KEEP:
            return
        if action is Action.CULL:
            failed = self._failed_at.get(s.workload_id)
            if (
                s.workload_id in self._culling
                or s.workload_id in self._stopping
                or (failed is not None and time.monotonic() - failed < self.retry_after)
            ):
                return
            task = asyncio.create_task(self._cull(s, decision, policy))
            self._culling[s.workload_id] = task

            def done(_task: asyncio.Task[None], workload_id: int = s.workload_id) -> None:
                self._culling.pop(workload_id, None)

            task.add_done_callback(done)
            return
        if (
            action is Action.WARN
            and s.warned_at is not None
            and s.warned_stop_at == (decision.due_at)
        ):
            return  # already shown
        await self._record(s, action.value, decision, now)

    async def _record(
        self, s: CulledSession, action: str, decision: Decision, now: datetime
    ) -> None:
        recorded = await asyncio.to_thread(
            self.store.sessions.record_idle_decision,
            now,
            s.workload_id,
            action,
            decision.reason,
            cause=decision.cause.value,
            last_active=decision.last_active,
            due_at=decision.due_at,
        )
        if recorded:
            self.log.info(
                "session %s of %s: %s — %s", s.workload_id, s.username, action, decision.reason
            )

    # ------------------------------------------------------------------ cull
    def _start_live_pass(self, s: CulledSession, due_at: datetime) -> None:
        """Take the live pass now, while the warning stands, so that the stop comes at the
        time the warning announced rather than a pass's length after it. Once per
        warning; a pass still running is not doubled."""
        sources = snapshots.Sources.from_json(s.snapshot_sources or {})
        if self.snapshot_settings is None or not sources:
            return
        held = self._live_passes.get(s.workload_id)
        if held is not None and (held.due_at == due_at or not held.task.done()):
            return
        task = asyncio.create_task(self._live_pass(s, sources))
        self._passes_running.add(task)
        task.add_done_callback(self._pass_ended)
        self._live_passes[s.workload_id] = _LivePass(due_at, task)

    def _pass_ended(self, task: asyncio.Task[None]) -> None:
        # Its failure is the cull's to report; a pass no cull comes for (the session was
        # used, or ended) is dropped quietly.
        self._passes_running.discard(task)
        if not task.cancelled():
            task.exception()

    async def _live_pass_for(
        self, s: CulledSession, sources: snapshots.Sources, due_at: datetime | None
    ) -> None:
        """The live pass of this cull: the one its warning started (waited for if it still
        runs), else one taken now. Raises SnapshotFailed."""
        held = self._live_passes.pop(s.workload_id, None)
        if held is not None and held.due_at == due_at:
            await held.task
            return
        if held is not None and not held.task.done():
            # An earlier warning's pass: never two passes of one session at once. This
            # cull takes its own after it, whatever came of that one.
            with contextlib.suppress(snapshots.SnapshotFailed):
                await held.task
        await self._live_pass(s, sources)

    async def _cull(self, s: CulledSession, decision: Decision, policy: IdlePolicy) -> None:
        await self._record(s, "cull", decision, self.now())
        sources = snapshots.Sources.from_json(s.snapshot_sources or {})
        if self.snapshot_settings is not None and sources:
            try:
                await self._live_pass_for(s, sources, decision.due_at)
            except snapshots.SnapshotFailed as e:
                self.metrics.cull_failures.labels("live-snapshot").inc()
                if not policy.stop_without_snapshot:
                    self._failed_at[s.workload_id] = time.monotonic()
                    await asyncio.to_thread(
                        self.store.sessions.record_session_event,
                        self.now(),
                        s.workload_id,
                        EventKind.SESSION_CULL_FAILED,
                        f"the live snapshot failed, so the session keeps running (tried "
                        f"again in {int(self.retry_after)} s): {e}",
                    )
                    return
                self.log.warning("session %s: live snapshot failed (%s); stopping anyway", s, e)
        # The hub knows servers by user and name, not by workload: one whose session ended
        # while its live pass ran (the user stopped it) may be starting again, and that
        # new start is not this cull's to stop.
        if not await asyncio.to_thread(self.store.sessions.is_running, s.workload_id):
            self.log.info(
                "session %s of %s ended during its cull; its server is left alone",
                s.workload_id,
                s.username,
            )
            return
        # The reason the user reads was recorded with the cull decision (``session-cull``).
        outcome = await self.stopper.stop(
            s.username,
            s.server_name,
            workload_id=s.workload_id,
            message=decision.reason,
            by="culler",
        )
        if not outcome.stopped:  # logged with the hub's answer
            self.metrics.cull_failures.labels("stop").inc()
            self._failed_at[s.workload_id] = time.monotonic()
            return
        self._stopping.add(s.workload_id)
        self.metrics.culls.labels(decision.cause.value or "idle").inc()
        if decision.last_active is not None:
            idle_for = (self.now() - decision.last_active).total_seconds()
            self.metrics.reclaimed_gpu_seconds.labels(s.project).inc(s.gpus * idle_for)
        self._failed_at.pop(s.workload_id, None)

    async def _live_pass(self, s: CulledSession, sources: snapshots.Sources) -> None:
        assert self.snapshot_settings is not None
        started = time.monotonic()
        if sources.on_node:
            result = await self._live_pass_on_node(s, sources)
            if result.get("skipped"):
                return
        else:
            result = await snapshots.create(
                self.snapshot_settings,
                s.project,
                s.username,
                s.server_name,
                sources,
                tags=["live"],
            )
        seconds = time.monotonic() - started
        self.metrics.snapshot_seconds.labels("live").observe(seconds)
        stats = result.get("stats", {})
        now = self.now()
        await asyncio.to_thread(
            self.store.snapshots.record_snapshot,
            now,
            SnapshotRecord(
                project=s.project,
                username=s.username,
                server_name=s.server_name,
                # As the index's rebuild from the store records it (snapshotter/listing.py), so
                # the rebuild replaces this row rather than listing the snapshot twice.
                store_uri=self._store_uri(),
                manifest_key=index_key(s.project, str(result.get("name", ""))),
                created_at=now,
                size_bytes=int(stats.get("bytes", 0)),
                file_count=int(stats.get("files", 0)),
                workload_id=s.workload_id,
            ),
        )
        await asyncio.to_thread(
            self.store.sessions.record_session_event,
            now,
            s.workload_id,
            EventKind.SESSION_SNAPSHOT,
            f"live snapshot {result.get('id')}: {stats.get('files', 0)} files, "
            f"{int(stats.get('new_bytes', 0)) >> 20} MiB new, in {seconds:.1f} s",
        )

    async def _live_pass_on_node(
        self, s: CulledSession, sources: snapshots.Sources
    ) -> dict[str, Any]:
        """The live pass of a session whose files are on its node (Kubernetes), asked of
        the node agent there (state/operations.py)."""
        request = {
            "paths": list(sources.paths),
            "exclude": list(sources.exclude),
            "container": sources.container,
            "tags": ["live"],
        }

        async def ask() -> dict[str, Any]:
            made = await asyncio.to_thread(
                self.store.node_operations.request_node_operation,
                self.now(),
                s.workload_id,
                "snapshot",
                request,
            )
            if self.notify is not None:
                self.notify([s.workload_id])  # the agents' long polls
            return asdict(made)

        async def status(operation_id: int) -> dict[str, Any]:
            return asdict(
                await asyncio.to_thread(self.store.node_operations.node_operation, operation_id)
            )

        async def abandon(operation_id: int) -> dict[str, Any]:
            await asyncio.to_thread(
                self.store.node_operations.abandon_node_operation,
                self.now(),
                operation_id,
                "no node agent took it in time",
            )
            return await status(operation_id)

        return await snapshots.on_node(
            ask, status, abandon, what="live snapshot", claim_within=self.node_claim_seconds
        )

    def _store_uri(self) -> str:
        """The snapshot store's URI as the store itself names it (``file:///...``)."""
        assert self.snapshot_settings is not None
        if getattr(self, "_opened_store_uri", None) is None:
            self._opened_store_uri = self.snapshot_settings.open_store().uri
        return self._opened_store_uri

    # ------------------------------------------------------------------- hub
    async def _hub_activity(self) -> dict[tuple[str, str], datetime]:
        """Every running server's last activity as the hub knows it (browser, API)."""
        found: dict[tuple[str, str], datetime] = {}
        headers = {**self.headers, "Accept": "application/jupyterhub-pagination+json"}
        offset = 0
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                response = await client.get(
                    f"{self.hub_api_url}/users",
                    params={"state": "active", "offset": offset},
                    headers=headers,
                )
                response.raise_for_status()
                page = response.json()
                for user in page["items"]:
                    for name, server in (user.get("servers") or {}).items():
                        if server.get("last_activity"):
                            found[(user["name"], name)] = datetime.fromisoformat(
                                server["last_activity"].replace("Z", "+00:00")
                            )
                next_page = page.get("_pagination", {}).get("next")
                if not next_page:
                    return found
                offset = next_page["offset"]
