"""The node agent's side of job progress: ranks report to it on loopback
(``gpufleet.progress``, sdk/reporting.py), it forwards to the controller with its pods' sync.

A rank holds no platform token. It names its pod by its process marker (the
``X-Gpufleet-Marker`` header), and the kernel vouches for it: the connection must come from
a process of that pod, running as the pod's account (``peers.py``), or it is refused (403),
saying why. A checkpoint it reports outside its job's checkpoint location is left out.
Ages in a report become times on the agent's clock when it arrives, so the rank's clock
never counts.

``merge`` is pure: what the agent keeps for one pod between two syncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tornado import web
from tornado.netutil import bind_sockets

from ..recovery.checkpoints import within as checkpoint_within
from .peers import Caller, ReportRefused, caller_of

MARKER_HEADER = "X-Gpufleet-Marker"
MAX_BODY_BYTES = 256 * 1024
MAX_STEP_TIMES = 512
MAX_SAVED = 64

Seconds = Annotated[float, Field(ge=0, le=10 * 365 * 86400)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartedIn(_Strict):
    step: int = Field(ge=0, le=2**53)
    age_s: Seconds


class SavedIn(_Strict):
    uri: str = Field(max_length=2000)
    step: int = Field(ge=0, le=2**53)
    epoch: int | None = Field(default=None, ge=0, le=2**53)
    age_s: Seconds


class RankReport(_Strict):
    """What sdk/reporting.py sends. ``step_age_s`` is the age of the rank's latest
    ``gpufleet.progress`` call, with or without a number; ``step`` and ``epoch`` are the
    numbers it was last given (None: never)."""

    step: int | None = Field(default=None, ge=0, le=2**53)
    epoch: int | None = Field(default=None, ge=0, le=2**53)
    step_age_s: Seconds | None = None
    step_times_s: list[Seconds] = Field(default_factory=list, max_length=MAX_STEP_TIMES)
    metrics: dict[Annotated[str, Field(max_length=64)], float] = Field(
        default_factory=dict, max_length=32
    )
    checkpoint_started: StartedIn | None = None
    checkpoints_saved: list[SavedIn] = Field(default_factory=list, max_length=MAX_SAVED)


def _at(now: datetime, age_s: float) -> str:
    return (now - timedelta(seconds=age_s)).isoformat()


def merge(kept: dict[str, Any] | None, report: RankReport, now: datetime) -> dict[str, Any]:
    """What the agent sends for a pod: the latest step (its number and epoch where the
    rank gave them, and when: a step without a number is progress too), every step time
    and saved checkpoint since the last sync (the most recent ones, within bounds), the
    checkpoint in flight (one saved after it ends it), the latest metrics. An epoch is
    sent only where there is one, so that a controller older than it still takes the
    report."""
    merged: dict[str, Any] = dict(kept or {})
    if report.step is not None or report.step_age_s is not None:
        merged["step"] = report.step
        merged["step_at"] = _at(now, report.step_age_s or 0.0)
        merged.pop("epoch", None)
        if report.epoch is not None:
            merged["epoch"] = report.epoch
    times = [*merged.get("step_times_s", []), *report.step_times_s]
    merged["step_times_s"] = times[-MAX_STEP_TIMES:]
    merged["metrics"] = {**merged.get("metrics", {}), **report.metrics}
    saved = [
        *merged.get("checkpoints_saved", []),
        *(
            {
                "uri": c.uri,
                "step": c.step,
                "at": _at(now, c.age_s),
                **({} if c.epoch is None else {"epoch": c.epoch}),
            }
            for c in report.checkpoints_saved
        ),
    ]
    merged["checkpoints_saved"] = saved[-MAX_SAVED:]
    if report.checkpoint_started is not None:
        started = report.checkpoint_started
        merged["checkpoint_started"] = {"step": started.step, "at": _at(now, started.age_s)}
    elif report.checkpoints_saved:
        merged["checkpoint_started"] = None
    else:
        merged.setdefault("checkpoint_started", None)
    return merged


class ProgressHandler(web.RequestHandler):
    """``POST /progress`` from a rank of this machine: refused (403) unless the calling
    process is one of the pod its marker names, running as that pod's account
    (``peers.py``). A checkpoint outside its job's checkpoint location is left out, and
    the answer (200, text) says so; a report taken whole is a 204."""

    def initialize(
        self,
        pod_of: Callable[[str, Caller | None], tuple[int, int]],
        own: Callable[[tuple[int, int], RankReport], tuple[RankReport, list[str]]],
        note: Callable[[tuple[int, int], RankReport, datetime], None],
        executor: Executor,
    ) -> None:
        self.pod_of, self.own, self.note, self.executor = pod_of, own, note, executor

    def check_xsrf_cookie(self) -> None:
        return  # no cookies here: the calling process is asked of the kernel

    def _pod(self, marker: str) -> tuple[int, int]:
        """The pod the calling process belongs to (blocking: reads ``/proc``)."""
        stream = getattr(self.request.connection, "stream", None)
        sock = getattr(stream, "socket", None)
        caller = None
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                caller = caller_of(sock.getpeername()[:2], sock.getsockname()[:2], marker=marker)
        return self.pod_of(marker, caller)

    async def post(self) -> None:
        marker = self.request.headers.get(MARKER_HEADER, "")
        loop = asyncio.get_running_loop()
        try:
            # On a pool of its own: a rank that floods the endpoint delays only progress,
            # never the agent's NVML and XID threads.
            pod = await loop.run_in_executor(self.executor, self._pod, marker)
        except ReportRefused as e:
            raise web.HTTPError(403, str(e)) from None
        if len(self.request.body) > MAX_BODY_BYTES:
            raise web.HTTPError(413, f"a report is at most {MAX_BODY_BYTES} bytes")
        try:
            report = RankReport.model_validate_json(self.request.body)
        except ValidationError as e:
            raise web.HTTPError(400, f"not a progress report: {e.errors()[:3]}") from e
        try:
            kept, left_out = self.own(pod, report)
        except ReportRefused as e:
            raise web.HTTPError(403, str(e)) from None
        self.note(pod, kept, datetime.now(UTC))
        if left_out:
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish("\n".join(left_out) + "\n")
        else:
            self.set_status(204)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """The refusal's reason as plain text, for the rank's log (not Tornado's page)."""
        error = kwargs.get("exc_info", (None, None))[1]
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        text = error.log_message if isinstance(error, web.HTTPError) else None
        self.finish(f"{status_code}: {text or self._reason}\n")


def progress_app(
    pod_of: Callable[[str, Caller | None], tuple[int, int]],
    own: Callable[[tuple[int, int], RankReport], tuple[RankReport, list[str]]],
    note: Callable[[tuple[int, int], RankReport, datetime], None],
) -> web.Application:
    handler = {
        "pod_of": pod_of,
        "own": own,
        "note": note,
        "executor": ThreadPoolExecutor(2, thread_name_prefix="gpufleet-progress"),
    }
    return web.Application([(r"/progress", ProgressHandler, handler)], max_body_size=MAX_BODY_BYTES)


# Where the agent's progress port is looked for first: below 1024 no account but root may
# bind a port (net.ipv4.ip_unprivileged_port_start), so while the agent restarts no
# researcher's process can take the port its running ranks report to.
PRIVILEGED_PORTS = range(700, 1000)


def bind_progress(
    data_dir: Path, ip: str, port: int, log: logging.Logger
) -> tuple[list[socket.socket], str]:
    """The sockets ranks report progress to, and its URL; none for ``port`` -1. With
    ``port`` 0 the agent before's port is taken again (``<data_dir>/progress-port``: the
    ranks it left running know that URL), else a privileged one where this process may
    bind one, else any free port."""
    if port < 0:
        return [], ""
    kept = data_dir / "progress-port"
    sockets: list[socket.socket] = []
    if port == 0:
        before = kept.read_text().strip() if kept.exists() else ""
        for candidate in ([int(before)] if before.isdigit() else []) + _privileged(data_dir):
            with contextlib.suppress(OSError, OverflowError):
                sockets = bind_sockets(candidate, ip)
                break
        if before and (not sockets or sockets[0].getsockname()[1] != int(before)):
            log.warning(
                "the progress port of the agent before (%s) cannot be had again: ranks it "
                "left running cannot report progress until they restart",
                before,
            )
    if not sockets:
        sockets = bind_sockets(port, ip)
    bound = sockets[0].getsockname()[1]
    if port == 0:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(f"{bound}\n")
    return sockets, f"http://{ip}:{bound}/progress"


def _privileged(data_dir: Path) -> list[int]:
    """The privileged ports to try, starting from one of this deployment's own (several
    agents may share a machine); none where this process may not bind them or anyone may."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        start = 1024
    if os.geteuid() != 0 or start <= PRIVILEGED_PORTS.start:
        return []
    ports = [p for p in PRIVILEGED_PORTS if p < start]
    first = int(hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest(), 16) % len(ports)
    return ports[first:] + ports[:first]


def own_checkpoints_only(report: RankReport, location: str) -> tuple[RankReport, list[str]]:
    """The report with only the checkpoints inside its job's checkpoint ``location`` (a
    rank cannot make another job, or its own next attempt, resume from elsewhere), and what
    was left out, in words."""
    kept = [c for c in report.checkpoints_saved if checkpoint_within(c.uri, location)]
    left_out = [
        f"checkpoint {c.uri} is left out: it is not inside this job's checkpoint "
        f"location {location or '(none)'}, and only those are resumed from"
        for c in report.checkpoints_saved
        if c not in kept
    ]
    return report.model_copy(update={"checkpoints_saved": kept}), left_out
