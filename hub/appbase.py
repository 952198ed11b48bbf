"""The controller's command-line applications' common parts: the one configuration file
(``jupyterhub_config.py``) and the database it names, and ``upgrade-db``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from traitlets import Unicode, default
from traitlets.config import Application

from ..state import db
from .secrets import SecretFileError, read_secret


class ConfigFileMixin(Application):
    """Reads ``jupyterhub_config.py``: one file configures hub, spawner, controller, agent."""

    config_file = Unicode(
        help="The JupyterHub configuration file that also configures gpufleet. "
        "Defaults to $GPUFLEET_CONFIG, else ./jupyterhub_config.py.",
    ).tag(config=True)

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get("GPUFLEET_CONFIG", "jupyterhub_config.py")

    aliases = {"config": "ConfigFileMixin.config_file", "log-level": "Application.log_level"}

    def initialize(self, argv: list[str] | None = None) -> None:
        self.parse_command_line(argv)
        if self.subapp is not None:
            return  # the subcommand initialised itself
        path = os.path.abspath(self.config_file)
        if not os.path.exists(path):
            self.exit_with(f"configuration file {path} does not exist; pass --config PATH")
        self.load_config_file(path)
        self.parse_command_line(argv)  # the command line wins over the file

    def exit_with(self, message: str, code: int = 1) -> None:
        print(f"{self.name}: {message}", file=sys.stderr)
        self.exit(code)


class DatabaseMixin(ConfigFileMixin):
    data_dir = Unicode(
        help="Where the embedded defaults keep their files (SQLite database, snapshots). "
        "Defaults to $GPUFLEET_DATA_DIR, else .gpufleet beside the configuration file.",
    ).tag(config=True)

    @default("data_dir")
    def _default_data_dir(self) -> str:
        # The same default as gpufleet.hub.setup: beside the configuration file.
        beside_config = os.path.join(
            os.path.dirname(os.path.abspath(self.config_file)), ".gpufleet"
        )
        return os.environ.get("GPUFLEET_DATA_DIR", beside_config)

    db_url = Unicode(
        help="SQLAlchemy URL of the controller's database: SQLite (default, a file in "
        "data_dir) or PostgreSQL (postgresql+psycopg://user@host/db). Its password, if "
        "any, goes in db_password_file, never here: this file is readable by anyone.",
    ).tag(config=True)

    db_password_file = Unicode(
        help="A file of mode 0600, owned by the controller's account, holding the "
        "database password of db_url (checked at start).",
    ).tag(config=True)

    @default("db_url")
    def _default_db_url(self) -> str:
        return f"sqlite:///{os.path.join(self.data_dir, 'gpufleet.sqlite')}"

    def make_engine(self) -> Any:
        if self.db_url.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(self.db_url[len("sqlite:///") :]) or ".", exist_ok=True)
        url = make_url(self.db_url)
        if url.password:
            self.exit_with(
                "c.FleetController.db_url holds a password, which the configuration file "
                "shows to anyone who can read it; put the password in a file of mode 0600 "
                "and name it in c.FleetController.db_password_file",
                code=2,
            )
        if self.db_password_file:
            try:
                password = read_secret(Path(self.db_password_file), "the database password file")
            except SecretFileError as e:
                self.exit_with(str(e), code=2)
            return db.make_engine(url.set(password=password).render_as_string(False))
        return db.make_engine(self.db_url)


class UpgradeDB(DatabaseMixin):
    name = "gpufleet-controller upgrade-db"
    description = "Create the gpufleet database, or upgrade it to this version's schema."

    def start(self) -> None:
        # The config file says c.FleetController.db_url; this subcommand reads the same.
        section = self.config.FleetController
        for name in ("data_dir", "db_url", "db_password_file"):
            if name in section:
                setattr(self, name, section[name])
        engine = self.make_engine()
        before = db.current_revision(engine)
        db.upgrade(engine)
        after = db.current_revision(engine)
        where = engine.url.render_as_string(hide_password=True)
        print(f"gpufleet database {where}: {before or 'empty'} -> {after}")
