"""The loopback guard: which local ports researchers' processes may not connect to.

On one machine every session and rank shares the host's loopback with the platform. Most
of what listens there authenticates each call (JupyterHub, the controller, PostgreSQL with
its password, notebook servers with their tokens), but not all: an S3 server's master,
volume and filer ports, the agent's metrics, and torch's rendezvous store (TCPStore) of
every job. The node agent keeps an nftables table of its own that rejects connections to
those ports from every account but the platform's:

- ``protected_ports`` (the admin's list, and the agent's metrics port): only the platform's
  account (the agent's own uid) may connect;
- each running job's rendezvous port: only the platform's account and the job's user.

Replies on connections the platform opened are not affected (the rules match new
connections only), and nothing but loopback traffic is matched. The table is replaced as a
whole, in one transaction, whenever the set of jobs changes, and removed when the agent
stops. Pure: :func:`ruleset` writes the table; :class:`NetworkGuard` applies it with
``nft``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)


class GuardUnavailable(Exception):
    """nftables cannot be used here; the message says what to install or configure."""


def table_name(key: str) -> str:
    """A table name of this agent's own (agents of several deployments may share a host)."""
    return "gpufleet_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def ruleset(
    table: str,
    platform_uid: int,
    protected_ports: Iterable[int],
    rendezvous: Mapping[int, int],
) -> str:
    """The nftables script that replaces ``table`` (port -> uid in ``rendezvous``). Pure."""
    protected = sorted(set(protected_ports))
    lines = [
        f"table inet {table}",  # made if missing, so the delete below always succeeds
        f"delete table inet {table}",
        f"table inet {table} {{",
        "  chain output {",
        "    type filter hook output priority 0; policy accept;",
    ]
    new = "ct state new"
    loopback = 'oifname "lo"'
    if protected:
        ports = ", ".join(str(p) for p in protected)
        lines.append(
            f"    {loopback} {new} meta skuid != {platform_uid} tcp dport {{ {ports} }} "
            "reject with tcp reset"
        )
    for port, uid in sorted(rendezvous.items()):
        lines.append(
            f"    {loopback} {new} meta skuid != {{ {platform_uid}, {uid} }} tcp dport {port} "
            "reject with tcp reset"
        )
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


class NetworkGuard:
    """This agent's table: installed at start, rewritten as jobs come and go, removed at
    the end."""

    def __init__(self, table: str, platform_uid: int, protected_ports: Iterable[int]):
        self.table = table
        self.platform_uid = platform_uid
        self.protected_ports = tuple(protected_ports)
        self.rendezvous: dict[int, int] = {}
        self.nft = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")

    def install(self) -> None:
        """Write the table; raises :class:`GuardUnavailable` when nft cannot."""
        if self.nft is None:
            raise GuardUnavailable(
                "nft (nftables) is not installed: loopback ports are not guarded from "
                "researchers; install nftables (apt-get install nftables)"
            )
        self._apply(ruleset(self.table, self.platform_uid, self.protected_ports, self.rendezvous))

    def allow_rendezvous(self, port: int, uid: int) -> None:
        self.rendezvous[port] = uid
        self.install()

    def forget_rendezvous(self, port: int) -> None:
        if self.rendezvous.pop(port, None) is not None:
            self.install()

    def remove(self) -> None:
        if self.nft is None:
            return
        subprocess.run(
            [self.nft, "delete", "table", "inet", self.table],
            capture_output=True,
            timeout=30,
            check=False,
        )

    def _apply(self, script: str) -> None:
        assert self.nft is not None
        try:
            done = subprocess.run(
                [self.nft, "-f", "-"],
                input=script,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise GuardUnavailable(f"nft could not run: {e}") from e
        if done.returncode != 0:
            raise GuardUnavailable(
                f"nft refused the loopback guard ({done.stderr.strip()[-300:]}); the agent "
                "must run as root (CAP_NET_ADMIN)"
            )
