"""The idle culler's API: what a session's extension reports, and keep-alives.

``POST /api/v1/sessions/<id>/activity``: the session extension (``culler/session_extension``)
reports its kernels and terminals with the server's own token; the answer carries the
notices the session should show and the keep-alive in force. ``PUT .../keep-alive``: the
user keeps the session from being culled until a time within the project's limit.
The session's own user (any token of theirs, the server's included), the spawner and
admins may call these; anyone else is told there is no such session.
"""

from __future__ import annotations

from datetime import timedelta

from ...api import schemas
from ...state.sessions import ActivityReport, SessionState
from .. import scopes
from ..errors import Unauthenticated
from .base import APIHandler, store_errors_as_http


class _SessionHandler(APIHandler):
    def caller(self) -> str | None:
        """The user whose session this must be; None for the spawner and admins."""
        if self.identity is None:
            raise Unauthenticated(
                "send a JupyterHub API token as 'Authorization: token <token>', or log in"
            )
        if self.identity.has(scopes.SPAWN):
            return None
        return self.identity.name if self.identity.kind == "user" else "\0no user"

    def answer(self, state: SessionState) -> None:
        policy = self.controller.culler.policy_for(state.project, state.profile)
        self.send(
            {
                "notices": state.notices,
                "keep_alive_until": (
                    state.keep_alive_until.isoformat() if state.keep_alive_until else None
                ),
                "keep_alive_max_s": policy.keep_alive_max_s,
                "notice_poll_s": policy.notice_poll_s,
            }
        )


class SessionActivityHandler(_SessionHandler):
    async def post(self, workload_id: str) -> None:
        username = self.caller()
        body = self.body(schemas.ActivityIn)
        # Aware UTC already: the schema's Instant reads a time without a zone as UTC.
        kernel_times = [k.last_activity for k in body.kernels if k.last_activity]
        terminal_times = [t.last_activity for t in body.terminals if t.last_activity]
        report = ActivityReport(
            kernels=len(body.kernels),
            kernels_busy=any(k.execution_state == "busy" for k in body.kernels),
            kernel_activity=max(kernel_times, default=None),
            terminal_activity=max(terminal_times, default=None),
            user_activity=body.user_activity,
            user_action=body.user_action,
        )
        with store_errors_as_http():
            state = self.controller.store.sessions.record_activity(
                self.controller.now(), self.path_id(workload_id), username, report
            )
        self.answer(state)

    async def get(self, workload_id: str) -> None:
        username = self.caller()
        with store_errors_as_http():
            state = self.controller.store.sessions.session_state(
                self.path_id(workload_id), username
            )
        self.answer(state)


class KeepAliveHandler(_SessionHandler):
    async def put(self, workload_id: str) -> None:
        username = self.caller()
        body = self.body(schemas.KeepAliveIn)
        now = self.controller.now()
        wid = self.path_id(workload_id)
        with store_errors_as_http():
            state = self.controller.store.sessions.session_state(wid, username)
            policy = self.controller.culler.policy_for(state.project, state.profile)
            until = body.until or now + timedelta(hours=body.hours or 0)
            self.controller.store.sessions.set_keep_alive(
                now, wid, username, until, timedelta(seconds=policy.keep_alive_max_s)
            )
            state = self.controller.store.sessions.session_state(wid, username)
        self.controller.culler.kick()
        self.answer(state)


def session_routes(api: str) -> list[tuple[str, type]]:
    return [
        (rf"{api}/sessions/(\d+)/activity", SessionActivityHandler),
        (rf"{api}/sessions/(\d+)/keep-alive", KeepAliveHandler),
    ]
