"""``POST /api/v1/users/<name>/account``: the Unix identity a user's processes run as.

The spawner asks before a session starts; it is made on first use (docs/containment.md)
and never changes. Only the spawner's identity and admins may ask: a researcher has no use
for it, and the answer is the same for every start.
"""

from __future__ import annotations

from ...api import schemas
from .. import scopes
from .base import APIHandler, store_errors_as_http


class AccountHandler(APIHandler):
    async def post(self, username: str) -> None:
        self.require(scopes.SPAWN, scopes.ADMIN)
        with store_errors_as_http():
            account = self.controller.store.accounts.account(self.controller.now(), username)
        self.send(
            schemas.AccountOut(
                username=account.username,
                uid=account.uid,
                gid=account.gid,
                mode=account.mode,  # type: ignore[arg-type]  # one of the store's modes
                home=account.home,
            )
        )


def account_routes(api: str) -> list[tuple[str, type]]:
    return [(rf"{api}/users/([^/]+)/account", AccountHandler)]
