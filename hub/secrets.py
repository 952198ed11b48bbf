"""The platform's secrets on disk: files only the platform's account may read.

The spawner's token, the snapshot master key, JupyterHub's cookie secret and the database's
password are files of mode 0600 owned by the account the hub runs as (docs/containment.md).
They are made so, and checked at every start: a file that others may read, or that
belongs to someone else, is refused with the command that fixes it, since a secret anyone
could have read is no secret any more (rotate it too).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from .errors import ControllerError


class SecretFileError(ControllerError):
    """A secret's file is missing, unreadable, or readable by others; the message says
    what to run."""

    status = 500
    code = "secret-file"


def check_secret_file(path: Path, what: str) -> None:
    """Refuse a secret's file that anyone but its owner (this process's account) may read
    or write, or that another account owns."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise SecretFileError(f"{what} {path} does not exist") from None
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        raise SecretFileError(
            f"{what} {path} belongs to uid {info.st_uid}, not to this account "
            f"({os.geteuid()}); fix it with: chown {os.geteuid()} {path}"
        )
    if mode & 0o077:
        raise SecretFileError(
            f"{what} {path} has mode {mode:04o}, so other accounts may read it; fix it with: "
            f"chmod 600 {path} (and make a new one if anyone may have read it)"
        )


def secret_file(path: Path, what: str, nbytes: int = 32) -> str:
    """The secret in ``path`` (hex), made with mode 0600 on first use; checked."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(nbytes))
    check_secret_file(path, what)
    return path.read_text().strip()


def read_secret(path: Path, what: str) -> str:
    """The secret an admin put in ``path`` (a password), checked; surrounding blanks off."""
    check_secret_file(path, what)
    return path.read_text().strip()
