"""How the node agent finds a container's layer, against real overlay mounts in mount
namespaces of their own (agent/layers.py, snapshotter/node_operations.py): the layer a
container really has is found; one a hostile user makes up (an overlay of their own
whose ``upperdir`` string names another's directory on the host) is refused, as is one
outside the runtime's directories. Needs root (mount namespaces and overlayfs), as the
agent does."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.agent.layers import find_container_layer
from gpufleet.recovery.processes import MARKER_VARIABLE
from gpufleet.snapshotter.node_operations import LayerRefused

from .harness import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


class Container:
    """A process with its own mount namespace whose /usr is an overlay, carrying a marker."""

    def __init__(self, mounts: str):
        self.marker = secrets.token_hex(8)
        script = f"set -e\n{mounts}\necho mounted\nexec sleep 300\n"
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", MARKER_VARIABLE: self.marker},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip() == "mounted", self.process.stderr.read() if self.process.stderr else ""
        # The shell has exec'd sleep: the mount table is the one it will keep.
        wait_for(
            lambda: "sleep" in Path(f"/proc/{self.process.pid}/cmdline").read_text(),
            10,
            "the container's process",
        )

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def layer_dirs(base: Path, name: str) -> tuple[Path, Path]:
    """``<base>/<name>/upper`` with its ``usr`` part, and the matching work directory."""
    upper, work = base / name / "upper", base / name / "work"
    (upper / "usr").mkdir(parents=True)
    (work / "usr").mkdir(parents=True)
    return upper, work


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    """The container runtime's directory of layers."""
    root = tmp_path / "runtime"
    root.mkdir()
    yield root


def test_the_layer_a_container_has_is_found_and_read_from_the_host(runtime: Path) -> None:
    upper, work = layer_dirs(runtime, "c1")
    container = Container(
        f"mount -t overlay overlay -o lowerdir=/usr,upperdir={upper}/usr,"
        f"workdir={work}/usr /usr\n"
        "touch /usr/installed-by-the-user"
    )
    try:
        assert find_container_layer(container.marker, [str(runtime)]) == str(upper)
        assert (upper / "usr" / "installed-by-the-user").exists()
        # The probe the check made is gone again.
        assert [p.name for p in (upper / "usr").iterdir()] == ["installed-by-the-user"]
    finally:
        container.stop()


def test_an_overlay_whose_upperdir_names_another_directory_of_the_host_is_refused(
    runtime: Path,
) -> None:
    # The victim's layer, on the host; the user's own directory, which the user binds over
    # the victim's path inside their namespace, and mounts as the upper directory there:
    # the mount table then says upperdir=<the victim's path>.
    victim, _ = layer_dirs(runtime, "victim")
    (victim / "usr" / "secret").write_text("the victim's")
    layer_dirs(runtime, "own")
    container = Container(
        f"mount --bind {runtime}/own {runtime}/victim\n"
        f"mount -t overlay overlay -o lowerdir=/usr,upperdir={victim}/usr,"
        f"workdir={runtime}/victim/work/usr /usr"
    )
    try:
        with pytest.raises(LayerRefused, match="is not what the container sees"):
            find_container_layer(container.marker, [str(runtime)])
        assert [p.name for p in (victim / "usr").iterdir()] == ["secret"]
    finally:
        container.stop()


def test_a_layer_outside_the_runtimes_directories_is_refused(runtime: Path, tmp_path: Path) -> None:
    upper, work = layer_dirs(tmp_path, "elsewhere")
    container = Container(
        f"mount -t overlay overlay -o lowerdir=/usr,upperdir={upper}/usr,workdir={work}/usr /usr"
    )
    try:
        with pytest.raises(LayerRefused, match=r"c\.NodeAgent\.container_layer_roots"):
            find_container_layer(container.marker, [str(runtime)])
    finally:
        container.stop()


def test_a_container_with_no_overlay_has_no_layer(runtime: Path) -> None:
    container = Container("true")
    try:
        assert find_container_layer(container.marker, [str(runtime)]) is None
    finally:
        container.stop()
