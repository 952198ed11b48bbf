"""gpufleet's Python SDK: the controller's REST API (docs/api.md) from a notebook, a
script or the ``gpufleet`` command.

    from gpufleet.client import Client
    with Client() as fleet:          # inside a session: no arguments needed
        for node in fleet.nodes():
            print(node.name, node.free_gpus)

``AsyncClient`` has the same methods, awaited. Answers are the API's own pydantic models
(``gpufleet.api``). Where the controller is and who calls it (``Connection.discover``):

- the controller's API URL: ``api_url``, else the hub's public URL ``hub_url`` +
  ``/services/gpufleet/api/v1``, else ``$GPUFLEET_API_URL``, else
  ``$GPUFLEET_CONTROLLER_API_URL`` (set in every gpufleet session), else
  ``$GPUFLEET_HUB_URL`` + ``/services/gpufleet/api/v1``;
- the token: ``token``, else ``$GPUFLEET_TOKEN``, else ``$JUPYTERHUB_API_TOKEN`` (a
  session's own token acts for its user).

Errors are one tree: ``NotConfigured`` (nothing says where the controller is),
``Unreachable`` (no answer), ``ApiError`` (the controller's ``{code, message, details}``,
with the HTTP status).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from .api.events import EventOut
from .api.jobs import JobOut, LogOut, TraceList, TraceOut
from .api.schemas import (
    BreakerOut,
    NodeOut,
    ProjectUsageOut,
    SnapshotOut,
    TimedJobOut,
    WeekUsageOut,
    WorkloadOut,
)

API_PATH = "/services/gpufleet/api/v1"
PAGE = 1000  # the API's largest page
LONG_POLL_S = 20  # under DEFAULT_TIMEOUT_S
# What a job takes from the submitting session's environment unless told otherwise: what
# its Python needs to find its packages and tools. Never tokens.
JOB_ENVIRONMENT = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "LD_LIBRARY_PATH",
)
DEFAULT_TIMEOUT_S = 30.0
T = TypeVar("T")


class GpufleetError(Exception):
    """Base class for the SDK's errors."""


class NotConfigured(GpufleetError):
    """Nothing says where the controller is (``missing == "url"``), the URL given is not
    one (``missing == "url"``, ``source`` names what gave it: ``api_url``, ``hub_url`` or
    the environment variable), or no token was found (``missing == "token"``)."""

    def __init__(self, message: str, *, missing: str = "", source: str = "", value: str = ""):
        super().__init__(message)
        self.missing, self.source, self.value = missing, source, value


class Unreachable(GpufleetError):
    """The controller did not answer."""


class ApiError(GpufleetError):
    """The controller answered with an error: ``status``, ``code``, ``message``."""

    def __init__(self, status: int, code: str, message: str, details: object = None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


@dataclass(frozen=True)
class Connection:
    api_url: str
    token: str

    @classmethod
    def discover(
        cls,
        api_url: str | None = None,
        token: str | None = None,
        *,
        hub_url: str | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> Connection:
        """Where the controller is and the token to show it (see the module's doc)."""
        hub = environ.get("GPUFLEET_HUB_URL", "")
        api_env = environ.get("GPUFLEET_API_URL", "")
        session_env = environ.get("GPUFLEET_CONTROLLER_API_URL", "")
        # (what gave it, what it said, the API URL it means), in the order of the module doc
        candidates: list[tuple[str, str, str]] = [
            ("api_url", api_url or "", api_url or ""),
            ("hub_url", hub_url or "", hub_url.rstrip("/") + API_PATH if hub_url else ""),
            ("$GPUFLEET_API_URL", api_env, api_env),
            ("$GPUFLEET_CONTROLLER_API_URL", session_env, session_env),
            ("$GPUFLEET_HUB_URL", hub, hub.rstrip("/") + API_PATH),
        ]
        found = next((c for c in candidates if c[1]), None)
        if found is None:
            raise NotConfigured(
                "where is the gpufleet controller? Pass hub_url (the hub's public URL, e.g. "
                "https://hub.example.org) or set $GPUFLEET_HUB_URL; inside a gpufleet session "
                "it is found by itself",
                missing="url",
            )
        source, given, url = found
        if not _is_http_url(url):
            raise NotConfigured(
                f"{source} {given!r} is not a URL: write it with http:// or https:// "
                "(e.g. https://hub.example.org)",
                missing="url",
                source=source,
                value=given,
            )
        secret = token or environ.get("GPUFLEET_TOKEN") or environ.get("JUPYTERHUB_API_TOKEN")
        if not secret:
            raise NotConfigured(
                "no token: create one on the hub's Token page (/hub/token) and pass it as "
                "token= or set $GPUFLEET_TOKEN",
                missing="token",
            )
        return cls(url.rstrip("/"), secret)


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ of an IPv6 address
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


# ------------------------------------------------------------------ operations
# Each operation is a generator: it yields the requests it needs and receives each
# answer's JSON, so one definition serves the blocking and the asyncio client.
@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    params: Mapping[str, Any] = field(default_factory=dict)
    json: Any = None


Steps = Generator[_Request, Any, T]


def _workloads(
    states: Sequence[str], username: str | None, kind: str | None = None
) -> Steps[list[WorkloadOut]]:
    items: list[WorkloadOut] = []
    while True:
        params: dict[str, Any] = {"offset": len(items), "limit": PAGE, "state": list(states)}
        if username is not None:
            params["username"] = username
        if kind is not None:
            params["kind"] = kind
        page = yield _Request("GET", "/workloads", params)
        items += [WorkloadOut.model_validate(w) for w in page["items"]]
        if not page["items"] or len(items) >= page["total"]:
            return items


def _queue(username: str | None) -> Steps[list[WorkloadOut]]:
    waiting = yield from _workloads(["pending"], username)
    return sorted(
        waiting, key=lambda w: (w.project, w.gpu_type, w.queue_position or 0, w.created_at)
    )


def _snapshots(username: str | None) -> Steps[list[SnapshotOut]]:
    params = {"username": username} if username else {}
    answer = yield _Request("GET", "/snapshots", params)
    return [SnapshotOut.model_validate(s) for s in answer["items"]]


def _projects() -> Steps[list[ProjectUsageOut]]:
    answer = yield _Request("GET", "/projects")
    return [ProjectUsageOut.model_validate(p) for p in answer["items"]]


def _usage(weeks: int) -> Steps[list[WeekUsageOut]]:
    answer = yield _Request("GET", "/usage", {"weeks": weeks})
    return [WeekUsageOut.model_validate(u) for u in answer["items"]]


def _nodes() -> Steps[list[NodeOut]]:
    answer = yield _Request("GET", "/nodes")
    return [NodeOut.model_validate(n) for n in answer["items"]]


def _cordon(node: str, cordoned: bool) -> Steps[NodeOut]:
    action = "cordon" if cordoned else "uncordon"
    answer = yield _Request("POST", f"/nodes/{node}/{action}")
    return NodeOut.model_validate(answer)


def _drain(node: str, reason: str) -> Steps[NodeOut]:
    answer = yield _Request("POST", f"/nodes/{node}/drain", json={"reason": reason})
    return NodeOut.model_validate(answer)


def _recycle(node: str, reason: str) -> Steps[NodeOut]:
    answer = yield _Request("POST", f"/nodes/{node}/recycle", json={"reason": reason})
    return NodeOut.model_validate(answer)


def _drain_at(node: str, reason: str, at: str) -> Steps[TimedJobOut]:
    answer = yield _Request("POST", f"/nodes/{node}/drain", json={"reason": reason, "at": at})
    return TimedJobOut.model_validate(answer)


def _reset_breaker(cluster: str) -> Steps[list[BreakerOut]]:
    answer = yield _Request("POST", f"/recovery/breakers/{cluster}/reset")
    return [BreakerOut.model_validate(b) for b in answer["items"]]


def _events(limit: int, workload_id: int | None) -> Steps[list[EventOut]]:
    params: dict[str, Any] = {"limit": limit}
    if workload_id is not None:
        params["workload_id"] = workload_id
    answer = yield _Request("GET", "/events", params)
    return [EventOut.model_validate(e) for e in answer["items"]]


def job_submission(
    *,
    gpus: int,
    gpu_type: str,
    project: str,
    script: str | None = None,
    file: str | os.PathLike[str] | None = None,
    gpus_per_pod: int | None = None,
    priority: str | None = None,
    name: str = "",
    args: Sequence[str] = (),
    python: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    checkpoint_uri: str = "",
    environ: Mapping[str, str] = os.environ,
) -> dict[str, Any]:
    """The body of ``POST /jobs``: the entry script's code (``script``) or its file
    (``file``), run with this Python (``sys.executable``) from this directory, with the
    variables of ``JOB_ENVIRONMENT`` that are set here plus ``env``."""
    if (script is None) == (file is None):
        raise GpufleetError("give the entry script as script= (its code) or file= (a path)")
    script_name = "train.py"
    if file is not None:
        path = Path(file)
        try:
            script = path.read_text()
        except OSError as e:
            raise GpufleetError(f"cannot read the entry script {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise GpufleetError(f"the entry script {path} is not text (UTF-8)") from e
        if not script.strip():
            raise GpufleetError(f"the entry script {path} is empty")
        script_name = path.name if path.suffix == ".py" else f"{path.name}.py"
    inherited = {k: environ[k] for k in JOB_ENVIRONMENT if k in environ}
    body: dict[str, Any] = {
        "project": project,
        "gpu_type": gpu_type,
        "gpus": gpus,
        "name": name,
        "script": script,
        "script_name": script_name,
        "args": [str(a) for a in args],
        # Inside a session, its own interpreter (the job runs in the session's environment);
        # elsewhere this Python means nothing to the ranks, which get their environment's.
        "python": python or (sys.executable if environ.get("GPUFLEET_WORKLOAD_ID") else ""),
        "cwd": cwd if cwd is not None else os.getcwd(),
        "env": {**inherited, **(env or {})},
        "checkpoint_uri": checkpoint_uri,
    }
    if gpus_per_pod is not None:
        body["gpus_per_pod"] = gpus_per_pod
    if priority is not None:
        body["priority"] = priority
    session = environ.get("GPUFLEET_WORKLOAD_ID", "")
    if session.isdigit():
        body["session"] = int(session)  # its ranks run in this session's environment
    return body


def _submit(body: dict[str, Any]) -> Steps[JobOut]:
    answer = yield _Request("POST", "/jobs", json=body)
    return JobOut.model_validate(answer)


def _jobs(states: Sequence[str], username: str | None) -> Steps[list[JobOut]]:
    items: list[JobOut] = []
    while True:
        params: dict[str, Any] = {"offset": len(items), "limit": PAGE, "state": list(states)}
        if username is not None:
            params["username"] = username
        page = yield _Request("GET", "/jobs", params)
        items += [JobOut.model_validate(j) for j in page["items"]]
        if not page["items"] or len(items) >= page["total"]:
            return items


def _job(job: int, wait: int = 0, version: int = 0) -> Steps[JobOut]:
    params = {"wait": wait, "version": version} if wait else {}
    answer = yield _Request("GET", f"/jobs/{job}", params)
    return JobOut.model_validate(answer)


def _wait(job: int, timeout: float | None) -> Steps[JobOut]:
    deadline = None if timeout is None else time.monotonic() + timeout
    current = yield from _job(job)
    while current.state != "ended":
        left = LONG_POLL_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"job {job} is still {current.state} after {timeout} s")
        current = yield from _job(job, max(1, min(LONG_POLL_S, int(left))), current.version)
    return current


def _cancel(job: int) -> Steps[JobOut]:
    answer = yield _Request("POST", f"/jobs/{job}/cancel")
    return JobOut.model_validate(answer)


def _log_piece(job: int, rank: int, stream: str, offset: int, wait: int) -> Steps[LogOut]:
    params = {"rank": rank, "stream": stream, "offset": offset, "wait": wait}
    answer = yield _Request("GET", f"/jobs/{job}/logs", params)
    return LogOut.model_validate(answer)


def _traces(job: int) -> Steps[list[TraceOut]]:
    answer = yield _Request("GET", f"/jobs/{job}/traces")
    return TraceList.model_validate(answer).items


def _take_trace(job: int, timeout: float) -> Steps[TraceOut]:
    """Ask for a new trace of a running job and wait until every pod answered (or the
    controller's wait for them ended); ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    answer = yield _Request("POST", f"/jobs/{job}/traces")
    trace = TraceOut.model_validate(answer)
    while not trace.complete:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"job {job}'s trace {trace.id} is not complete after {timeout} s")
        params = {"wait": max(1, int(min(LONG_POLL_S, left)))}
        answer = yield _Request("GET", f"/jobs/{job}/traces/{trace.id}", params)
        trace = TraceOut.model_validate(answer)
    return trace


def _job_id(job: int | JobOut) -> int:
    return job.id if isinstance(job, JobOut) else int(job)


def _info() -> Steps[dict[str, Any]]:
    answer: dict[str, Any] = yield _Request("GET", "/")
    return answer


# ------------------------------------------------------------------ the clients
def _answer(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_success:
        if body is None:
            raise ApiError(
                response.status_code,
                "not-the-controller",
                f"{response.request.url} answered something other than JSON: is this the "
                "gpufleet controller's API?",
            )
        return body
    error = body if isinstance(body, dict) else {}
    raise ApiError(
        response.status_code,
        str(error.get("code", "http")),
        str(error.get("message") or f"the controller answered {response.status_code}"),
        error.get("details"),
    )


def _unreachable(connection: Connection, e: httpx.TransportError) -> Unreachable:
    return Unreachable(f"the gpufleet controller at {connection.api_url} did not answer: {e}")


class _Common:
    def __init__(
        self,
        api_url: str | None = None,
        token: str | None = None,
        *,
        hub_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.connection = Connection.discover(api_url, token, hub_url=hub_url)
        self._options: dict[str, Any] = {
            "base_url": self.connection.api_url,
            "headers": {"Authorization": f"token {self.connection.token}"},
            "timeout": timeout,
            # A session's HTTP_PROXY is for the researcher's downloads, not for its token.
            "trust_env": False,
        }


class Client(_Common):
    """The controller's API, blocking. Use it as a context manager, or ``close()`` it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._http = httpx.Client(**self._options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, steps: Steps[T]) -> T:
        answer: Any = None
        try:
            while True:
                request = steps.send(answer)
                try:
                    response = self._http.request(
                        request.method, request.path, params=request.params, json=request.json
                    )
                except httpx.TransportError as e:
                    raise _unreachable(self.connection, e) from e
                answer = _answer(response)
        except StopIteration as done:
            return done.value

    def info(self) -> dict[str, Any]:
        """The controller's version, and whether it is the active one."""
        return self._run(_info())

    def workloads(
        self, state: Sequence[str] = (), username: str | None = None
    ) -> list[WorkloadOut]:
        """Your workloads (everyone's for admins), newest first, every page."""
        return self._run(_workloads(state, username))

    def queue(self, username: str | None = None) -> list[WorkloadOut]:
        """Waiting workloads by project, GPU type and place, each with why it waits."""
        return self._run(_queue(username))

    def sessions(self, state: Sequence[str] = (), username: str | None = None) -> list[WorkloadOut]:
        """Your sessions (everyone's for admins), newest first."""
        return self._run(_workloads(state, username, "session"))

    def snapshots(self, username: str | None = None) -> list[SnapshotOut]:
        """Your sessions' snapshots, newest first (admins: ``username``'s)."""
        return self._run(_snapshots(username))

    def projects(self) -> list[ProjectUsageOut]:
        """Your projects and the nodes above them (every node for admins): quotas per GPU
        type with what is used and asked for now."""
        return self._run(_projects())

    quota = projects  # what researchers look for: their projects, quotas and use

    def usage(self, weeks: int = 8) -> list[WeekUsageOut]:
        """GPU-hours per project, user and week in your projects (all for admins)."""
        return self._run(_usage(weeks))

    def nodes(self) -> list[NodeOut]:
        return self._run(_nodes())

    def cordon(self, node: str) -> NodeOut:
        """No new work on ``node`` (admins); what runs there keeps running."""
        return self._run(_cordon(node, True))

    def uncordon(self, node: str) -> NodeOut:
        return self._run(_cordon(node, False))

    def drain(self, node: str, reason: str = "") -> NodeOut:
        """Cordon ``node`` and stop what runs there (admins): jobs restart elsewhere,
        sessions are snapshotted and stopped."""
        return self._run(_drain(node, reason))

    def recycle(self, node: str, reason: str = "") -> NodeOut:
        """Drain ``node``, recycle it once it is empty, then diagnose it (admins); it
        returns to service if the diagnostics pass."""
        return self._run(_recycle(node, reason))

    def drain_at(self, node: str, at: str, reason: str = "") -> TimedJobOut:
        """Drain ``node`` later (admins): ``at`` is HH:MM (UTC) or an ISO date and time."""
        return self._run(_drain_at(node, reason, at))

    def reset_breaker(self, cluster: str) -> list[BreakerOut]:
        """Let the recovery loop cordon faulty nodes of ``cluster`` again (admins)."""
        return self._run(_reset_breaker(cluster))

    def events(self, limit: int = 100, workload_id: int | None = None) -> list[EventOut]:
        return self._run(_events(limit, workload_id))

    def submit(self, script: str | None = None, **options: Any) -> JobOut:
        """Queue a training job; the options are those of ``job_submission``:
        ``submit(file="train.py", gpus=8, gpu_type="A100-80GB", project="vision")``."""
        return self._run(_submit(job_submission(script=script, **options)))

    def jobs(self, state: Sequence[str] = (), username: str | None = None) -> list[JobOut]:
        """Your jobs (everyone's for admins), newest first."""
        return self._run(_jobs(state, username))

    def job(self, job: int | JobOut) -> JobOut:
        return self._run(_job(_job_id(job)))

    def wait(self, job: int | JobOut, timeout: float | None = None) -> JobOut:
        """Block until the job has ended (``TimeoutError`` after ``timeout`` seconds)."""
        return self._run(_wait(_job_id(job), timeout))

    def cancel(self, job: int | JobOut) -> JobOut:
        """Stop every rank; the GPUs are released once they are gone."""
        return self._run(_cancel(_job_id(job)))

    def traces(self, job: int | JobOut) -> list[TraceOut]:
        """The job's traces (every rank's Python stacks), newest first: a hang's, taken
        before its gang was stopped, and those asked for with ``trace``."""
        return self._run(_traces(_job_id(job)))

    def trace(self, job: int | JobOut, timeout: float = 60.0) -> TraceOut:
        """Take every rank's Python stacks of a running job now (py-spy, on its nodes)."""
        return self._run(_take_trace(_job_id(job), timeout))

    def watch(self, job: int | JobOut) -> Iterator[JobOut]:
        """The job now, then again at every change, until it has ended."""
        current = self._run(_job(_job_id(job)))
        yield current
        while current.state != "ended":
            newer = self._run(_job(current.id, LONG_POLL_S, current.version))
            if newer.version != current.version:
                yield newer
            current = newer

    def logs(
        self, job: int | JobOut, rank: int = 0, stream: str = "stdout", follow: bool = False
    ) -> Iterator[str]:
        """One rank's output as it comes; with ``follow``, until the job has ended."""
        offset = 0
        while True:
            wait = LONG_POLL_S if follow else 0
            piece = self._run(_log_piece(_job_id(job), rank, stream, offset, wait))
            if piece.data:
                yield piece.data
            offset = piece.next_offset
            if piece.complete or not (follow or piece.data):
                return


class AsyncClient(_Common):
    """The controller's API for asyncio code (a notebook's running loop included)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._http = httpx.AsyncClient(**self._options)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, steps: Steps[T]) -> T:
        answer: Any = None
        try:
            while True:
                request = steps.send(answer)
                try:
                    response = await self._http.request(
                        request.method, request.path, params=request.params, json=request.json
                    )
                except httpx.TransportError as e:
                    raise _unreachable(self.connection, e) from e
                answer = _answer(response)
        except StopIteration as done:
            return done.value

    async def info(self) -> dict[str, Any]:
        return await self._run(_info())

    async def workloads(
        self, state: Sequence[str] = (), username: str | None = None
    ) -> list[WorkloadOut]:
        return await self._run(_workloads(state, username))

    async def queue(self, username: str | None = None) -> list[WorkloadOut]:
        return await self._run(_queue(username))

    async def sessions(
        self, state: Sequence[str] = (), username: str | None = None
    ) -> list[WorkloadOut]:
        return await self._run(_workloads(state, username, "session"))

    async def snapshots(self, username: str | None = None) -> list[SnapshotOut]:
        return await self._run(_snapshots(username))

    async def projects(self) -> list[ProjectUsageOut]:
        return await self._run(_projects())

    quota = projects

    async def usage(self, weeks: int = 8) -> list[WeekUsageOut]:
        return await self._run(_usage(weeks))

    async def nodes(self) -> list[NodeOut]:
        return await self._run(_nodes())

    async def cordon(self, node: str) -> NodeOut:
        return await self._run(_cordon(node, True))

    async def uncordon(self, node: str) -> NodeOut:
        return await self._run(_cordon(node, False))

    async def drain(self, node: str, reason: str = "") -> NodeOut:
        return await self._run(_drain(node, reason))

    async def recycle(self, node: str, reason: str = "") -> NodeOut:
        return await self._run(_recycle(node, reason))

    async def reset_breaker(self, cluster: str) -> list[BreakerOut]:
        return await self._run(_reset_breaker(cluster))

    async def events(self, limit: int = 100, workload_id: int | None = None) -> list[EventOut]:
        return await self._run(_events(limit, workload_id))

    async def submit(self, script: str | None = None, **options: Any) -> JobOut:
        return await self._run(_submit(job_submission(script=script, **options)))

    async def jobs(self, state: Sequence[str] = (), username: str | None = None) -> list[JobOut]:
        return await self._run(_jobs(state, username))

    async def job(self, job: int | JobOut) -> JobOut:
        return await self._run(_job(_job_id(job)))

    async def wait(self, job: int | JobOut) -> JobOut:
        """Until the job has ended; bound it with ``asyncio.timeout``."""
        return await self._run(_wait(_job_id(job), None))

    async def cancel(self, job: int | JobOut) -> JobOut:
        return await self._run(_cancel(_job_id(job)))

    async def traces(self, job: int | JobOut) -> list[TraceOut]:
        return await self._run(_traces(_job_id(job)))

    async def trace(self, job: int | JobOut) -> TraceOut:
        """As ``Client.trace``; bound it with ``asyncio.timeout``."""
        return await self._run(_take_trace(_job_id(job), float("inf")))

    async def watch(self, job: int | JobOut) -> AsyncIterator[JobOut]:
        current = await self._run(_job(_job_id(job)))
        yield current
        while current.state != "ended":
            newer = await self._run(_job(current.id, LONG_POLL_S, current.version))
            if newer.version != current.version:
                yield newer
            current = newer

    async def logs(
        self, job: int | JobOut, rank: int = 0, stream: str = "stdout", follow: bool = False
    ) -> AsyncIterator[str]:
        offset = 0
        while True:
            wait = LONG_POLL_S if follow else 0
            piece = await self._run(_log_piece(_job_id(job), rank, stream, offset, wait))
            if piece.data:
                yield piece.data
            offset = piece.next_offset
            if piece.complete or not (follow or piece.data):
                return
