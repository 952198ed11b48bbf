"""Project membership from JupyterHub groups (docs/roles-and-scopes.md) as a component of
the controller: synced every ``c.MembershipSync.interval`` seconds while the controller
holds the database lease, and on demand before a request that needs it."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from logging import Logger
from typing import Any, Protocol

import httpx
from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float

from ..scheduler.errors import LeaseLost, SchedulerError
from ..state.projects import ProjectStore
from .components import LoopComponent


class MembershipState(Protocol):
    """The repositories this loop uses (the project memberships; ``FleetStore`` holds them all)."""

    projects: ProjectStore


class MembershipController(Protocol):
    """What the sync uses of the controller (``app.FleetController``)."""

    log: Logger
    hub_api_url: str
    hub_api_token: str
    is_leader: bool

    def now(self) -> datetime: ...

    @property
    def store(self) -> MembershipState: ...


class MembershipSync(LoopComponent):
    interval = Float(
        15.0, help="Seconds between syncs of project membership from JupyterHub groups."
    ).tag(config=True)

    def __init__(self, controller: MembershipController, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.controller = controller
        self._synced_at = 0.0
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        while True:
            if self.controller.is_leader:
                try:
                    await self.refresh(max_age=0)
                except (httpx.HTTPError, SQLAlchemyError, SchedulerError):
                    self.log.exception("could not sync project membership from hub groups")
            await asyncio.sleep(self.interval)

    async def refresh(self, max_age: float) -> None:
        """Sync project membership from hub groups unless it was synced within ``max_age``."""
        c = self.controller
        if not c.hub_api_url:
            return
        async with self._lock:
            if time.monotonic() - self._synced_at < max_age:
                return
            groups = await self._fetch_hub_groups()
            try:
                c.store.projects.sync_memberships(c.now(), groups)
            except LeaseLost:
                # A controller that does not hold the lease (yet: one killed a moment ago
                # still does) may not write; the leader syncs, and the request goes on
                # with the memberships recorded (its own write says it is not the leader).
                return
            self._synced_at = time.monotonic()

    async def _fetch_hub_groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        headers = {
            "Authorization": f"token {self.controller.hub_api_token}",
            "Accept": "application/jupyterhub-pagination+json",
        }
        offset = 0
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                response = await client.get(
                    f"{self.controller.hub_api_url}/groups",
                    params={"offset": offset},
                    headers=headers,
                )
                response.raise_for_status()
                page = response.json()
                for group in page["items"]:
                    groups[group["name"]] = list(group.get("users", []))
                next_page = page.get("_pagination", {}).get("next")
                if not next_page:
                    return groups
                offset = next_page["offset"]
