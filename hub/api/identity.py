"""Who is calling the controller: a hub user or a hub service, and what its token may do."""

from __future__ import annotations

from dataclasses import dataclass

from .. import scopes


@dataclass(frozen=True)
class Identity:
    """Who is calling: a hub user or a hub service, with the scopes of its token."""

    kind: str  # "user" or "service"
    name: str
    scopes: frozenset[str]
    by_cookie: bool

    @property
    def is_admin(self) -> bool:
        return scopes.ADMIN in self.scopes

    def has(self, scope: str) -> bool:
        return scope in self.scopes or self.is_admin

    def may_act_for(self, username: str) -> bool:
        """Its own workloads for a user; anyone's for the spawner and admins."""
        if self.has(scopes.SPAWN):
            return True
        return self.kind == "user" and self.name == username and scopes.USE in self.scopes
