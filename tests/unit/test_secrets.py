"""The platform's secrets are files only its account may read, checked at every start; the
database's password never sits in the configuration file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.hub.secrets import SecretFileError, check_secret_file, read_secret, secret_file

from .test_controller_cli import run, write_config


def test_a_secret_is_made_mode_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "data" / "token"
    first = secret_file(path, "the token")
    assert len(first) == 64 and (path.stat().st_mode & 0o777) == 0o600
    assert secret_file(path, "the token") == first


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_others_may_read_is_refused_with_the_command_that_fixes_it(
    tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "key"
    path.write_text("s3cret\n")
    path.chmod(mode)
    with pytest.raises(SecretFileError, match=f"chmod 600 {path}") as refused:
        read_secret(path, "the snapshot master key")
    assert f"mode {mode:04o}" in str(refused.value)
    assert "s3cret" not in str(refused.value)


def test_a_secret_owned_by_another_account_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another account")
    path = tmp_path / "key"
    path.write_text("x")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(SecretFileError, match="belongs to uid 65534"):
        check_secret_file(path, "the key")


def test_a_missing_secret_is_named(tmp_path: Path) -> None:
    with pytest.raises(SecretFileError, match=r"the password file .* does not exist"):
        read_secret(tmp_path / "nope", "the password file")


def test_the_controller_refuses_a_password_in_db_url_and_a_readable_password_file(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    base = config.read_text()
    config.write_text(
        base + "c.FleetController.db_url = 'postgresql+psycopg://gpufleet:hunter2@127.0.0.1/x'\n"
    )
    result = run("--config", str(config))
    assert result.returncode == 2
    assert "db_password_file" in result.stderr and "hunter2" not in result.stderr
    password = tmp_path / "db-password"
    password.write_text("hunter2\n")
    password.chmod(0o644)
    config.write_text(
        base
        + "c.FleetController.db_url = 'postgresql+psycopg://gpufleet@127.0.0.1/x'\n"
        + f"c.FleetController.db_password_file = {str(password)!r}\n"
    )
    result = run("--config", str(config))
    assert result.returncode == 2
    assert f"chmod 600 {password}" in result.stderr and "hunter2" not in result.stderr


def test_a_readable_master_key_stops_the_controller(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    key = tmp_path / "master.key"
    key.write_text("a" * 44 + "\n")
    key.chmod(0o640)
    config.write_text(config.read_text() + f"c.SnapshotSettings.key_file = {str(key)!r}\n")
    result = run("--config", str(config))
    assert result.returncode == 2
    assert f"chmod 600 {key}" in result.stderr
