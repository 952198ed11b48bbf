"""Two deployments on one machine never hold overlapping sandbox uid ranges at once
(hub/uid_claims.py): a claim is a file of the registry locked by its live controller."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.hub.uid_claims import (
    REGISTRY_SETTING,
    SETTING,
    Claim,
    ClaimError,
    claim,
    conflict_message,
    conflicts,
    deployment_identity,
    free_range,
    held_claims,
    overlaps,
)

from .test_controller_cli import run, write_config

OTHER_DB = "sqlite:////srv/other/gpufleet.sqlite"


def mine(
    first: int = 200_000, last: int = 299_999, deployment: str = "sqlite:////srv/mine.db"
) -> Claim:
    return Claim(first, last, deployment, "/srv/mine", os.getpid())


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((200_000, 299_999), (299_999, 300_000), True),  # one shared uid is enough
        ((200_000, 299_999), (300_000, 399_999), False),
        ((250_000, 250_000), (200_000, 299_999), True),
        ((100_000, 199_999), (200_000, 299_999), False),
    ],
)
def test_ranges_overlap_when_they_share_a_uid(
    a: tuple[int, int], b: tuple[int, int], expected: bool
) -> None:
    assert overlaps(a, b) is expected
    assert overlaps(b, a) is expected


def test_only_another_deployments_overlapping_claim_conflicts() -> None:
    same = Claim(250_000, 250_100, "sqlite:////srv/mine.db", "/srv/mine", 11, "/r/a.claim")
    apart = Claim(300_000, 399_999, OTHER_DB, "/srv/other", 12, "/r/b.claim")
    inside = Claim(299_000, 299_999, OTHER_DB, "/srv/other", 13, "/r/c.claim")
    assert conflicts(mine(), [same, apart, inside]) == [inside]


def test_the_suggested_range_avoids_every_claim_and_account() -> None:
    taken = [(200_000, 299_999), (300_000, 300_000), (300_500, 310_000)]
    assert free_range(100, taken, 200_000) == (300_001, 300_100)
    assert free_range(1000, taken, 200_000) == (310_001, 311_000)
    assert free_range(2**31, taken) is None


def test_the_refusal_names_the_other_deployment_and_the_setting() -> None:
    other = Claim(200_000, 299_999, OTHER_DB, "/srv/other", 4242, "/r/x.claim")
    message = conflict_message(mine(), [other], (300_000, 399_999))
    assert "200000-299999 by the deployment whose data directory is /srv/other" in message
    assert "pid 4242" in message
    assert f"choose {SETTING} outside it, for example [300000, 399999]" in message


def test_one_database_is_one_deployment_however_its_path_is_written(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    assert deployment_identity(f"sqlite:///{tmp_path}/data/fleet.sqlite") == deployment_identity(
        f"sqlite:///{tmp_path}/link/../data/../link/fleet.sqlite"
    )
    assert deployment_identity(f"sqlite:///{tmp_path}/data/a.sqlite") != deployment_identity(
        f"sqlite:///{tmp_path}/data/b.sqlite"
    )
    pg = "postgresql+psycopg://gpufleet:secret@db.example:5432/fleet?sslpassword=hush"
    written = deployment_identity(pg)
    assert written == deployment_identity(pg.replace(":secret", ":rotated"))
    assert written != deployment_identity(pg.replace("/fleet", "/other"))
    # Every account reads the claims: nothing of the URL is in them.
    assert not any(part in written for part in ("gpufleet", "db.example", "secret", "hush"))


# ------------------------------------------------------------------ the registry
HOLDER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from gpufleet.hub.uid_claims import Claim, claim
    registry, first, last, deployment, data_dir = sys.argv[1:]
    held = claim(Path(registry), Claim(int(first), int(last), deployment, data_dir, os.getpid()))
    print(held.claim.path, flush=True)
    sys.stdin.read()  # holds the claim until the test closes stdin or kills it
    """
)


class Holder:
    """Another process that claims a range and holds it until it is stopped."""

    def __init__(self, registry: Path, first: int, last: int, deployment: str, data_dir: str):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HOLDER,
                str(registry),
                str(first),
                str(last),
                deployment,
                data_dir,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.path = Path(self.proc.stdout.readline().strip())  # printed once the lock is held
        assert self.path.name, self.proc.communicate(timeout=30)[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # a crash: no clean-up of its own runs
        self.proc.communicate(timeout=30)


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    return tmp_path / "run" / "gpufleet" / "sandbox-uids"


@pytest.fixture
def other(registry: Path) -> Iterator[Holder]:
    holder = Holder(registry, 200_000, 299_999, OTHER_DB, "/srv/other")
    yield holder
    if holder.proc.poll() is None:
        holder.kill()


def test_a_range_held_by_another_live_deployment_is_refused_until_it_exits(
    registry: Path, other: Holder
) -> None:
    with pytest.raises(ClaimError) as refused:
        claim(registry, mine(250_000, 250_999))
    assert refused.value.setting == SETTING
    assert "whose data directory is /srv/other" in str(refused.value)
    assert f"pid {other.proc.pid}" in str(refused.value)
    assert "for example [300000, 300999]" in str(refused.value)
    assert not [p for p in registry.iterdir() if p != other.path]  # nothing of the refused

    other.kill()
    held = claim(registry, mine(250_000, 250_999))
    assert not other.path.exists()  # the crashed controller's stale file went with it
    assert [c.pid for c in held_claims(registry)] == [os.getpid()]
    held.release()
    assert held_claims(registry) == []


def test_the_same_deployment_and_a_range_apart_may_run_beside_a_held_claim(
    registry: Path, other: Holder
) -> None:
    # A rolling update: a second controller of the same database, the same range.
    twin = claim(registry, Claim(200_000, 299_999, OTHER_DB, "/srv/other", os.getpid()))
    apart = claim(registry, mine(300_000, 399_999))
    assert sorted(c.pid for c in held_claims(registry)) == sorted(
        [other.proc.pid, os.getpid(), os.getpid()]
    )
    twin.release()
    apart.release()
    assert [c.pid for c in held_claims(registry)] == [other.proc.pid]


def test_the_registry_is_made_readable_by_every_deployment(registry: Path) -> None:
    old = os.umask(0o077)
    try:
        held = claim(registry, mine())
    finally:
        os.umask(old)
    for path in (registry, registry.parent, Path(held.claim.path)):
        assert stat.S_IMODE(path.stat().st_mode) in (0o755, 0o644), path
    held.release()


def test_a_registry_that_cannot_be_made_names_the_option_to_change(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ClaimError) as refused:
        claim(tmp_path / "file" / "sandbox-uids", mine())
    assert refused.value.setting == REGISTRY_SETTING
    assert f"{tmp_path}/file/sandbox-uids" in str(refused.value)


AS_NOBODY = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from gpufleet.hub.uid_claims import Claim, ClaimError, claim
    registry, first, last = sys.argv[1:]
    try:
        claim(Path(registry), Claim(int(first), int(last), "other", "/srv/other", os.getpid()))
    except ClaimError as e:
        print(e.setting, e)
    """
)


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def claim_as_nobody(registry: Path, first: int, last: int) -> str:
    """What another deployment's controller, running as uid 65534, is told."""
    argv = [sys.executable, "-c", AS_NOBODY, str(registry), str(first), str(last)]
    done = subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_a_controller_that_is_not_root_sees_the_claims_but_adds_none() -> None:
    base = Path(tempfile.mkdtemp())  # not under pytest's own directory, which is root's alone
    base.chmod(0o755)
    registry = base / "sandbox-uids"
    held = claim(registry, mine())
    try:
        seen = claim_as_nobody(registry, 250_000, 250_999)
        assert seen.startswith(f"{SETTING} the sandbox uid range 250000-250999 overlaps")
        refused = claim_as_nobody(registry, 300_000, 300_999)
        assert refused.startswith(f"{REGISTRY_SETTING} cannot claim")
        assert f"install -d -m 0755 -o 65534 {registry}" in refused
        assert [c.pid for c in held_claims(registry)] == [os.getpid()]
    finally:
        held.release()
        shutil.rmtree(base)


# ------------------------------------------------------------------ the controller
def test_the_controller_refuses_a_range_another_deployment_holds(
    tmp_path: Path, registry: Path, other: Holder
) -> None:
    config = write_config(tmp_path, tmp_path / "fleet.sqlite")
    with config.open("a") as f:
        f.write(
            f"c.FleetController.sandbox_uid_registry = {str(registry)!r}\n"
            "c.FleetController.sandbox_uids = [290000, 309999]\n"
        )
    result = run("--config", str(config))
    assert result.returncode == 2, result.stderr
    assert (
        "c.FleetController.sandbox_uids: the sandbox uid range 290000-309999 overlaps another "
        "deployment's on this machine, held: 200000-299999 by the deployment whose data "
        "directory is /srv/other"
    ) in result.stderr
    assert "for example [300000, 319999]" in result.stderr
    assert list(registry.iterdir()) == [other.path]
