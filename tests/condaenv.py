"""Real conda environments and virtualenvs, built offline for the snapshot tests.

Conda: a few tiny packages (``.conda`` archives with ``info/index.json``, ``info/paths.json``
and ``info/files``, made with conda-package-handling) go into a local channel, which
py-rattler indexes (``repodata.json``), solves against and installs from, through a
``file://`` URL: no network, no conda. conda-index would need conda itself, which is not
installable from the Python package registry, so rattler's indexer takes its place.

The packages carry what real ones do: an executable script in ``bin/`` whose text holds
conda's prefix placeholder (the installer writes the environment's own path there), a data
file, relative symlinks (a library's ``.so`` name and a second command), and a dependency
between two packages (one ``noarch``, one for this platform), so the solver has work to do.

Virtualenvs: ``python -m venv --without-pip``, then this interpreter's pip installs a tiny
wheel built here (with a console script) from a local folder, ``--no-index``.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import traceback
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from conda_package_handling import api as cph
from rattler import Channel, Gateway, install, solve
from rattler.index import index_fs
from rattler.platform import Subdir

PLACEHOLDER = "/opt/anaconda1anaconda2anaconda3"  # conda's prefix placeholder


@dataclass(frozen=True)
class PackageFile:
    """One path of a package: content (text with the placeholder when ``has_prefix``), or a
    relative symlink when ``link`` is set."""

    path: str
    content: bytes = b""
    mode: int = 0o644
    link: str = ""
    has_prefix: bool = False


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    files: tuple[PackageFile, ...]
    depends: tuple[str, ...] = ()
    build_number: int = 0
    noarch: bool = True  # else built for this platform's subdir

    @property
    def subdir(self) -> str:
        return "noarch" if self.noarch else platform_subdir()

    @property
    def build(self) -> str:
        return f"h{hashlib.sha256(self.name.encode()).hexdigest()[:8]}_{self.build_number}"

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}-{self.build}.conda"


def platform_subdir() -> str:
    return str(Subdir.current())


def demo_packages() -> list[Package]:
    """``gpufleet-lib`` (this platform: a versioned library and its ``.so`` link) and
    ``gpufleet-hello`` (noarch, depends on it: a command reading files by absolute path)."""
    lib = Package(
        name="gpufleet-lib",
        version="1.2.0",
        noarch=False,
        files=(
            PackageFile("lib/libgpufleet.so.1", b"\x7fELF not really\x00\x01\x02" * 40),
            PackageFile("lib/libgpufleet.so", link="libgpufleet.so.1"),
            PackageFile("include/gpufleet.h", b"int gpufleet_answer(void);\n"),
        ),
    )
    script = (
        "#!/bin/sh\n"
        "# installed by conda: the prefix below was written in at install time\n"
        f'prefix="{PLACEHOLDER}"\n'
        'test -e "$prefix/lib/libgpufleet.so" || { echo "no library" >&2; exit 3; }\n'
        'cat "$prefix/share/gpufleet-hello/greeting.txt"\n'
    )
    hello = Package(
        name="gpufleet-hello",
        version="0.3.1",
        depends=("gpufleet-lib >=1.2",),
        files=(
            PackageFile("bin/gpufleet-hello", script.encode(), mode=0o755, has_prefix=True),
            PackageFile("bin/hello", link="gpufleet-hello"),
            PackageFile("share/gpufleet-hello/greeting.txt", b"hello from a conda env\n"),
            PackageFile("share/gpufleet-hello/empty.dat", b""),
            PackageFile(
                "etc/gpufleet-hello.conf", f"prefix={PLACEHOLDER}\n".encode(), has_prefix=True
            ),
        ),
    )
    return [lib, hello]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_package(package: Package, out_dir: Path, work: Path) -> Path:
    """The package as a ``.conda`` archive in ``out_dir``."""
    root = work / f"{package.name}-{package.version}"
    root.mkdir(parents=True)
    contents = {f.path: f.content for f in package.files if not f.link}
    paths = []
    for f in package.files:
        target = root / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.link:
            os.symlink(f.link, target)
            pointed = os.path.normpath(os.path.join(os.path.dirname(f.path), f.link))
            data = contents[pointed]
            entry: dict[str, object] = {"_path": f.path, "path_type": "softlink"}
        else:
            target.write_bytes(f.content)
            target.chmod(f.mode)
            data = f.content
            entry = {"_path": f.path, "path_type": "hardlink"}
            if f.has_prefix:
                entry |= {"file_mode": "text", "prefix_placeholder": PLACEHOLDER}
        entry |= {"sha256": _sha256(data), "size_in_bytes": len(data)}
        paths.append(entry)
    info = root / "info"
    info.mkdir()
    index: dict[str, object] = {
        "name": package.name,
        "version": package.version,
        "build": package.build,
        "build_number": package.build_number,
        "depends": list(package.depends),
        "license": "BSD-3-Clause",
        "subdir": package.subdir,
        "timestamp": 1_764_500_000_000,
    }
    if package.noarch:
        index["noarch"] = "generic"
    else:
        platform, _, arch = package.subdir.partition("-")
        index |= {"platform": platform, "arch": {"64": "x86_64"}.get(arch, arch)}
    (info / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (info / "paths.json").write_text(json.dumps({"paths": paths, "paths_version": 1}, indent=2))
    (info / "files").write_text("".join(f"{f.path}\n" for f in package.files))
    prefixed = [f for f in package.files if f.has_prefix]
    if prefixed:  # the older record of the same, still read by some tools
        (info / "has_prefix").write_text(
            "".join(f"{PLACEHOLDER} text {f.path}\n" for f in prefixed)
        )
    listed = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    cph.create(str(root), listed, package.filename, out_folder=str(out_dir))
    return out_dir / package.filename


@dataclass(frozen=True)
class CondaChannel:
    path: Path
    packages: tuple[Package, ...]
    archives: dict[str, Path]  # package name -> its archive in the channel

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def md5(self, name: str) -> str:
        return hashlib.md5(self.archives[name].read_bytes()).hexdigest()

    def package_url(self, name: str) -> str:
        archive = self.archives[name]
        return f"{self.url}/{archive.parent.name}/{archive.name}"


def make_channel(root: Path, packages: Sequence[Package]) -> CondaChannel:
    """Build ``packages`` into a channel at ``root`` and index it."""
    channel = root / "channel"
    (channel / "noarch").mkdir(parents=True)
    (channel / platform_subdir()).mkdir(exist_ok=True)
    archives = {}
    for package in packages:
        archives[package.name] = build_package(package, channel / package.subdir, root / "build")
    _rattler_in_child("index", str(channel))
    return CondaChannel(channel, tuple(packages), archives)


def create_env(channel: CondaChannel, prefix: Path, specs: Sequence[str], cache: Path) -> None:
    """Solve ``specs`` against the channel alone and install them into ``prefix`` (files are
    hard links into the package cache ``cache``, as conda makes them)."""
    _rattler_in_child("install", channel.url, str(prefix), str(cache), *specs)


def _rattler_in_child(action: str, *args: str) -> None:
    """Run one of py-rattler's async calls (``_child``) in a child process that leaves by
    ``os._exit``. Its runtime threads can crash the interpreter as it finalizes, after the
    work is done: "PyGILState_Release: thread state ... must be current when releasing",
    a silent SIGABRT or SIGSEGV in about one run of twenty here. In the test process that
    would fail the whole run; in a session's setup script, the test that ran it."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import condaenv; condaenv._child(sys.argv[1], sys.argv[2:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, action, *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"rattler {action} {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
        )


def _child(action: str, args: list[str]) -> None:
    code = 1
    try:
        if action == "index":
            asyncio.run(index_fs(Path(args[0]), write_zst=False, write_shards=False, force=True))
        else:
            url, prefix, cache, *specs = args
            asyncio.run(_solve_and_install(url, Path(prefix), specs, Path(cache)))
        code = 0
    except BaseException:  # noqa: BLE001 -- reported to the parent, which raises
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not through finalization: see _rattler_in_child


async def _solve_and_install(url: str, prefix: Path, specs: list[str], cache: Path) -> None:
    records = await solve(
        [Channel(url)],
        specs,
        gateway=Gateway(cache_dir=cache / "repodata"),
        platforms=[Subdir.current(), Subdir("noarch")],
    )
    await install(records, prefix, cache_dir=cache / "pkgs", show_progress=False)


# ----------------------------------------------------------------- virtualenvs
def build_wheel(out_dir: Path, name: str = "gpufleet-tiny", version: str = "0.4.2") -> Path:
    """A pure-Python wheel with a module and a console script, built by hand."""
    dist = name.replace("-", "_")
    files = {
        f"{dist}/__init__.py": (
            f'__version__ = "{version}"\n\n\ndef main() -> None:\n    print("{name} {version}")\n'
        ).encode(),
        f"{dist}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: a test wheel\n"
        ).encode(),
        f"{dist}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: gpufleet-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
        f"{dist}-{version}.dist-info/entry_points.txt": (
            f"[console_scripts]\n{name} = {dist}:main\n"
        ).encode(),
    }
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([path, f"sha256={digest}", len(data)])
    record_path = f"{dist}-{version}.dist-info/RECORD"
    writer.writerow([record_path, "", ""])
    files[record_path] = record.getvalue().encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, date_time=(2025, 11, 30, 12, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return wheel


def create_venv(prefix: Path, wheels: Path, requirement: str) -> None:
    """A virtualenv at ``prefix`` with ``requirement`` installed from the folder ``wheels``
    (by name, as from an index: no direct URL is recorded)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(prefix / "bin" / "python"),
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--find-links",
            str(wheels),
            requirement,
        ],
        check=True,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
