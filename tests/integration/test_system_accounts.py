"""``user_mode = "system"``: each researcher's sessions and job ranks run as their own Unix
account, in the same sandbox, with their own home (mode 0700).

The fixture makes two real accounts with ``useradd`` (unique names, removed afterwards with
their homes) and a hub whose projects include them."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.client import Client

from .harness import Hub, run_in_kernel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="making accounts (useradd) needs root"),
]


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[str, str]]:
    if shutil.which("useradd") is None:
        pytest.fail("useradd is missing (Debian's passwd package)", pytrace=False)
    tag = secrets.token_hex(3)
    names = (f"gft{tag}a", f"gft{tag}b")
    for name in names:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    try:
        yield names
    finally:
        for name in names:
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)
            subprocess.run(["userdel", "--remove", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def system_hub(
    tmp_path_factory: pytest.TempPathFactory, accounts: tuple[str, str]
) -> Iterator[Hub]:
    first, second = accounts
    hub = Hub.create(
        Path(tmp_path_factory.mktemp("system-accounts")),
        extra_config=(
            'c.FleetController.user_mode = "system"\n'
            f'c.JupyterHub.load_groups["vision"]["users"] += [{first!r}, {second!r}]\n'
        ),
    )
    hub.start()
    try:
        yield hub
    finally:
        hub.kill_everything()


PROBE = """
import json, os, pathlib, pwd
other = {other!r}
try:
    os.listdir(other)
    other_home = "listed"
except OSError as e:
    other_home = type(e).__name__
print(json.dumps({{
    "uid": os.getuid(), "name": pwd.getpwuid(os.getuid()).pw_name, "home": os.environ["HOME"],
    "other_home": other_home, "pids_of_others": [
        p for p in os.listdir("/proc") if p.isdigit() and p != "1"
        and os.stat(f"/proc/{{p}}").st_uid != os.getuid()
    ],
}}))
"""


def test_sessions_and_ranks_run_as_each_researchers_own_account(
    system_hub: Hub, accounts: tuple[str, str]
) -> None:
    first, second = accounts
    entry = pwd.getpwnam(first)
    system_hub.start_session(first, project="vision", gpu_type="A100-80GB", gpus=1)
    system_hub.start_session(second, project="vision", gpu_type="A100-80GB", gpus=1)
    other_home = pwd.getpwnam(second).pw_dir
    seen = json.loads(
        run_in_kernel(
            system_hub, first, "", PROBE.format(other=other_home), system_hub.user_token(first)
        )
    )
    assert (seen["uid"], seen["name"], seen["home"]) == (entry.pw_uid, first, entry.pw_dir)
    assert seen["other_home"] in ("FileNotFoundError", "PermissionError")
    assert seen["pids_of_others"] == []
    for name in accounts:
        home = Path(pwd.getpwnam(name).pw_dir)
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert home.stat().st_uid == pwd.getpwnam(name).pw_uid

    script = PROBE.format(other=other_home).replace(
        "print(json.dumps(", "print('SEEN', json.dumps("
    )
    with Client(system_hub.controller_api, system_hub.user_token(first)) as client:
        job = client.submit(script, gpus=1, gpu_type="A100-80GB", project="vision")
        ended = client.wait(job.id, timeout=180)
        output = "".join(client.logs(job.id, rank=0))
    assert ended.outcome == "succeeded", ended.reason
    rank = json.loads(next(line for line in output.splitlines() if line.startswith("SEEN "))[5:])
    assert (rank["uid"], rank["name"], rank["home"]) == (entry.pw_uid, first, entry.pw_dir)
    assert rank["other_home"] in ("FileNotFoundError", "PermissionError")
    assert rank["pids_of_others"] == []


def test_a_hub_user_without_an_account_is_told_so(system_hub: Hub) -> None:
    response = system_hub.spawn("alice", project="vision", gpu_type="A100-80GB", gpus=1)
    assert response.status_code >= 400
    assert "there is no account alice on this machine" in response.text
