"""Environment prefixes through a snapshot and back: real conda environments and virtualenvs.

The conda environments are made offline (``tests/condaenv.py``): tiny packages in a local
channel, solved and installed by py-rattler, so the prefix holds what a real one does —
``conda-meta/*.json`` records, files hard-linked from a package cache, relative symlinks, a
script whose text the installer rewrote with the prefix's own path. The virtualenvs are
``python -m venv`` with a wheel built here installed by pip from a local folder.

Each test snapshots prefixes into a local repository, deletes them, restores them at the same
absolute paths and compares them with what they were, byte for byte, mode for mode; the
specs stored beside them are checked against the channel's archives and against the output
of ``pip freeze`` itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rattler.explicit_environment import ExplicitEnvironmentSpec

from gpufleet.snapshotter import envspec
from gpufleet.snapshotter.capture import SourceSpec, create_snapshot
from gpufleet.snapshotter.crypto import new_master_key
from gpufleet.snapshotter.manifest import Manifest, SourceKind
from gpufleet.snapshotter.repository import Repository
from gpufleet.snapshotter.restore import restore_snapshot
from gpufleet.snapshotter.store import LocalStore

from ..condaenv import (
    CondaChannel,
    build_wheel,
    create_env,
    create_venv,
    demo_packages,
    make_channel,
    platform_subdir,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

Listing = dict[str, tuple[object, ...]]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def channel(tmp_path_factory: pytest.TempPathFactory) -> CondaChannel:
    """The packages built and indexed once (a few tens of milliseconds)."""
    return make_channel(tmp_path_factory.mktemp("conda"), demo_packages())


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    build_wheel(folder)
    return folder


@pytest.fixture
def repository(tmp_path: Path) -> Repository:
    return Repository.open(LocalStore(tmp_path / "store"), "vision", new_master_key())


@pytest.fixture
def conda_env(tmp_path: Path, channel: CondaChannel) -> Iterator[Path]:
    prefix = tmp_path / "opt" / "envs" / "ml"
    create_env(channel, prefix, ["gpufleet-hello"], tmp_path / "pkgs")
    yield prefix


@pytest.fixture
def venv(tmp_path: Path, wheels: Path) -> Path:
    prefix = tmp_path / "venvs" / "tool"
    create_venv(prefix, wheels, "gpufleet-tiny")
    return prefix


# ---------------------------------------------------------------- helpers
def listing(root: Path) -> Listing:
    """Everything under ``root`` (not ``root`` itself): type, mode, size, content hash or
    link target, modification time."""
    out: Listing = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_mtime_ns)
            else:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                out[rel] = (
                    "file",
                    stat.S_IMODE(st.st_mode),
                    st.st_uid,
                    st.st_size,
                    digest,
                    st.st_mtime_ns,
                )
    return out


def prefix_source(prefix: Path) -> SourceSpec:
    return SourceSpec(f"env:{prefix}", prefix, SourceKind.PREFIX, spec=envspec.spec(prefix))


def stored(repository: Repository, user: str = "ann") -> Manifest:
    """The latest manifest as read back from the store, not the one create_snapshot returned."""
    ref = repository.latest(user, "")
    assert ref is not None
    return repository.read_manifest(ref)


def run(*command: str | Path) -> str:
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, check=False, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def pip_freeze_all(prefix: Path) -> str:
    """What pip itself prints for the prefix's interpreter."""
    return run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        prefix / "bin" / "python",
        "freeze",
        "--all",
        "--disable-pip-version-check",
    )


def dist_info(site: Path, name: str, version: str | None, direct_url: object = None) -> None:
    """A distribution's metadata as an installer leaves it."""
    folder = site / f"{name.replace('-', '_')}-{version or '0'}.dist-info"
    folder.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}"]
    if version is not None:
        lines.append(f"Version: {version}")
    (folder / "METADATA").write_text("\n".join(lines) + "\n")
    (folder / "INSTALLER").write_text("pip\n")
    if direct_url is not None:
        (folder / "direct_url.json").write_text(json.dumps(direct_url))


# ------------------------------------------------------------------- tests
def test_conda_env_and_virtualenv_come_back_at_their_paths_byte_for_byte(
    tmp_path: Path, repository: Repository, conda_env: Path, venv: Path
) -> None:
    before = {conda_env: listing(conda_env), venv: listing(venv)}
    assert any(v[0] == "link" for v in before[conda_env].values())  # conda envs have symlinks
    assert before[venv]["bin/python"][0] == "link"
    cache = tmp_path / "statcache"
    first = create_snapshot(
        repository, [prefix_source(conda_env), prefix_source(venv)], user="ann", cache_dir=cache
    )
    assert first.stats.files > 0

    shutil.rmtree(conda_env)
    shutil.rmtree(venv)
    shutil.rmtree(tmp_path / "pkgs")  # the package cache its files were hard links into
    manifest = stored(repository)
    assert [s.kind for s in manifest.sources] == [SourceKind.PREFIX, SourceKind.PREFIX]
    restore_snapshot(repository, manifest, cache_dir=cache)  # no targets: the same paths

    assert listing(conda_env) == before[conda_env]
    assert listing(venv) == before[venv]
    assert sorted(p.name for p in (conda_env / "conda-meta").glob("*.json")) == sorted(
        f"{p.filename.removesuffix('.conda')}.json" for p in demo_packages()
    )
    # The scripts run from the restored prefixes: the paths written into them hold again.
    assert run(conda_env / "bin" / "gpufleet-hello") == "hello from a conda env\n"
    assert run(conda_env / "bin" / "hello") == "hello from a conda env\n"
    assert (conda_env / "etc" / "gpufleet-hello.conf").read_text() == f"prefix={conda_env}\n"
    assert run(venv / "bin" / "gpufleet-tiny") == "gpufleet-tiny 0.4.2\n"
    assert run(venv / "bin" / "python", "-c", "import sys; print(sys.prefix)") == f"{venv}\n"

    # The restore left a stat cache: the next snapshot reads nothing and finds the same trees.
    second = create_snapshot(
        repository, [prefix_source(conda_env), prefix_source(venv)], user="ann", cache_dir=cache
    )
    assert second.stats.reused_files == second.stats.files == first.stats.files
    assert [s.tree for s in second.sources] == [s.tree for s in first.sources]


def test_the_manifest_keeps_each_prefix_spec(
    repository: Repository, channel: CondaChannel, conda_env: Path, venv: Path
) -> None:
    create_snapshot(repository, [prefix_source(conda_env), prefix_source(venv)], user="ann")
    conda_source, venv_source = stored(repository).sources
    assert set(conda_source.spec) == {"conda-explicit"}  # no Python in it: nothing for pip
    assert dict(venv_source.spec) == {"pip-freeze": "gpufleet-tiny==0.4.2\n"}
    assert venv_source.spec["pip-freeze"] == pip_freeze_all(venv)

    explicit = conda_source.spec["conda-explicit"]
    lines = explicit.splitlines()
    assert f"# platform: {platform_subdir()}" in lines
    packages = lines[lines.index("@EXPLICIT") + 1 :]
    # Each package's URL in the channel and the MD5 of its archive; dependencies first.
    assert packages == [
        f"{channel.package_url(name)}#{channel.md5(name)}"
        for name in ("gpufleet-lib", "gpufleet-hello")
    ]
    # Readable as an explicit environment by other tools (rattler here).
    parsed = ExplicitEnvironmentSpec.from_str(explicit)
    assert str(parsed.platform) == platform_subdir()
    assert [p.url for p in parsed.packages] == packages


def test_pip_freeze_of_a_virtualenv_matches_pip_itself(
    tmp_path: Path, wheels: Path, venv: Path
) -> None:
    other = build_wheel(tmp_path / "more", "Other_Pkg", "1.0")
    subprocess.run(  # by path: pip records a direct URL with the archive's hash
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            str(other),
        ],
        check=True,
    )
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    dist_info(site, "edpkg", "2.0", {"url": "file:///src/ed%20pkg", "dir_info": {"editable": True}})
    dist_info(site, "dirpkg", "4.0", {"url": "file:///src/dirpkg", "dir_info": {}})
    dist_info(
        site,
        "vcspkg",
        "3.0",
        {
            "url": "https://github.com/a/b.git",
            "vcs_info": {"vcs": "git", "commit_id": "abc123", "requested_revision": "main"},
            "subdirectory": "sub",
        },
    )
    dist_info(site, "Weird_Name.Dots", "1.0")
    (site / "broken-1.0.dist-info").mkdir()  # no METADATA: pip skips it, so does the spec

    frozen = envspec.pip_freeze(venv)
    # A dist-info without METADATA: pip 23 leaves it out, pip 26 lists it from the folder's
    # name; the spec leaves it out (nothing in it says what was installed).
    by_pip = pip_freeze_all(venv).replace("broken==1.0\n", "")
    assert frozen == by_pip
    assert "broken" not in frozen
    assert "gpufleet-tiny==0.4.2\n" in frozen
    assert f"Other_Pkg @ {other.as_uri()}#sha256=" in frozen
    assert "vcspkg @ git+https://github.com/a/b.git@abc123#subdirectory=sub\n" in frozen
    assert "-e /src/ed pkg\n" in frozen


def test_leftovers_of_an_older_python_and_broken_metadata_are_not_listed(venv: Path) -> None:
    """A Python upgraded in place leaves its old site-packages and what pip put there; the
    interpreter the prefix has now does not see them, and neither does pip freeze."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    old = venv / "lib" / f"python3.{sys.version_info.minor - 1}" / "site-packages"
    dist_info(old, "stale", "0.1")
    current = venv / "lib" / f"python{version}" / "site-packages"
    dist_info(current, "noversion", None)  # pip freeze fails outright on this one
    (current / "badjson-1.0.dist-info").mkdir()
    (current / "badjson-1.0.dist-info" / "METADATA").write_text("Name: badjson\nVersion: 1.0\n")
    (current / "badjson-1.0.dist-info" / "direct_url.json").write_text("{not json")

    assert envspec.site_packages(venv) == [current]
    assert envspec.pip_freeze(venv) == "badjson==1.0\ngpufleet-tiny==0.4.2\n"


def test_a_conda_env_with_odd_records_still_has_a_spec(conda_env: Path) -> None:
    meta = conda_env / "conda-meta"
    (meta / "truncated-1.0-0.json").write_text('{"name": "trunc')
    (meta / "alist-1.0-0.json").write_text("[1, 2]")
    # Records as conda writes them when the URL is gone: channel with subdir, or a bare name.
    (meta / "zlib-1.3-h0.json").write_text(
        json.dumps(
            {
                "name": "zlib",
                "version": "1.3",
                "build": "h0",
                "subdir": "linux-64",
                "fn": "zlib-1.3-h0.conda",
                "channel": "https://conda.anaconda.org/conda-forge/linux-64",
                "md5": "0" * 32,
                "depends": [],
            }
        )
    )
    (meta / "local-1.0-0.json").write_text(
        json.dumps({"name": "local", "fn": "local-1.0-0.tar.bz2", "channel": "<unknown>"})
    )
    # A dependency cycle does not lose anyone.
    for name, needs in (("cyc-a", "cyc-b >=1"), ("cyc-b", "conda-forge::cyc-a")):
        (meta / f"{name}-1-0.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "url": f"https://x.org/c/noarch/{name}-1-0.conda",
                    "depends": [needs],
                }
            )
        )

    packages = envspec.conda_explicit(conda_env)
    assert packages is not None
    body = packages.split("@EXPLICIT\n", 1)[1].splitlines()
    assert "https://conda.anaconda.org/conda-forge/linux-64/zlib-1.3-h0.conda#" + "0" * 32 in body
    assert "# no URL for: local-1.0-0.tar.bz2" in body
    assert {
        "https://x.org/c/noarch/cyc-a-1-0.conda",
        "https://x.org/c/noarch/cyc-b-1-0.conda",
    } < set(body)
    assert len(body) == 6
    assert body.index(next(b for b in body if "gpufleet-lib" in b)) < body.index(
        next(b for b in body if "gpufleet-hello" in b)
    )

    # Only noarch packages: the platform is this machine's, as conda names it.
    noarch_only = conda_env.parent / "noarch-only"
    (noarch_only / "conda-meta").mkdir(parents=True)
    shutil.copy(meta / "cyc-a-1-0.json", noarch_only / "conda-meta")
    assert f"# platform: {platform_subdir()}\n" in (envspec.conda_explicit(noarch_only) or "")


def test_an_env_outside_the_home_is_found_and_comes_back_with_the_home(
    tmp_path: Path, repository: Repository, channel: CondaChannel, venv: Path
) -> None:
    """The case of a user's conda environment created outside their home: conda recorded
    it in ``~/.conda/environments.txt``, and the snapshot of the session takes it along."""
    home = tmp_path / "home" / "ann"
    (home / ".conda").mkdir(parents=True)
    (home / "notes.txt").write_text("my notes\n")
    outside = tmp_path / "scratch" / "envs" / "x"
    create_env(channel, outside, ["gpufleet-hello"], tmp_path / "pkgs")
    inside = home / "miniconda3" / "envs" / "y"
    create_env(channel, inside, ["gpufleet-lib"], tmp_path / "pkgs")
    # A path that is not UTF-8 (rattler refuses to install there): an empty environment,
    # as `conda create -n NAME` without packages leaves it.
    odd = tmp_path / os.fsdecode(b"scratch/envs/caf\xe9")
    (odd / "conda-meta").mkdir(parents=True)
    (odd / "conda-meta" / "history").write_text("")
    gone = tmp_path / "scratch" / "envs" / "removed"
    (home / ".conda" / "environments.txt").write_bytes(
        b"\n".join(
            [
                os.fsencode(outside),
                os.fsencode(inside) + b"\r",
                b"",
                b"relative/envs/z",
                os.fsencode(gone),
                os.fsencode(outside) + b"/",
                os.fsencode(venv),
                os.fsencode(odd),
                os.fsencode(tmp_path / "scratch" / "envs" / ".." / "envs" / "x"),
            ]
        )
        + b"\n"
    )
    found = envspec.conda_environments([home, tmp_path / "home" / "nobody"])
    assert found == [outside, inside, venv, odd]

    # What a session snapshot takes: the home as a tree (environments in it included),
    # and every environment outside it as a prefix.
    prefixes = [p for p in found if not p.is_relative_to(home)]
    before = {p: listing(p) for p in [home, *prefixes]}
    sources = [SourceSpec("home", home, exclude=envspec.home_excludes())]
    sources += [prefix_source(p) for p in prefixes]
    create_snapshot(repository, sources, user="ann")
    for path in [home, *prefixes]:
        shutil.rmtree(path)
    shutil.rmtree(tmp_path / "pkgs")

    manifest = stored(repository)
    restore_snapshot(repository, manifest)
    for path, was in before.items():
        assert listing(path) == was, path
    assert envspec.conda_environments([home]) == [outside, inside, venv, odd]
    assert run(outside / "bin" / "hello") == "hello from a conda env\n"
    by_path = {s.path: s for s in manifest.sources}
    assert channel.package_url("gpufleet-hello") in by_path[str(outside)].spec["conda-explicit"]
    assert by_path[str(venv)].spec == {"pip-freeze": "gpufleet-tiny==0.4.2\n"}


def test_restore_brings_back_the_prefix_directory_own_mode_and_mtime(
    tmp_path: Path, repository: Repository, conda_env: Path
) -> None:
    os.chmod(conda_env, 0o750)
    os.utime(conda_env, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    was = os.lstat(conda_env)
    create_snapshot(repository, [prefix_source(conda_env)], user="ann")
    shutil.rmtree(conda_env)
    restore_snapshot(repository, stored(repository))
    now = os.lstat(conda_env)
    assert (stat.S_IMODE(now.st_mode), now.st_mtime_ns) == (
        stat.S_IMODE(was.st_mode),
        was.st_mtime_ns,
    )
