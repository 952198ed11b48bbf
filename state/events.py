"""Events written on their own: what happened outside the database that a person should
read (a backend's step, a stop asked of the hub). Each repository writes its own
capability's events inside its transactions (``base._event``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..api.events import EventKind
from .base import Repository, _event
from .models import Workload


class EventStore(Repository):
    def record_event(
        self,
        now: datetime,
        kind: str,
        message: str,
        *,
        workload_id: int | None = None,
        **fields: Any,
    ) -> None:
        """An event of ``kind``, one of EventKind's values (a ValueError names any other,
        before anything is written), about workload ``workload_id`` if given."""
        known = EventKind(kind)
        with self._write(now) as session:
            workload = session.get(Workload, workload_id) if workload_id is not None else None
            _event(session, now, known, message, workload=workload, **fields)
