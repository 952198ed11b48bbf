"""Stopping a user's server through the hub: the one way the controller does it, for the
culler, for preemption (and drains, and sessions on lost nodes) and for the reconciler.

Its place in DESIGN.md's stop protocol (decide → live snapshot pass → stop → final pass →
processes observed gone → release): the callers decide, and the culler takes the live
pass first; this component asks the hub to stop the server and returns once the hub has
answered. It never waits for the server to be gone and never releases GPUs: the spawner
ends every process carrying the session's marker, takes the final pass and only then
releases, so no GPU is released while anything of the session still runs.

The hub's answers to ``DELETE /users/<name>/servers/<server>`` (``hubapi.stop_server``):
- 202 or 204, the server stops or has stopped; 404, the hub has no such server or user,
  which is what the caller wanted and no error. Either way the caller's event, if it
  names one, is recorded with its message, reason and cause.
- 5xx, or no answer (the hub restarting): asked again, ``attempts`` in all,
  ``retry_delay`` seconds apart and doubling; then reported.
- 400 (a server being renamed, or one the hub cannot stop just now) and the other 4xx:
  reported at once, a 401 or 403 as the controller's missing scope. Asking again at
  once would get the same answer.
A stop not taken is logged with who asked and why, and the caller asks again at its own
pace: the culler after ``cull_retry_seconds``, preemption after
``preemption_retry_seconds`` while the victim is still stopping, the reconciler at its
next pass. ``DELETE`` is idempotent, so asking again never stops a server twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

import httpx

from ..api.events import EventKind
from ..culler.ports import StopOutcome
from ..state.events import EventStore
from .hubapi import stop_server

__all__ = ["ServerStopper", "StopOutcome"]


class StopperState(Protocol):
    """The repository the stopper writes its events to (``state.fleet.FleetStore``'s)."""

    events: EventStore


class ServerStopper:
    """Implements the culler's ``ServerStops`` port, and is what preemption and the
    reconciler call."""

    def __init__(
        self,
        hub_api_url: str,
        hub_api_token: str,
        store: StopperState,
        log: logging.Logger,
        clock: Callable[[], datetime],
        *,
        timeout: float = 30.0,
        attempts: int = 3,
        retry_delay: float = 1.0,
    ):
        """``timeout``: seconds for one answer; the hub answers a stop once its spawner
        stopped or after its ``slow_stop_timeout`` (10 s by default), so this is longer.
        ``attempts``: how many times a 5xx or no answer is asked again, in all."""
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        if timeout <= 0 or retry_delay < 0:
            raise ValueError(
                f"timeout must be positive and retry_delay not negative (got {timeout}, "
                f"{retry_delay})"
            )
        self.hub_api_url = hub_api_url.rstrip("/")
        self.headers = {"Authorization": f"token {hub_api_token}"}
        self.store = store
        self.log = log
        self.clock = clock
        self.timeout = timeout
        self.attempts = attempts
        self.retry_delay = retry_delay

    async def stop(
        self,
        username: str,
        server_name: str,
        *,
        message: str,
        by: str,
        workload_id: int | None = None,
        event: EventKind | None = None,
        reason: str = "",
        data: Mapping[str, Any] | None = None,
    ) -> StopOutcome:
        """Ask the hub to stop ``username``'s ``server_name`` ("" the default server);
        see the module's docstring for what each answer leads to. ``message`` says why,
        in words a user reads; ``by`` who asks (the event's cause); ``event``, when
        given, is recorded once the hub took the stop or had no such server."""
        what = f"{username}'s server {server_name or '(default)'}"
        if workload_id is not None:
            what += f" (workload {workload_id})"
        said = {"user": username, "server": server_name, "workload": workload_id, "by": by}
        if not self.hub_api_url:
            self.log.warning(
                "no hub API ($JUPYTERHUB_API_URL): cannot stop %s for the %s: %s",
                what,
                by,
                message,
                extra=said,
            )
            return StopOutcome.UNREACHABLE
        outcome, status, answer = await self._ask(username, server_name)
        if outcome.stopped:
            self.log.info(
                "asked the hub to stop %s for the %s: %s%s",
                what,
                by,
                message,
                " (it had no such server)" if outcome is StopOutcome.GONE else "",
                extra=said,
            )
            if event is not None:
                await asyncio.to_thread(
                    self.store.events.record_event,
                    self.clock(),
                    event,
                    message,
                    workload_id=workload_id,
                    username=username,
                    reason=reason,
                    cause=by,
                    data=dict(data or {}),
                )
        elif status in (401, 403):
            self.log.error(
                "the hub does not let the controller stop %s (%s): the gpufleet-controller "
                "role needs admin:servers (docs/roles-and-scopes.md)",
                what,
                answer,
                extra=said,
            )
        else:
            self.log.warning(
                "the hub did not stop %s for the %s (%s): %s; the %s asks again later",
                what,
                by,
                answer,
                message,
                by,
                extra=said,
            )
        return outcome

    async def _ask(self, username: str, server_name: str) -> tuple[StopOutcome, int | None, str]:
        """The hub's answer after the attempts a 5xx or no answer is given: the outcome,
        the last status (None: no answer) and, when the hub did not take the stop, what
        it said."""
        delay = self.retry_delay
        status: int | None = None
        answer = ""
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            for attempt in range(1, self.attempts + 1):
                try:
                    response = await stop_server(client, self.hub_api_url, username, server_name)
                except httpx.TransportError as e:
                    status = None
                    answer = f"no answer after {attempt} attempt(s): {type(e).__name__} {e}"
                else:
                    status = response.status_code
                    if status == 404:
                        return StopOutcome.GONE, status, ""
                    if status < 400:
                        return StopOutcome.STOPPING, status, ""
                    answer = f"{status} {response.text[:200]}"
                    if status < 500:
                        return StopOutcome.REFUSED, status, answer
                    answer += f" after {attempt} attempt(s)"
                if attempt < self.attempts:
                    await asyncio.sleep(delay)
                    delay *= 2
        outcome = StopOutcome.UNREACHABLE if status is None else StopOutcome.REFUSED
        return outcome, status, answer
