"""What the culler is given rather than imports: a way to stop a user's server.

The culler decides and takes the live snapshot pass; asking the hub to stop the server is
the controller's, through the one component every path shares (``hub/stopper.py``: the
culler, preemption and drains, the reconciler). The controller passes it in, so the
culler imports nothing of the hub (DESIGN.md, "The folders").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol

from ..api.events import EventKind


class StopOutcome(enum.Enum):
    """What came of asking the hub to stop a server."""

    STOPPING = "stopping"  # stopped, or stopping: the spawner ends it and releases
    GONE = "gone"  # the hub has no such server (or user): nothing was left to stop
    REFUSED = "refused"  # the hub answered with an error: the server still runs
    UNREACHABLE = "unreachable"  # no answer from the hub, or no hub API configured

    @property
    def stopped(self) -> bool:
        """Nothing more to ask of the hub: the server stops or does not exist. Otherwise
        the caller asks again at its own pace."""
        return self in (StopOutcome.STOPPING, StopOutcome.GONE)


class ServerStops(Protocol):
    """Stops one user's server through the hub (``hub.stopper.ServerStopper``)."""

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
        """Ask the hub to stop ``username``'s ``server_name`` ("" the default server).

        ``message`` says why, in words a user reads; ``by`` who asks (the event's cause);
        ``event``, when given, is recorded once the hub took the stop or had no such
        server, with ``message``, ``reason`` (a short code), ``data`` and the workload.
        Returns when the hub has answered; never waits for the server to be gone.
        """
        ...
