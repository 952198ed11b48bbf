"""The culler's eyes inside a researcher's session: a jupyter_server extension.

It reports what the session's kernels and terminals are doing, and what its user last did in
JupyterLab, to the gpufleet controller and keeps the controller's answer (notices such as
"this session will be stopped at 14:02", the keep-alive deadline) for the JupyterLab
extension ``@gpufleet/session-notices`` to show.

- Every ``GPUFLEET_ACTIVITY_INTERVAL`` seconds (default 30) it POSTs an activity report to
  ``{GPUFLEET_CONTROLLER_API_URL}/sessions/{GPUFLEET_WORKLOAD_ID}/activity`` with the
  server's ``JUPYTERHUB_API_TOKEN``; the answer's notices replace the ones it holds.
- A kernel turning busy or idle (or a kernel or terminal appearing or going) is reported
  within about a second, at most one such report a second: a busy kernel is never idle.
  While the controller's notices hold a warning, any sign of use (a kernel's or a
  terminal's activity, the user's) is reported as promptly: it withdraws the warning.
- What its user did is the user's, not the page's: a file saved, created, renamed, copied,
  deleted or uploaded through the contents API (jupyter_server's contents events; reading
  a file or listing a folder is no action), and typing, clicking or scrolling in JupyterLab
  (``POST {base_url}gpufleet/input`` with ``{"seconds_ago": s}``, which the JupyterLab
  extension sends). An open JupyterLab's polling of kernels, sessions, contents, terminals
  and notices is not reported as use: the controller does not count it.
- ``GET {base_url}gpufleet/notices`` serves the latest notices (asking the controller first
  when they are older than the poll period it gave, ``poll_s`` in the answer); ``POST
  {base_url}gpufleet/keep-alive`` with ``{"hours": h}`` or ``{"until": iso}`` asks the
  controller to keep the session (its answer, errors included, is passed through).

Without ``GPUFLEET_CONTROLLER_API_URL`` or ``GPUFLEET_WORKLOAD_ID`` it reports nothing and
serves empty notices. A controller that cannot be reached is retried at the next tick and
logged at warning level at most once a minute; nothing here may stop the server.

Enable it with ``--ServerApp.jpserver_extensions='{"gpufleet.culler.session_extension": true}'``
(docs/session-extension.md).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

MODULE = "gpufleet.culler.session_extension"
DEFAULT_INTERVAL_S = 30.0
# How often kernel states are looked at, and the least time between two reports that a
# state change (not the interval) caused: a kernel flapping between busy and idle costs the
# controller one report a second at most.
WATCH_PERIOD_S = 0.2
PROMPT_GAP_S = 1.0
WARN_EVERY_S = 60.0
REQUEST_TIMEOUT_S = 10.0
NOTICE_LEVELS = ("info", "warning", "error")
# The frontend's poll period until the controller says otherwise, and the shortest it may say.
DEFAULT_NOTICE_POLL_S = 10.0
MIN_NOTICE_POLL_S = 1.0
# What reading the kernel and terminal managers may raise while they change under us.
SNAPSHOT_ERRORS = (KeyError, AttributeError, TypeError, ValueError)
# What a request to the controller may raise: network failures and a malformed URL.
REQUEST_ERRORS = (httpx.HTTPError, httpx.InvalidURL)
CONTENTS_EVENTS = "https://events.jupyter.org/jupyter_server/contents_service/v1"
# The contents actions a person takes; "get" (reading, listing: the file browser's own
# polling) is none.
FILE_ACTIONS = frozenset({"create", "save", "upload", "rename", "copy", "delete"})
# The oldest input a page may report: it sends within its poll period (at most a minute).
MAX_INPUT_AGE_S = 300.0

Json = dict[str, Any]


def iso_z(moment: datetime) -> str:
    """ISO-8601 in UTC with a ``Z``, as the controller's API writes times."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Settings:
    """Where the controller is and who this session is, from the spawner's environment."""

    api_url: str
    workload_id: str
    token: str | None
    interval_s: float

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings | None:
        """None when the session is not run by gpufleet (no controller URL or workload id).

        Raises ValueError for an interval that is not a positive number.
        """
        api_url = environ.get("GPUFLEET_CONTROLLER_API_URL", "").strip().rstrip("/")
        workload_id = environ.get("GPUFLEET_WORKLOAD_ID", "").strip()
        if not api_url or not workload_id:
            return None
        raw = environ.get("GPUFLEET_ACTIVITY_INTERVAL", "").strip()
        try:
            interval = float(raw) if raw else DEFAULT_INTERVAL_S
        except ValueError:
            interval = math.nan
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"GPUFLEET_ACTIVITY_INTERVAL must be a positive number, not {raw!r}")
        return cls(api_url, workload_id, environ.get("JUPYTERHUB_API_TOKEN") or None, interval)

    @property
    def session_url(self) -> str:
        return f"{self.api_url}/sessions/{self.workload_id}"


def activity_report(
    kernels: list[Json],
    terminals: list[Json],
    now: datetime,
    user: tuple[datetime, str] | None = None,
) -> Json:
    """The body of an activity report, from jupyter_server's kernel and terminal models and
    what the user last did (when, and "input" or "file")."""
    return {
        "kernels": [
            {
                "id": str(k["id"]),
                "name": str(k.get("name", "")),
                "execution_state": str(k.get("execution_state") or "unknown"),
                "last_activity": k.get("last_activity") or iso_z(now),
                "connections": int(k.get("connections") or 0),
            }
            for k in kernels
        ],
        "terminals": [
            {"name": str(t["name"]), "last_activity": t.get("last_activity") or iso_z(now)}
            for t in terminals
        ],
        "user_activity": iso_z(user[0]) if user else None,
        "user_action": user[1] if user else "",
        "sent_at": iso_z(now),
    }


def watched_state(report: Json, warned: bool = False) -> tuple[tuple[str, ...], ...]:
    """What, when it changes, is reported at once: each kernel's state, the terminals; and
    while a warning stands, every kernel's, terminal's and the user's latest activity."""
    kernels = tuple(sorted((k["id"], k["execution_state"]) for k in report["kernels"]))
    state = (*kernels, tuple(sorted(t["name"] for t in report["terminals"])))
    if not warned:
        return state
    used = [k["last_activity"] for k in report["kernels"]]
    used += [t["last_activity"] for t in report["terminals"]]
    return (*state, tuple(sorted(used)), (report.get("user_activity") or "",))


def input_moment(body: object, now: datetime) -> datetime:
    """When the page's user last typed, clicked or scrolled: ``{"seconds_ago": s}`` (the
    page's clock may differ from the server's; a span does not).

    Raises ValueError with a message saying what to send.
    """
    ago = body.get("seconds_ago") if isinstance(body, dict) else None
    if isinstance(ago, bool) or not isinstance(ago, int | float):
        raise ValueError('send {"seconds_ago": <seconds since the last input>}')
    if not math.isfinite(ago) or not 0 <= ago <= MAX_INPUT_AGE_S:
        raise ValueError(f"seconds_ago must be from 0 to {MAX_INPUT_AGE_S:g}")
    return now - timedelta(seconds=ago)


def keep_alive_until(body: object, now: datetime) -> datetime:
    """The moment a keep-alive request asks for: ``{"hours": h}`` or ``{"until": iso}``.

    Raises ValueError with a message for the researcher when the request is malformed.
    """
    if not isinstance(body, dict) or ("hours" in body) == ("until" in body):
        raise ValueError('send either {"hours": <number>} or {"until": "<ISO-8601 time>"}')
    if "hours" in body:
        hours = body["hours"]
        if isinstance(hours, bool) or not isinstance(hours, int | float):
            raise ValueError("hours must be a number")
        if not math.isfinite(hours) or hours <= 0 or hours > 24 * 366:
            raise ValueError("hours must be more than 0 and at most a year")
        return now + timedelta(hours=hours)
    until = body["until"]
    try:
        moment = datetime.fromisoformat(until) if isinstance(until, str) else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValueError("until must be an ISO-8601 time with a time zone, e.g. 2025-01-31T18:00Z")
    return moment.astimezone(UTC)


def parse_notices(answer: object) -> list[Json]:
    """The well-formed notices of the controller's answer; anything else is dropped."""
    raw = answer.get("notices") if isinstance(answer, dict) else None
    notices: list[Json] = []
    for notice in raw if isinstance(raw, list) else []:
        if not isinstance(notice, dict):
            continue
        if not isinstance(notice.get("id"), str) or not isinstance(notice.get("message"), str):
            continue
        level = notice.get("level")
        deadline = notice.get("deadline")
        notices.append(
            {
                "id": notice["id"],
                "level": level if level in NOTICE_LEVELS else "info",
                "message": notice["message"],
                "deadline": deadline if isinstance(deadline, str) else None,
            }
        )
    return notices


@dataclass
class SessionNotices:
    """The latest word from the controller, as the frontend gets it."""

    notices: list[Json] = field(default_factory=list)
    keep_alive_until: str | None = None
    keep_alive_max_s: float | None = None
    # How often the frontend should ask, as the controller says (from the project's warning
    # time: a short warning must not fall between two looks).
    poll_s: float = DEFAULT_NOTICE_POLL_S
    # time.monotonic() of the controller's last answer; -inf before the first.
    answered_at: float = -math.inf

    def update(self, answer: object) -> None:
        if not isinstance(answer, dict):
            return
        self.notices = parse_notices(answer)
        self.answered_at = time.monotonic()
        until = answer.get("keep_alive_until")
        self.keep_alive_until = until if isinstance(until, str) else None
        max_s = _number(answer.get("keep_alive_max_s"))
        if max_s is not None:
            self.keep_alive_max_s = max_s
        poll_s = _number(answer.get("notice_poll_s"))
        if poll_s is not None and poll_s > 0:
            self.poll_s = min(max(poll_s, MIN_NOTICE_POLL_S), DEFAULT_NOTICE_POLL_S * 6)

    def warned(self) -> bool:
        """Whether a notice warns of a stop or a mark (use withdraws it)."""
        return any(n["level"] != "info" or n["deadline"] for n in self.notices)

    def stale(self) -> bool:
        """Older than the frontend's own poll period: a browser looking now would be shown
        what the controller said a whole period (or a 30 s report interval) ago."""
        return time.monotonic() - self.answered_at >= self.poll_s

    def as_json(self) -> Json:
        return {
            "notices": self.notices,
            "keep_alive_until": self.keep_alive_until,
            "keep_alive_max_s": self.keep_alive_max_s,
            "poll_s": self.poll_s,
        }


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class ActivityReporter:
    """Sends activity reports from the server's event loop; holds the controller's notices."""

    def __init__(self, serverapp: Any, settings: Settings | None) -> None:
        self.serverapp = serverapp
        self.settings = settings
        self.log = serverapp.log
        self.notices = SessionNotices()
        self._client: httpx.AsyncClient | None = None
        self._wake = asyncio.Event()
        self._refreshing = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_warning = -math.inf
        self._reported: tuple[tuple[str, ...], ...] | None = None  # the last report's state
        self._failing = False
        # What the user last did (when, "input" or "file"); None before anything.
        self.user: tuple[datetime, str] | None = None

    def user_acted(self, at: datetime, action: str) -> None:
        """The user typed, clicked or scrolled ("input"), or changed a file ("file")."""
        if self.user is None or at > self.user[0]:
            self.user = (at, action)

    async def on_contents_event(self, logger: Any, schema_id: str, data: Json) -> None:
        """jupyter_server's contents events: a person saving or changing a file is use."""
        if data.get("action") in FILE_ACTIONS:
            self.user_acted(datetime.now(UTC), "file")

    def start(self) -> None:
        """Start the report and watch loops (call it on the running event loop)."""
        if self.settings is None:
            return
        headers = {"Authorization": f"token {self.settings.token}"} if self.settings.token else {}
        # The controller is always reached directly: a proxy set for the researcher's own
        # downloads (HTTP_PROXY) must not see the server's token.
        # An http:// controller needs no TLS context, whose CA bundle takes a tenth of a
        # second to load while the server starts.
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=REQUEST_TIMEOUT_S,
            trust_env=False,
            verify=self.settings.session_url.startswith("https://"),
        )
        self._tasks = [
            asyncio.ensure_future(self._report_loop(self.settings)),
            asyncio.ensure_future(self._watch_loop()),
        ]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The loops run until the server stops; say so if one ends by a bug."""
        if not task.cancelled() and task.exception() is not None:
            self.log.error(
                "gpufleet: activity reporting stopped: %r",
                task.exception(),
                exc_info=task.exception(),
            )

    async def snapshot(self) -> Json:
        kernels = self.serverapp.kernel_manager.list_kernels()
        if inspect.isawaitable(kernels):  # a gateway's kernel manager answers later
            kernels = await kernels
        manager = self.serverapp.web_app.settings.get("terminal_manager")
        terminals = manager.list() if manager is not None else []
        return activity_report(list(kernels), list(terminals), datetime.now(UTC), self.user)

    async def _watch_loop(self) -> None:
        # Compared with what the last report said (or tried to say), not with this loop's
        # own last look: a kernel that appeared between the report at start-up and this
        # loop's first look was otherwise never reported before the next interval.
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                state = watched_state(await self.snapshot(), self.notices.warned())
            except SNAPSHOT_ERRORS as e:
                self.log.debug("gpufleet: cannot read kernel states: %r", e)
                continue
            if self._reported is not None and state != self._reported:
                self._wake.set()

    async def _report_loop(self, settings: Settings) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            await self.report(settings)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=settings.interval_s)
            except TimeoutError:
                pass
            else:
                await asyncio.sleep(max(0.0, sent + PROMPT_GAP_S - loop.time()))
            self._wake.clear()

    async def report(self, settings: Settings) -> None:
        """Send one report and keep the notices of the answer; never raises for I/O."""
        assert self._client is not None
        url = f"{settings.session_url}/activity"
        try:
            body = await self.snapshot()
        except SNAPSHOT_ERRORS as e:
            self._failed(f"the kernels could not be read: {e!r}")
            return
        # Set whether or not it arrives: a controller that is down is retried at the next
        # change or tick, not every time the watch loop looks.
        self._reported = watched_state(body, self.notices.warned())
        try:
            response = await self._client.post(url, json=body)
        except REQUEST_ERRORS as e:
            self._failed(f"{type(e).__name__}: {e}")
            return
        if response.status_code != 200:
            self._failed(f"it answered {response.status_code}: {response.text[:200]}")
            return
        try:
            answer = response.json()
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            self._failed(f"its answer is not JSON: {e}")
            return
        if self._failing:
            self.log.info("gpufleet: the controller at %s is reachable again", url)
        self._failing = False
        self.notices.update(answer)

    def _failed(self, why: str) -> None:
        self._failing = True
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            self.log.warning(
                "gpufleet: could not report activity to the controller (%s); retrying", why
            )
        else:
            self.log.debug("gpufleet: activity report failed again: %s", why)

    async def refresh_notices(self) -> None:
        """Ask the controller for the notices when the ones held are stale, so an open
        JupyterLab sees a warning within its poll period rather than the report interval.
        Browsers polling together share one request; a failure keeps the old notices."""
        if self.settings is None or self._client is None or not self.notices.stale():
            return
        async with self._refreshing:
            if not self.notices.stale():  # another browser's look just brought them
                return
            url = f"{self.settings.session_url}/activity"
            try:
                response = await self._client.get(url)
                answer = response.json() if response.status_code == 200 else None
            except (*REQUEST_ERRORS, ValueError) as e:
                self.log.debug("gpufleet: could not refresh the notices from %s: %r", url, e)
                return
            self.notices.update(answer)

    async def keep_alive(self, until: datetime) -> tuple[int, Json]:
        """Ask the controller to keep the session until ``until``; (status, body) to return."""
        if self.settings is None or self._client is None:
            return 503, {
                "error": "not_configured",
                "message": "This session is not managed by gpufleet: there is nothing to extend.",
            }
        url = f"{self.settings.session_url}/keep-alive"
        try:
            response = await self._client.put(url, json={"until": iso_z(until)})
        except REQUEST_ERRORS as e:
            self.log.warning("gpufleet: keep-alive request to %s failed: %r", url, e)
            return 502, {
                "error": "controller_unreachable",
                "message": "The gpufleet controller could not be reached; try again shortly.",
            }
        try:
            answer = response.json()
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            answer = None
        if not isinstance(answer, dict):
            return 502, {
                "error": "bad_controller_answer",
                "message": f"The gpufleet controller answered {response.status_code} "
                "without a readable body.",
            }
        if response.status_code == 200:
            until_text = answer.get("keep_alive_until")
            if isinstance(until_text, str):
                self.notices.keep_alive_until = until_text
            self._wake.set()  # a fresh report brings the notices that still hold
        return response.status_code, answer


class _ReporterHandler(APIHandler):
    """A handler of the extension's own routes, on the session's reporter."""

    auth_resource = "gpufleet"

    def initialize(self, reporter: ActivityReporter) -> None:
        self.reporter = reporter

    async def _moment(self, read: Callable[[object, datetime], datetime]) -> datetime | None:
        """The moment the request's JSON names, as ``read`` (given now) reads it; None once
        a 400 saying what was wrong has been sent."""
        try:
            return read(json.loads(self.request.body or b"null"), datetime.now(UTC))
        except ValueError as e:  # JSONDecodeError is one too
            self.set_status(400)
            await self.finish(json.dumps({"error": "bad_request", "message": str(e)}))
            return None


class NoticesHandler(_ReporterHandler):
    """GET: the controller's latest notices for this session."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.set_header("Cache-Control", "no-store")
        await self.reporter.refresh_notices()
        await self.finish(json.dumps(self.reporter.notices.as_json()))


class InputHandler(_ReporterHandler):
    """POST {"seconds_ago": s}: the person using this JupyterLab typed, clicked or scrolled."""

    @web.authenticated
    @authorized
    async def post(self) -> None:
        at = await self._moment(input_moment)
        if at is None:
            return
        self.reporter.user_acted(at, "input")
        self.set_status(204)
        await self.finish()


class KeepAliveHandler(_ReporterHandler):
    """POST {"hours": h} or {"until": iso}: ask the controller to keep this session."""

    @web.authenticated
    @authorized
    async def post(self) -> None:
        until = await self._moment(keep_alive_until)
        if until is None:
            return
        status, answer = await self.reporter.keep_alive(until)
        self.set_status(status)
        await self.finish(json.dumps(answer))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": MODULE}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    try:
        settings = Settings.from_environ(os.environ)
    except ValueError as e:
        serverapp.log.warning("gpufleet: %s; using %s s", e, DEFAULT_INTERVAL_S)
        settings = Settings.from_environ({**os.environ, "GPUFLEET_ACTIVITY_INTERVAL": ""})
    reporter = ActivityReporter(serverapp, settings)
    base_url = serverapp.web_app.settings["base_url"]
    serverapp.web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base_url, "gpufleet/notices"), NoticesHandler, {"reporter": reporter}),
            (url_path_join(base_url, "gpufleet/input"), InputHandler, {"reporter": reporter}),
            (
                url_path_join(base_url, "gpufleet/keep-alive"),
                KeepAliveHandler,
                {"reporter": reporter},
            ),
        ],
    )
    serverapp.web_app.settings["gpufleet_activity_reporter"] = reporter
    event_logger = getattr(serverapp, "event_logger", None)
    if event_logger is not None:
        event_logger.add_listener(schema_id=CONTENTS_EVENTS, listener=reporter.on_contents_event)
    if settings is None:
        serverapp.log.info(
            "gpufleet: GPUFLEET_CONTROLLER_API_URL or GPUFLEET_WORKLOAD_ID is not set; "
            "not reporting activity (this session is not run by gpufleet)"
        )
        return
    serverapp.log.info(
        "gpufleet: reporting activity of workload %s to %s every %s s",
        settings.workload_id,
        settings.api_url,
        settings.interval_s,
    )
    serverapp.io_loop.add_callback(reporter.start)
