"""Which deployment on this machine holds which sandbox uids (docs/containment.md).

In ``sandbox`` user mode a deployment gives its hub users uids of its range, and the node
agent's loopback guard lets a job's rendezvous port be reached by the job user's uid. Two
deployments on one machine that gave the same uid to different people would let one's
researcher reach the other's rendezvous stores and files, so each running controller claims
its range in a registry directory every deployment of the machine shares
(``c.FleetController.sandbox_uid_registry``, ``/run/gpufleet/sandbox-uids``), and a
controller whose range overlaps another deployment's held claim does not start.

Invariants:

- A claim is one file of the registry (JSON: range, deployment, data directory, pid) that
  its controller holds with an exclusive ``flock(2)`` for its whole life. The lock, not the
  file, is the claim: a controller that crashes releases it with its last descriptor, so a
  crashed deployment blocks nobody, and a file whose lock is free is stale (removed when
  seen).
- The deployment is its database (``deployment_identity``): a restarted controller, or two
  controllers of one deployment during a rolling update, share their accounts table and so
  their uids, and never conflict with each other.
- Reading the claims and publishing one happen under an exclusive ``flock`` of the registry
  directory itself, so two deployments starting at once cannot both miss each other; a claim
  file is locked before that directory lock is let go.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy.engine import URL, make_url

SETTING = "c.FleetController.sandbox_uids"
REGISTRY_SETTING = "c.FleetController.sandbox_uid_registry"
DEFAULT_REGISTRY = "/run/gpufleet/sandbox-uids"
HIGHEST_UID = 2**31 - 2
LOCK_WAIT_SECONDS = 10.0
_SUFFIX = ".claim"


class ClaimError(Exception):
    """The range cannot be claimed; the message says what to change, ``setting`` which
    option."""

    def __init__(self, message: str, setting: str = SETTING) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class Claim:
    first: int
    last: int
    deployment: str  # the database (deployment_identity): what makes two controllers one
    data_dir: str
    pid: int
    path: str = ""  # the registry file it was read from; empty for a claim not yet made

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "path"}
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str) -> Claim:
        data = json.loads(text)
        return cls(
            int(data["first"]),
            int(data["last"]),
            str(data["deployment"]),
            str(data["data_dir"]),
            int(data["pid"]),
            path,
        )


# ------------------------------------------------------------------ the rule (pure)
def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the inclusive ranges ``a`` and ``b`` share a uid. Pure."""
    return a[0] <= b[1] and b[0] <= a[1]


def conflicts(mine: Claim, held: Iterable[Claim]) -> list[Claim]:
    """The held claims of other deployments whose range overlaps ``mine``'s. Pure."""
    return [
        other
        for other in held
        if other.deployment != mine.deployment
        and overlaps((mine.first, mine.last), (other.first, other.last))
    ]


def free_range(
    size: int, taken: Iterable[tuple[int, int]], lowest: int = 1000
) -> tuple[int, int] | None:
    """The lowest range of ``size`` uids from ``lowest`` that overlaps none of ``taken``
    (None: there is none below the highest uid). Pure."""
    start = lowest
    for first, last in sorted(taken):
        if start + size - 1 < first:
            break
        start = max(start, last + 1)
    return (start, start + size - 1) if start + size - 1 <= HIGHEST_UID else None


def conflict_message(mine: Claim, found: list[Claim], suggestion: tuple[int, int] | None) -> str:
    """Why ``mine`` may not start beside ``found`` (non-empty), and what to change. Pure."""
    held = "; ".join(
        f"{other.first}-{other.last} by the deployment whose data directory is "
        f"{other.data_dir} (controller pid {other.pid}, claim {other.path})"
        for other in found
    )
    advice = f"choose {SETTING} outside it"
    if suggestion is not None:
        advice += f", for example [{suggestion[0]}, {suggestion[1]}]"
    return (
        f"the sandbox uid range {mine.first}-{mine.last} overlaps another deployment's on "
        f"this machine, held: {held}. Two deployments would give the same uids to different "
        f"people, and each one's researchers could reach the other's job ports and files; "
        f"{advice}"
    )


def deployment_identity(db_url: str) -> str:
    """The database a controller uses, so that two controllers of one deployment (one
    configuration) get the same string: SQLite by its file's real path. A digest of it:
    the claim is readable by every account, and a database URL may name a user, a host
    or a secret in its query."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        if not url.database or url.database == ":memory:":
            named = f"sqlite-memory:{os.getpid()}:{uuid.uuid4().hex}"  # a process's own
        else:
            named = f"sqlite:///{os.path.realpath(url.database)}"
    else:
        # (URL.set(password=None) would keep it: None there means "unchanged".)
        named = URL.create(
            url.drivername, url.username, None, url.host, url.port, url.database, url.query
        ).render_as_string()
    return "sha256:" + hashlib.sha256(named.encode()).hexdigest()


# ------------------------------------------------------------------ the registry (I/O)
class HeldClaim:
    """This controller's claim: held while the descriptor is open (the process lives)."""

    def __init__(self, claim: Claim, fd: int) -> None:
        self.claim = claim
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the claim (idempotent); exiting the process has the same effect."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.claim.path)
        os.close(self._fd)
        self._fd = None


def claim(registry: Path, mine: Claim, host_uids: Iterable[tuple[int, int]] = ()) -> HeldClaim:
    """Claim ``mine``'s range in ``registry`` unless another deployment's held claim
    overlaps it (``ClaimError``, naming it). ``host_uids``: ranges the suggested other range
    must avoid besides the claims (the machine's accounts)."""
    _ensure_directory(registry)
    with _locked_directory(registry) as dir_fd:
        held = _held_claims(registry, dir_fd)
        found = conflicts(mine, held)
        if found:
            taken = [*((c.first, c.last) for c in held), *host_uids]
            size = mine.last - mine.first + 1
            suggestion = free_range(size, taken, mine.first) or free_range(size, taken)
            raise ClaimError(conflict_message(mine, found, suggestion))
        return _publish(registry, dir_fd, mine)


def held_claims(registry: Path) -> list[Claim]:
    """The claims of ``registry`` whose controller is alive (stale files are removed)."""
    if not registry.is_dir():
        return []
    with _locked_directory(registry) as dir_fd:
        return _held_claims(registry, dir_fd)


def _cannot_write(registry: Path, e: OSError) -> ClaimError:
    return ClaimError(
        f"cannot claim the sandbox uid range in the registry {registry} ({e.strerror}): "
        f"every controller of this machine in sandbox mode registers its range there. Let "
        f"this account (uid {os.geteuid()}) write it (as root: install -d -m 0755 -o "
        f"{os.geteuid()} {registry}), or set {REGISTRY_SETTING} to a directory it may write "
        "that every deployment of this machine shares",
        REGISTRY_SETTING,
    )


def _ensure_directory(registry: Path) -> None:
    """Make the registry and its missing parents, mode 0755 whatever the umask: anyone
    may read the claims; only the accounts the admin lets write there add one."""
    try:
        missing = [p for p in (registry, *registry.parents) if not p.exists()]
        for path in reversed(missing):
            try:
                path.mkdir(mode=0o755)
            except FileExistsError:
                continue  # another controller made it meanwhile
            os.chmod(path, 0o755)
    except OSError as e:
        raise _cannot_write(registry, e) from None
    if not registry.is_dir():
        raise ClaimError(f"{registry} is not a directory", REGISTRY_SETTING)


@contextlib.contextmanager
def _locked_directory(registry: Path) -> Iterator[int]:
    """The registry's descriptor, exclusively locked: claims are read and added only so.
    Held for milliseconds; one that stays held (a stopped process) is reported, not waited
    for forever."""
    try:
        fd = os.open(registry, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise _cannot_write(registry, e) from None
    try:
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClaimError(
                        f"the sandbox uid registry {registry} stayed locked for "
                        f"{LOCK_WAIT_SECONDS:.0f} s by another process (a controller that is "
                        "starting, or one stopped while it started); try again",
                        REGISTRY_SETTING,
                    ) from None
                time.sleep(0.05)
        yield fd
    finally:
        os.close(fd)  # lets the directory lock go


def _held_claims(registry: Path, dir_fd: int) -> list[Claim]:
    claims = []
    for name in sorted(os.listdir(dir_fd)):
        if not name.endswith(_SUFFIX):
            continue
        path = str(registry / name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            continue  # removed meanwhile, or a link: no controller's claim
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                claims.append(_read(fd, path))
                continue
            # Nobody holds it: its controller is gone.
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(fd)
    return claims


def _read(fd: int, path: str) -> Claim:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    try:
        return Claim.from_json(b"".join(chunks).decode(), path)
    except (ValueError, KeyError, TypeError):
        # Held by a live process but unreadable: fail safe, as if it held every uid.
        return Claim(0, HIGHEST_UID, f"unreadable:{path}", "(unknown: unreadable claim)", 0, path)


def _publish(registry: Path, dir_fd: int, mine: Claim) -> HeldClaim:
    digest = hashlib.sha256(mine.deployment.encode()).hexdigest()[:12]
    name = f"{digest}-{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"
    try:
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
            0o644,
            dir_fd=dir_fd,
        )
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _cannot_write(registry, e) from None
        raise ClaimError(f"cannot write a claim in {registry}: {e}", REGISTRY_SETTING) from None
    # Readers take this lock's absence for a dead controller: locked before anyone else
    # may look (they wait for the directory's lock, which the caller holds).
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.fchmod(fd, 0o644)
    held = replace(mine, path=str(registry / name))
    os.write(fd, held.to_json().encode())
    return HeldClaim(held, fd)
