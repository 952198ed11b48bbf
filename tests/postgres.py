"""A real, throwaway PostgreSQL server for the test run (Debian's ``postgresql`` binaries).

``PostgresServer.start()`` runs ``initdb`` and ``postgres`` in a fresh temporary directory,
listening only on 127.0.0.1 on a free port (and on a Unix socket inside that directory), with
password authentication (SCRAM) for the ``postgres`` role and a random password: a session on
the same loopback that finds the port gets nothing without it. ``initdb`` refuses to run as
root, so as root both run as the ``postgres`` system user. Each test gets its own database
(``create_database``), so tests never see each other's rows.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .ports import free_port

SKIP_ENV = "GPUFLEET_SKIP_POSTGRES"
INSTALL_HINT = (
    "PostgreSQL server binaries were not found under /usr/lib/postgresql/<version>/bin. "
    "Install Debian's `postgresql` package (`apt-get install postgresql`; the test command "
    f"installs it), or set {SKIP_ENV}=1 to skip the PostgreSQL tests."
)
SYSTEM_USER = "postgres"  # who runs initdb and postgres when the tests run as root
SUPERUSER = "postgres"  # the database role initdb creates (trust authentication)
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0


class PostgresUnavailable(RuntimeError):
    """The PostgreSQL binaries are not installed; the message says what to install."""


def skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "") == "1"


def find_bindir(root: str = "/usr/lib/postgresql") -> Path:
    """The ``bin`` folder of the highest installed PostgreSQL major version."""
    candidates = []
    for path in glob.glob(os.path.join(root, "*", "bin")):
        version = Path(path).parent.name
        if (Path(path) / "initdb").exists() and (Path(path) / "postgres").exists():
            with contextlib.suppress(ValueError):
                candidates.append((tuple(int(p) for p in version.split(".")), Path(path)))
    if not candidates:
        raise PostgresUnavailable(INSTALL_HINT)
    return max(candidates)[1]


@dataclass
class PostgresServer:
    bindir: Path
    workdir: Path
    port: int
    process: subprocess.Popen[bytes]
    password: str
    _migrated: str = ""  # the database migrated once, which the others copy

    @property
    def log_path(self) -> Path:
        return self.workdir / "postgres.log"

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, attempts: int = 3) -> PostgresServer:
        bindir = find_bindir()
        workdir = Path(tempfile.mkdtemp(prefix="gpufleet-pg-"))
        try:
            run_as = _run_as_kwargs(workdir)
            data = workdir / "data"
            password = uuid.uuid4().hex
            password_file = workdir / "password"
            password_file.write_text(password + "\n")
            if run_as:
                os.chown(password_file, run_as["user"], run_as["group"])
            password_file.chmod(0o600)
            initdb = subprocess.run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-A",
                    "scram-sha-256",
                    f"--pwfile={password_file}",
                    "-U",
                    SUPERUSER,
                    "-E",
                    "UTF8",
                    "--no-locale",
                    "--no-sync",
                ],
                cwd=workdir,
                env=_env(),
                capture_output=True,
                timeout=START_DEADLINE_S,
                check=False,
                **run_as,
            )
            if initdb.returncode != 0:
                raise RuntimeError(
                    f"initdb failed ({initdb.returncode}):\n"
                    f"{initdb.stdout.decode(errors='replace')}\n"
                    f"{initdb.stderr.decode(errors='replace')}"
                )
            last_error = ""
            for _ in range(attempts):  # the free port may be taken before postgres binds it
                port = free_port()
                server = cls(
                    bindir, workdir, port, cls._spawn(bindir, workdir, port, run_as), password
                )
                try:
                    server._wait_ready()
                    return server
                except _StartFailed as e:
                    last_error = str(e)
                    server._terminate()
            raise RuntimeError(f"PostgreSQL did not start after {attempts} tries:\n{last_error}")
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    @staticmethod
    def _spawn(
        bindir: Path, workdir: Path, port: int, run_as: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        sockets = workdir / "sockets"
        sockets.mkdir(exist_ok=True)
        if run_as:
            shutil.chown(sockets, SYSTEM_USER, SYSTEM_USER)
        log = (workdir / "postgres.log").open("ab")
        try:
            return subprocess.Popen(
                [
                    str(bindir / "postgres"),
                    "-D",
                    str(workdir / "data"),
                    "-p",
                    str(port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    f"unix_socket_directories={sockets}",
                    # A throwaway server: durability buys nothing and costs seconds.
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                ],
                cwd=workdir,
                env=_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **run_as,
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        last = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise _StartFailed(
                    f"postgres exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as e:
                last = str(e)
            time.sleep(0.05)  # poll interval, bounded by the deadline above
        raise _StartFailed(
            f"postgres did not accept connections within {START_DEADLINE_S:.0f} s "
            f"({last}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------- databases
    def dsn(self, dbname: str) -> str:
        return (
            f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={dbname} "
            f"password={self.password}"
        )

    def url(self, dbname: str) -> str:
        """A SQLAlchemy URL for ``dbname`` on this server (with its password)."""
        return f"postgresql+psycopg://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, prefix: str = "t", template: str = "") -> str:
        """Create a fresh database, empty or a copy of ``template``; returns its name."""
        name = f"{prefix}_{uuid.uuid4().hex[:16]}"
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(statement)
        return name

    def create_migrated_database(self) -> str:
        """A fresh database migrated to this version's head: a copy of one migrated once
        per server (the migrations take a tenth of a second or more, a copy a few ms)."""
        if not self._migrated:
            from gpufleet.state import db

            self._migrated = self.create_database("head")
            engine = db.make_engine(self.url(self._migrated))
            try:
                db.upgrade(engine)
            finally:
                engine.dispose()  # a template must have no connection while it is copied
        return self.create_database(template=self._migrated)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        try:
            self._terminate()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # "fast" shutdown
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_DEADLINE_S)


class _StartFailed(RuntimeError):
    pass


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def _run_as_kwargs(workdir: Path) -> dict[str, Any]:
    """As root, run as the ``postgres`` system user (initdb refuses root) and let it own
    ``workdir``; otherwise run as ourselves."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam(SYSTEM_USER)
    except KeyError as e:
        raise PostgresUnavailable(
            f"running as root, but there is no {SYSTEM_USER!r} system user to run PostgreSQL "
            "as; install Debian's `postgresql` package, which creates it"
        ) from e
    os.chown(workdir, user.pw_uid, user.pw_gid)
    os.chmod(workdir, 0o700)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
