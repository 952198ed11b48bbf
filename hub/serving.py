"""How the controller's web server stops: it stops taking requests and answers those in
flight first, the long polls (node agents', spawners') woken to answer what is, so no
caller sees an error for a controller that merely stops (a restart, an upgrade, Ctrl-C)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tornado import web
from tornado.httpserver import HTTPServer

from ..agent.lifecycle import STOP_GRACE_SECONDS
from .notifier import Notifier

# How long requests in flight get to be answered (within the watchdog's grace, after which
# the process exits whatever runs).
IN_FLIGHT_ANSWER_S = STOP_GRACE_SECONDS * 2 / 3


class CountingApplication(web.Application):
    """A web application that counts the requests it is answering: each is counted when
    routed, and again when it is logged, which Tornado does once it is answered."""

    in_flight = 0

    def find_handler(self, request: Any, **kwargs: Any) -> Any:
        self.in_flight += 1
        return super().find_handler(request, **kwargs)

    def log_request(self, handler: web.RequestHandler) -> None:
        self.in_flight -= 1
        super().log_request(handler)


async def answer_in_flight(
    server: HTTPServer, app: CountingApplication, notifier: Notifier
) -> None:
    """Stop taking requests, wake every long poll, and wait (at most
    ``IN_FLIGHT_ANSWER_S``) for the requests in flight to be answered before closing the
    connections."""
    server.stop()
    notifier.stop()
    deadline = time.monotonic() + IN_FLIGHT_ANSWER_S
    while time.monotonic() < deadline:
        if app.in_flight <= 0:
            break
        await asyncio.sleep(0.02)
    await server.close_all_connections()
