"""Whom researchers' processes run as: a uid of the sandbox range recorded per hub user and
never reused, or the machine's account in system mode; and which sandbox a machine gives."""

from __future__ import annotations

import os
import pwd
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine

from gpufleet.scheduler.errors import InvalidRequest
from gpufleet.snapshotter.sandbox import SandboxMode, SandboxSupport
from gpufleet.spawner.sandboxing import SandboxUnavailable, choose
from gpufleet.state.accounts import check_range, first_free_uid
from gpufleet.state.fleet import FleetStore

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("taken", "expected"),
    [
        ([], 200),
        ([200, 201, 203], 202),
        ([100, 150], 200),
        ([200, 201, 202, 203, 204], None),
        ([199, 200, 205], 201),
    ],
)
def test_the_first_free_uid_of_the_range(taken: list[int], expected: int | None) -> None:
    assert first_free_uid(taken, 200, 204) == expected


def test_a_range_holding_accounts_of_the_machine_is_refused_naming_them() -> None:
    assert check_range(200_000, 299_999, [("root", 0), ("alice", 1000)]) is None
    problem = check_range(1000, 2000, [("root", 0), ("alice", 1000), ("bob", 1001)])
    assert problem is not None and "alice (1000), bob (1001)" in problem
    assert "sandbox_uids" in problem
    assert check_range(0, 10, []) is not None  # never uid 0


def test_accounts_are_given_once_in_order_and_kept(engine: Engine) -> None:
    store = FleetStore(engine, "test")
    assert store.try_acquire_lease(NOW)
    store.accounts.sandbox_uids = (300_000, 300_001)
    alice = store.accounts.account(NOW, "alice")
    bob = store.accounts.account(NOW, "bob")
    assert (alice.uid, alice.gid, alice.mode, alice.home) == (300_000, 300_000, "sandbox", None)
    assert bob.uid == 300_001
    assert store.accounts.account(NOW, "alice") == alice  # the same, every time
    with pytest.raises(InvalidRequest, match="every uid of the sandbox range"):
        store.accounts.account(NOW, "carol")
    assert set(store.accounts.accounts(["alice", "bob", "carol"])) == {"alice", "bob"}


def test_system_mode_uses_the_machines_account_and_refuses_a_missing_one(
    engine: Engine,
) -> None:
    store = FleetStore(engine, "test")
    assert store.try_acquire_lease(NOW)
    store.accounts.user_mode = "system"
    me = pwd.getpwuid(os.getuid())
    if me.pw_uid == 0:
        with pytest.raises(InvalidRequest, match="never run as root"):
            store.accounts.account(NOW, me.pw_name)
    else:
        assert store.accounts.account(NOW, me.pw_name).uid == me.pw_uid
    with pytest.raises(InvalidRequest, match="there is no account nobody-here-x"):
        store.accounts.account(NOW, "nobody-here-x")
    store.accounts.user_mode = "sandbox"
    store.accounts.sandbox_uids = (300_000, 300_010)
    store.accounts.account(NOW, "alice")
    store.accounts.user_mode = "system"
    with pytest.raises(InvalidRequest, match="in sandbox mode"):
        store.accounts.account(NOW, "alice")  # a mode change is an admin's move, not silent


def test_no_sandbox_means_no_session_and_says_what_to_install() -> None:
    none = SandboxSupport(SandboxMode.NONE, "bwrap (bubblewrap) is not installed")
    for setting in ("auto", "overlay", "readonly"):
        with pytest.raises(SandboxUnavailable, match="install bubblewrap"):
            choose(setting, none)
    readonly = SandboxSupport(SandboxMode.READONLY, "", bwrap="/usr/bin/bwrap")
    with pytest.raises(SandboxUnavailable, match="cannot give sessions an overlay root"):
        choose("overlay", readonly)
    assert choose("auto", readonly) is readonly
    overlay = SandboxSupport(SandboxMode.OVERLAY_MOUNT, "", bwrap="/usr/bin/bwrap")
    assert choose("readonly", overlay).mode is SandboxMode.READONLY


def test_the_session_venv_command_runs_base_scripts_under_its_own_python(tmp_path: Path) -> None:
    from gpufleet.spawner.session_venv import command

    base_bin = tmp_path / "bin"
    base_bin.mkdir()
    (base_bin / "jupyterhub-singleuser").write_text("#!/opt/base/bin/python\nimport x\n")
    (base_bin / "python").write_bytes(b"\x7fELF...")
    python = Path("/opt/gpufleet/env/bin/python")
    assert command(python, base_bin, ["jupyterhub-singleuser", "--x"]) == [
        str(python),
        str(base_bin / "jupyterhub-singleuser"),
        "--x",
    ]
    assert command(python, base_bin, ["python", "-c", "1"]) == ["python", "-c", "1"]
    assert command(python, base_bin, ["/bin/true"]) == ["/bin/true"]
