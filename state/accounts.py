"""The Unix identity each hub user's processes run as (docs/containment.md).

Two modes, chosen by the admin (``c.FleetController.user_mode``), never by what the host
happens to hold:

- ``sandbox`` (the default): researchers have no accounts on the machine; each hub user
  gets a uid of the configured range the first time they need one, recorded here, and keeps
  it. Its gid is the same number (a group of its own, as ``useradd`` makes). The sandbox
  gives it a passwd entry of its own.
- ``system``: each researcher's processes run as the node's account of the same name
  (JupyterHub's LocalProcessSpawner model); the uid and gid recorded are that account's, so
  a renumbered account is noticed rather than followed silently.

Invariants: a recorded account is never changed or given to another user; no uid 0, and in
sandbox mode no uid outside the range; the range holds no account of the host
(``check_range``).
"""

from __future__ import annotations

import bisect
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..api.events import EventKind
from ..scheduler.errors import InvalidRequest
from .base import Repository, _event
from .models import UserAccount

SANDBOX = "sandbox"
SYSTEM = "system"
USER_MODES = (SANDBOX, SYSTEM)


@dataclass(frozen=True)
class Account:
    username: str
    uid: int
    gid: int
    mode: str
    home: str | None = None  # the system account's home; None in sandbox mode


def first_free_uid(taken: Sequence[int], first: int, last: int) -> int | None:
    """The lowest uid of ``first..last`` not in ``taken`` (sorted); None when all are. Pure."""
    candidate = first
    for uid in taken[bisect.bisect_left(taken, first) :]:
        if uid > candidate:
            break
        candidate = uid + 1
    return candidate if candidate <= last else None


def check_range(first: int, last: int, host_uids: Iterable[tuple[str, int]]) -> str | None:
    """Why ``first..last`` cannot be the sandbox range (None: it can). Pure.

    The range must start above 0 and the host's system accounts, and no account of the
    host may have a uid in it: its files would become a researcher's."""
    if not 1000 <= first <= last <= 2**31 - 2:
        return (
            f"the sandbox uid range {first}-{last} must lie within 1000-{2**31 - 2} and "
            "start at or below its end"
        )
    inside = sorted((uid, name) for name, uid in host_uids if first <= uid <= last)
    if inside:
        listed = ", ".join(f"{name} ({uid})" for uid, name in inside[:5])
        return (
            f"the sandbox uid range {first}-{last} holds accounts of this machine: {listed}; "
            "choose c.FleetController.sandbox_uids outside them"
        )
    return None


class AccountStore(Repository):
    user_mode: str = SANDBOX
    sandbox_uids: tuple[int, int] = (200_000, 299_999)

    def account(self, now: datetime, username: str) -> Account:
        """The user's account, recorded on first use."""
        with self.read() as session:
            row = session.get(UserAccount, username)
            if row is not None:
                return self._checked(row)
        with self._write(now) as session:
            row = self.ensure_account(session, now, username)
            return self._checked(row)

    def accounts(self, usernames: Iterable[str]) -> dict[str, Account]:
        """The recorded accounts of these users (those that have one)."""
        names = sorted(set(usernames))
        if not names:
            return {}
        with self.read() as session:
            rows = session.scalars(select(UserAccount).where(UserAccount.username.in_(names)))
            return {row.username: _as_account(row) for row in rows}

    def ensure_account(self, session: Session, now: datetime, username: str) -> UserAccount:
        """The user's account row, made in this transaction if there is none yet."""
        row = session.get(UserAccount, username)
        if row is not None:
            return row
        if self.user_mode == SYSTEM:
            entry = _system_entry(username)
            uid, gid = entry.pw_uid, entry.pw_gid
            if uid == 0:
                raise InvalidRequest(
                    f"user {username} is root on this machine; sessions never run as root"
                )
        else:
            first, last = self.sandbox_uids
            taken = list(session.scalars(select(UserAccount.uid).order_by(UserAccount.uid)))
            found = first_free_uid(taken, first, last)
            if found is None:
                raise InvalidRequest(
                    f"every uid of the sandbox range {first}-{last} is taken; widen "
                    "c.FleetController.sandbox_uids"
                )
            uid = gid = found
        row = UserAccount(username=username, uid=uid, gid=gid, mode=self.user_mode, created_at=now)
        session.add(row)
        session.flush()
        _event(
            session,
            now,
            EventKind.ACCOUNT_CREATED,
            f"{username} runs as uid {uid} ({self.user_mode} mode)",
            username=username,
        )
        return row

    def _checked(self, row: UserAccount) -> Account:
        if row.mode != self.user_mode:
            raise InvalidRequest(
                f"{row.username}'s processes ran as uid {row.uid} in {row.mode} mode, and "
                f"the controller is now in {self.user_mode} mode; an admin must move their "
                "files and remove the account row before the mode can change for them"
            )
        if row.mode == SYSTEM:
            entry = _system_entry(row.username)
            if (entry.pw_uid, entry.pw_gid) != (row.uid, row.gid):
                raise InvalidRequest(
                    f"the account {row.username} is now uid {entry.pw_uid} on this machine, "
                    f"but gpufleet recorded uid {row.uid}; an admin must fix one of them"
                )
        return _as_account(row)


def _as_account(row: UserAccount) -> Account:
    home = None
    if row.mode == SYSTEM:
        try:
            home = pwd.getpwnam(row.username).pw_dir
        except KeyError:
            home = None
    return Account(row.username, row.uid, row.gid, row.mode, home)


def _system_entry(username: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(username)
    except KeyError:
        raise InvalidRequest(
            f"there is no account {username} on this machine; in system mode every hub user "
            "needs one (useradd), or set c.FleetController.user_mode = 'sandbox'"
        ) from None
