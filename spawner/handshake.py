"""The gpufleet queue handshake every GPU spawner shares (docs/backend-contract.md).

1. ``apply_user_options`` validates the choice with the controller (dry run): bad input
   fails the spawn at once with a 400 and a message that says what to fix.
2. ``start`` (the backend's) opens a request (a lease it renews while it waits), long-polls
   the controller for its placement and shows the queue position and reason through
   ``progress()``. ``start_timeout`` covers the whole wait, so it is set from
   ``queue_timeout``.
3. Once placed, the backend starts the server with exactly its GPUs and the workload
   marker, and reports it running.
4. Cancelling a spawn withdraws the request. Stopping releases the GPUs only once the
   backend says nothing of the workload runs any more (``_nothing_left_running``).

The local process backend (:mod:`.local`) and the Kubernetes backend (:mod:`.kubernetes`)
are this class plus how they run a server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tornado import web
from traitlets import Float, Unicode, default
from traitlets.config import LoggingConfigurable

from ..clusters import workload_processes
from ..snapshotter.runner import SnapshotFailed
from .client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailable,
    RequestRejected,
    WorkloadStatus,
)
from .form import options_from_form, render_form

LONG_POLL_SECONDS = 20
MAX_RETRY_SECONDS = 5.0  # the longest pause between tries while the controller is away
INTERNAL_ERROR_TRIES = 3
T = TypeVar("T")
_background: set[asyncio.Task[None]] = set()  # retries that outlive a stop() call


class InvalidGPURequest(web.HTTPError):
    """A 400 whose text the hub shows as it is, on the form and on the pending page."""

    def __init__(self, message: str):
        super().__init__(400, message)
        self.jupyterhub_message = f"Invalid GPU request: {message}"


class _RejectionsAreNotCrashes(logging.Filter):
    """JupyterHub logs any exception from a spawn hook with its traceback; a request the
    user must correct is not a crash, so its record becomes one informative line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, InvalidGPURequest):
            record.msg = f"{record.getMessage()}: {error.jupyterhub_message}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _quiet_rejections(log: logging.Logger) -> None:
    if not any(isinstance(f, _RejectionsAreNotCrashes) for f in log.filters):
        log.addFilter(_RejectionsAreNotCrashes())


if TYPE_CHECKING:
    from jupyterhub.spawner import Spawner as _SpawnerBase
else:
    # A mixin at run time: JupyterHub refuses a Spawner subclass that does not define
    # start, stop and poll, which only the backends do.
    _SpawnerBase = LoggingConfigurable


class GPUQueueSpawner(_SpawnerBase):
    """A spawner behind the gpufleet queue (put it first among the bases); the backend's
    class says how a server runs."""

    controller_api_url = Unicode(
        help="The controller's API, e.g. http://127.0.0.1:8001/services/gpufleet/api/v1 "
        "(set by gpufleet.hub.setup.configure from the service's URL).",
    ).tag(config=True)

    @default("controller_api_url")
    def _default_controller_api_url(self) -> str:
        return os.environ.get("GPUFLEET_CONTROLLER_API_URL", "")

    controller_token = Unicode(
        help="The spawner's own token (the gpufleet-spawner service): it may act for any "
        "user's spawn and nothing else.",
    ).tag(config=True)

    @default("controller_token")
    def _default_controller_token(self) -> str:
        return os.environ.get("GPUFLEET_SPAWNER_TOKEN", "")

    queue_timeout = Float(
        12 * 3600.0,
        help="Give up a spawn that has waited this many seconds in the queue. The spawn's "
        "start_timeout is derived from it, so a long queue never times out early.",
    ).tag(config=True)

    lease_renew_interval = Float(
        5.0,
        help="Seconds between lease renewals while waiting; keep it well under the "
        "controller's request_lease_seconds.",
    ).tag(config=True)

    @default("start_timeout")
    def _default_start_timeout(self) -> int:
        return int(self.queue_timeout + 300)

    @default("options_from_form")
    def _default_options_from_form(self) -> Any:
        return options_from_form

    @default("apply_user_options")
    def _default_apply_user_options(self) -> Any:
        return GPUQueueSpawner._check_user_options

    @default("options_form")
    def _default_options_form(self) -> Any:
        return GPUQueueSpawner._render_options_form

    # -------------------------------------------------------------- state
    workload_id: int | None = None
    gpu_uuids: tuple[str, ...] = ()
    node_name: str = ""
    cluster_name: str = ""  # the Kubernetes cluster of the placement; "" on one machine
    marker: str = ""  # every process of the workload inherits it (clusters/workload_processes.py)

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.workload_id = state.get("gpufleet_workload_id")
        self.gpu_uuids = tuple(state.get("gpufleet_gpu_uuids", ()))
        self.node_name = state.get("gpufleet_node", "")
        self.cluster_name = state.get("gpufleet_cluster", "")
        self.marker = state.get("gpufleet_marker", "")

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.workload_id is not None:
            state["gpufleet_workload_id"] = self.workload_id
            state["gpufleet_gpu_uuids"] = list(self.gpu_uuids)
            state["gpufleet_node"] = self.node_name
            state["gpufleet_marker"] = self.marker
            if self.cluster_name:
                state["gpufleet_cluster"] = self.cluster_name
        return state

    def clear_state(self) -> None:
        super().clear_state()
        # The workload is forgotten only by stop(), after its GPUs were released.

    # -------------------------------------------------------------- helpers
    @property
    def controller(self) -> ControllerClient:
        client: ControllerClient | None = getattr(self, "_controller", None)
        if client is None:
            if not self.controller_api_url or not self.controller_token:
                raise web.HTTPError(
                    500,
                    f"{type(self).__name__} is not configured: call "
                    "gpufleet.hub.setup.configure(c)",
                )
            client = self._controller = ControllerClient(
                self.controller_api_url, self.controller_token
            )
        return client

    # -------------------------------------------------------------- form
    @staticmethod
    async def _render_options_form(spawner: GPUQueueSpawner) -> str:
        try:
            options = await spawner.controller.spawn_options(spawner.user.name)
        except ControllerError as e:
            return f'<div class="alert alert-danger">gpufleet is unavailable: {e}</div>'
        return render_form(options, spawner.orm_spawner.user_options or {})

    def _request_body(self, user_options: dict[str, Any]) -> dict[str, Any]:
        return {
            "username": self.user.name,
            "server_name": self.name,
            "project": str(user_options.get("project", "")),
            "gpu_type": str(user_options.get("gpu_type", "")),
            "gpus": user_options.get("gpus", 1),
            "profile": user_options.get("profile") or None,
        }

    async def _fill_defaults(self, user_options: dict[str, Any]) -> dict[str, Any]:
        """An API spawn may send no options: take the user's first project and GPU type."""
        if user_options.get("project") and user_options.get("gpu_type"):
            return user_options
        options = await self.controller.spawn_options(self.user.name)
        if not options["projects"]:
            raise InvalidGPURequest(
                "you are in no gpufleet project yet: ask a gpufleet admin (the group "
                "gpufleet-admins) to add you to one"
            )
        filled = dict(user_options)
        if not filled.get("project") and options["projects"]:
            filled["project"] = options["projects"][0]["name"]
        if not filled.get("gpu_type") and options["gpu_types"]:
            filled["gpu_type"] = next(iter(options["gpu_types"]))
        filled.setdefault("gpus", 1)
        return filled

    @staticmethod
    async def _check_user_options(spawner: GPUQueueSpawner, user_options: dict[str, Any]) -> None:
        _quiet_rejections(spawner.log)
        try:
            filled = await spawner._fill_defaults(user_options or {})
            await spawner.controller.open_session(spawner._request_body(filled), dry_run=True)
        except RequestRejected as e:
            raise InvalidGPURequest(str(e)) from e
        except ControllerUnavailable as e:
            # A controller restart must not fail spawns: start() retries and validates then.
            spawner.log.warning("could not check %s's GPU request now: %s", spawner.user.name, e)
            return
        spawner.user_options = filled

    async def run_options_from_form(self, form_data: dict[str, list[str]]) -> dict[str, Any]:
        """Parse the form and check the choice with the controller before the spawn starts.

        The hub awaits this before it redirects to the pending page, so a rejection always
        comes back on the form, however slow the controller; API spawns are checked by
        ``apply_user_options``.
        """
        options: dict[str, Any] = options_from_form(form_data)
        await GPUQueueSpawner._check_user_options(self, options)
        return options

    # -------------------------------------------------------------- progress
    _progress_events: list[dict[str, Any]]
    _progress_changed: asyncio.Event

    def _progress_log(self) -> list[dict[str, Any]]:
        # Created on first use: the hub may ask for progress before start() runs.
        if not hasattr(self, "_progress_events"):
            self._progress_events = []
            self._progress_changed = asyncio.Event()
        return self._progress_events

    def _report(self, message: str, percent: int) -> None:
        self._progress_log().append({"progress": percent, "message": message})
        changed, self._progress_changed = self._progress_changed, asyncio.Event()
        changed.set()

    async def progress(self) -> Any:
        """Queue position and reason while waiting, then placement; the hub streams these."""
        seen = 0
        while True:
            events = self._progress_log()
            while seen < len(events):
                yield events[seen]
                seen += 1
            await self._progress_changed.wait()

    async def _open_request(self) -> WorkloadStatus:
        """Queue the request; while the controller restarts, keep trying (and say so).

        A workload still in the saved state is the previous start's, whose release never
        reached the controller (it was down when the server stopped). The new request
        settles it: the controller ends it at once if nothing of it runs (and refuses
        the start, saying what runs, if something does).
        """
        if self.workload_id is not None:
            self.log.info(
                "%s: workload %s of the previous start was never released; the new "
                "request asks the controller to end it",
                self._log_name,
                self.workload_id,
            )

        async def open_session() -> WorkloadStatus:
            body = self._request_body(await self._fill_defaults(self.user_options or {}))
            status = await self.controller.open_session({**body, "process_marker": self.marker})
            assert status is not None
            return status

        try:
            return await self._until_answered(open_session, self.queue_timeout)
        except RequestRejected as e:
            raise InvalidGPURequest(str(e)) from e

    async def _until_answered(self, call: Callable[[], Awaitable[T]], seconds: float) -> T:
        """``call()``, retried while the controller is unreachable (a restart takes ~30 s),
        backing off to ``MAX_RETRY_SECONDS``; the spawn page hears of it once per distinct
        error. A controller that answers with an internal error is not retried past
        ``INTERNAL_ERROR_TRIES``: the same request would fail the same way."""
        deadline = time.monotonic() + seconds
        pause, internal, said = 1.0, 0, ""
        while True:
            try:
                return await call()
            except ControllerUnavailable as e:
                internal = internal + 1 if e.status == 500 else 0
                if internal >= INTERNAL_ERROR_TRIES:
                    raise web.HTTPError(500, str(e)) from e
                if time.monotonic() > deadline:
                    raise web.HTTPError(503, str(e)) from e
                if str(e) != said:
                    said = str(e)
                    self._report(f"gpufleet controller unreachable, retrying: {e}", 5)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_SECONDS)

    async def _nothing_left_running(self) -> bool:
        """Whether nothing of the workload runs any more, so its GPUs may go to someone
        else; the backend ends what is left first, and says why when something survives."""
        raise NotImplementedError

    async def _start_when_placed(self, run: Callable[[WorkloadStatus], Awaitable[T]]) -> T:
        """Queue, wait for the placement (renewing the request's lease meanwhile), then
        ``run(status)``: the backend's start, with the GPUs, node and cluster assigned.

        Whatever goes wrong, cancellation included, the start is abandoned: what the
        backend started (``_server_started``) is stopped and the GPUs are released once
        nothing of it runs, never before.
        """
        self._progress_log()
        # Sent with the request, so the controller knows the marker before any process has it.
        self.marker = workload_processes.new_marker()
        status = await self._open_request()
        self.workload_id = status.id
        self._server_started = False
        self._renewer = asyncio.create_task(self._renew_while_waiting(status.id))
        try:
            status = await self._wait_for_placement(status)
            assert status.placement is not None
            self.gpu_uuids = status.placement.gpu_uuids
            self.node_name = status.placement.node
            self.cluster_name = status.placement.cluster
            return await run(status)
        except BaseException as error:  # cancellation included: never leave GPUs behind
            self._stop_renewing()
            await asyncio.shield(self._abandon(self._server_started, error))
            raise
        finally:
            self._stop_renewing()

    _renewer: asyncio.Task[None] | None = None
    _server_started = False  # the backend began to start the server: stop it on failure

    def _stop_renewing(self) -> None:
        """The server is up, or the start is over: the request's lease is not renewed."""
        if self._renewer is not None:
            self._renewer.cancel()

    async def _stop_server(self, now: bool) -> None:
        """Stop what the backend started (the next class's ``stop``, below this mixin)."""
        await super().stop(now=now)

    async def _abandon(self, started: bool, error: BaseException) -> None:
        if started:
            await self._stop_server(now=True)
        if isinstance(error, asyncio.CancelledError):
            # The hub cancelled the spawn (a DELETE while it waits): it gives the spawn
            # one second to end, then stops the server, and answers 500 if the spawn is
            # still pending. So the withdrawal is not waited for (a controller that hangs
            # takes the client's whole timeout to fail).
            await self._release("withdrawn", "", wait=False)
        else:
            await self._release("failed", f"the spawn failed: {error}")

    async def _release(self, outcome: str, message: str, *, wait: bool = True) -> None:
        """Release the GPUs once nothing of the session runs; else keep them allocated.

        ``wait=False`` (a withdrawn spawn): once nothing of it runs the workload is
        forgotten and the release is sent in the background; if the controller does not
        take it, the request's lease lapses by itself.
        """
        workload_id = self.workload_id
        if workload_id is None:
            return
        if not await self._nothing_left_running():
            return

        async def send() -> bool:
            try:
                await self.controller.release(workload_id, outcome, message)
            except RequestRejected as e:
                self.log.warning("releasing workload %s: %s", workload_id, e)
            except ControllerUnavailable as e:
                if wait:
                    # Nothing of it runs. It stays in the saved state; the server's next
                    # start has the controller end it at once (or else the reconciler).
                    self.log.error("could not release workload %s: %s", workload_id, e)
                else:
                    self.log.warning(
                        "could not withdraw the GPU request %s of %s (%s); nothing of it "
                        "runs, and the request's lease lapses by itself (one that had "
                        "reported running is ended by the server's next start or by the "
                        "reconciler)",
                        workload_id,
                        self.user.name,
                        e,
                    )
                return False
            return True

        if not wait:
            self._forget_workload()
            self._progress_log().clear()

            async def in_background() -> None:
                await send()

            task = asyncio.create_task(in_background())
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        if await send():
            self._forget_workload()
            self._progress_log().clear()

    def _forget_workload(self) -> None:
        self.workload_id = None
        self.gpu_uuids = ()
        self.node_name = ""
        self.cluster_name = ""
        self.marker = ""

    # -------------------------------------------------------------- final snapshot
    async def _final_snapshot(self) -> str:
        """The backend's final snapshot pass once nothing of the session runs; what it did
        (for the workload's end event). Raises ``SnapshotFailed``. Every backend overrides
        it (LocalGPUSpawner; KubeGPUSpawner through KubeSnapshotMixin, before this class in
        its bases); only a backend that calls ``_save_then_release`` needs it."""
        raise NotImplementedError

    async def _save_then_release(self) -> None:
        """The final pass, then the release. A pass that fails keeps the GPUs (the session
        is held: nothing unsaved is lost to a waiting workload) and is retried in the
        background every ``final_snapshot_retry_seconds``."""
        try:
            saved = await self._final_snapshot()
        except SnapshotFailed as e:
            self.log.error(
                "the final snapshot of %s failed; its files stay where they are and its "
                "GPUs stay allocated while it is retried: %s",
                self._log_name,
                e,
            )
            held = await self._hold(f"the final snapshot failed: {e}")
            self._retry_final_snapshot(held)
            return
        await self._release("stopped", f"the server stopped; {saved}")

    async def _hold(self, message: str) -> bool:
        """Tell the controller that the session's GPUs stay allocated (its event is what
        tells an admin to act); False when it could not be told."""
        if self.workload_id is None:
            return True
        try:
            await self.controller.hold(self.workload_id, message)
        except ControllerError as e:
            self.log.warning("could not tell the controller: %s", e)
            return False
        return True

    final_snapshot_retry_seconds: float  # the backend's trait

    def _retry_final_snapshot(self, held: bool) -> None:
        """Retries the final pass in the background; a hold the controller did not take
        is sent again with each failure, so that an admin always learns of it."""
        workload_id = self.workload_id

        async def retry() -> None:
            told = held
            while True:
                await asyncio.sleep(self.final_snapshot_retry_seconds)
                if workload_id is None or await self._released_elsewhere(workload_id):
                    return
                try:
                    saved = await self._final_snapshot()
                except SnapshotFailed as e:
                    self.log.warning("final snapshot of %s still failing: %s", self._log_name, e)
                    told = told or await self._hold(f"the final snapshot failed: {e}")
                    continue
                await self._release("stopped", f"the server stopped; {saved}, retried")
                return

        task = asyncio.create_task(retry())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _released_elsewhere(self, workload_id: int) -> bool:
        """Whether an admin released the GPUs of a session whose final snapshot kept failing
        (``POST /workloads/<id>/release``): then retrying stops, and its files stay where
        they are."""
        try:
            status = await self.controller.watch(workload_id, 0, 0)
        except ControllerError as e:
            self.log.warning("could not ask about workload %s: %s", workload_id, e)
            return False
        if status.state != "ended":
            return False
        self.log.warning(
            "workload %s of %s was released (%s); its final snapshot is no longer retried",
            workload_id,
            self._log_name,
            status.reason,
        )
        if self.workload_id == workload_id:
            self._forget_workload()
        return True

    async def _renew_while_waiting(self, workload_id: int) -> None:
        while True:
            await asyncio.sleep(self.lease_renew_interval)
            try:
                await self.controller.renew(workload_id)
            except ControllerUnavailable as e:
                self.log.warning("could not renew the GPU request %s: %s", workload_id, e)

    async def _wait_for_placement(self, status: WorkloadStatus) -> WorkloadStatus:
        deadline = time.monotonic() + self.queue_timeout
        last_message = ""
        while True:
            if status.state == "admitted" and status.placement is not None:
                return status
            if status.state not in ("pending", "admitted"):
                raise web.HTTPError(409, f"the GPU request ended while waiting: {status.reason}")
            message = (
                f"Queued: position {status.queue_position} in project "
                f"{status.raw.get('project', '')}'s {status.gpu_type} queue — {status.reason}"
                if status.queue_position
                else f"Waiting for GPUs: {status.reason}"
            )
            if message != last_message:
                self._report(message, 10)
                last_message = message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise web.HTTPError(
                    503,
                    f"gave up after waiting {int(self.queue_timeout)} s in the GPU queue: "
                    f"{status.reason}",
                )
            try:
                status = await self.controller.watch(
                    status.id, status.version, int(min(LONG_POLL_SECONDS, max(remaining, 1)))
                )
            except ControllerUnavailable as e:
                self._report(f"gpufleet controller unreachable, retrying: {e}", 10)
                await asyncio.sleep(1)
