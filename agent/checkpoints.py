"""Where a job's ranks keep their checkpoints, and what lets them reach them: a local
location is bound into the rank's sandbox (``checkpoint_place``); a location in S3 is
reached with the user's own credentials, which an admin scoped to that user's prefix
(``checkpoint_credentials``; docs/jobs.md, "Checkpoints in S3"), so a rank of one user
cannot read or write another's checkpoints whatever its script does."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .runner import RunnerError

if TYPE_CHECKING:
    from .containment import RankAccount


class S3Access(Protocol):
    """What a node knows of S3 for checkpoints (``jobs.RankSandbox`` has it)."""

    @property
    def s3_credentials(self) -> Mapping[str, Mapping[str, str]]: ...
    @property
    def s3_endpoint(self) -> str: ...
    @property
    def s3_region(self) -> str: ...


class CredentialsFileError(ValueError):
    """The checkpoint credentials file cannot be used; the message says why."""


def load_checkpoint_credentials(path: Path) -> dict[str, dict[str, str]]:
    """``{"<user>": {"access_key": ..., "secret_key": ...}}`` from ``path``, a file only the
    agent's account may read (it holds every user's secret)."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CredentialsFileError(f"cannot read {path}: {e.strerror or e}") from e
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.geteuid():
        raise CredentialsFileError(
            f"{path} holds every user's secret: it must belong to the agent's account "
            "and be readable by it alone (chmod 600)"
        )
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CredentialsFileError(f"{path} is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise CredentialsFileError(f"{path} must map each user to their credentials")
    loaded: dict[str, dict[str, str]] = {}
    for user, entry in data.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("access_key"), str)
            and isinstance(entry.get("secret_key"), str)
        ):
            raise CredentialsFileError(
                f"{path}: {user!r} needs an access_key and a secret_key (strings)"
            )
        loaded[str(user)] = {"access_key": entry["access_key"], "secret_key": entry["secret_key"]}
    return loaded


def checkpoint_credentials(checkpoint: str, username: str, sandbox: S3Access) -> dict[str, str]:
    """The variables that give a rank its user's S3 credentials, which reach only that
    user's checkpoint prefix (an admin made them so): none for a local checkpoint.
    Raises ``RunnerError`` for a checkpoint in S3 when this node has none for the user."""
    if not checkpoint.startswith("s3://"):
        return {}
    mine = sandbox.s3_credentials.get(username)
    if mine is None:
        raise RunnerError(
            f"the job checkpoints to {checkpoint}, but this node has no S3 checkpoint "
            f"credentials for {username}: an admin adds them to "
            "c.NodeAgent.checkpoint_credentials_file"
        )
    return {
        "AWS_ACCESS_KEY_ID": mine["access_key"],
        "AWS_SECRET_ACCESS_KEY": mine["secret_key"],
        "AWS_DEFAULT_REGION": sandbox.s3_region,
        **({"AWS_ENDPOINT_URL": sandbox.s3_endpoint} if sandbox.s3_endpoint else {}),
    }


def checkpoint_place(checkpoint: Path, account: RankAccount, root: Path) -> Path:
    """Which directory of the user's holds a job's local checkpoint location, to bind into
    its sandbox: the user's home, or their directory under the platform's ``root``
    (``<root>/<user>``, made here, owned by them). Anything else is refused: the agent runs
    as root, and a location a submission chose must never make it create, own or show a
    directory elsewhere. Below that directory, the rank makes what it needs itself, as its
    user (so no link the user put there is followed by root). Raises ``RunnerError``."""
    if not checkpoint.is_absolute() or ".." in checkpoint.parts:
        raise RunnerError(f"checkpoint location {checkpoint} must be an absolute path")
    if checkpoint == account.home or checkpoint.is_relative_to(account.home):
        return account.home
    mine = root / account.username
    if not checkpoint.is_relative_to(mine):
        raise RunnerError(f"checkpoint location {checkpoint} must be in your home or under {mine}")
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        mine.mkdir(mode=0o700)
    info = mine.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise RunnerError(f"{mine} is not a directory")
    if (info.st_uid, info.st_gid) != (account.uid, account.gid):
        os.chown(mine, account.uid, account.gid, follow_symlinks=False)
    return mine
