"""Environment prefixes: finding them, and their specs stored beside each snapshot.

A prefix comes back at the same absolute path, byte for byte, so nothing in it needs
relocating. Its spec is kept so a person can see what was installed, or rebuild it
elsewhere, without restoring it:
- ``conda-explicit``: what ``conda list --explicit --md5`` prints, read from the prefix's
  ``conda-meta/*.json`` records (no conda needed): the platform, then each package's URL
  with its MD5, dependencies before what depends on them;
- ``pip-freeze``: what ``pip freeze --all`` prints, read from the ``*.dist-info`` metadata of
  the site-packages of the prefix's Python (no interpreter is started: a broken environment
  still has one): ``name==version``, ``name @ URL`` for what came from a direct URL (a VCS
  commit, an archive with its hash, a directory), ``-e PATH`` for editable installs.
"""

from __future__ import annotations

import heapq
import json
import os
import platform
import re
from collections import Counter
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def is_prefix(path: Path) -> bool:
    """A conda environment (``conda-meta/``) or a virtualenv (``pyvenv.cfg``)."""
    try:
        return (path / "conda-meta").is_dir() or (path / "pyvenv.cfg").is_file()
    except OSError:  # not ours to look into (another user's, say)
        return False


# ------------------------------------------------------------------ conda
def _conda_records(prefix: Path) -> list[dict[str, Any]]:
    records = []
    for record in sorted((prefix / "conda-meta").glob("*.json")):
        try:
            data = json.loads(record.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            records.append(data)
    return records


_DEPENDENCY_NAME = re.compile(r"\s*(?:[^\s:]*::)?([A-Za-z0-9_.\-]+)")


def _dependencies_first(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in the order conda lists them: each after the packages it depends on, by name
    where the order is free (and where dependencies go round in a cycle)."""
    by_name = {r["name"]: r for r in records}
    needs: dict[str, set[str]] = {}
    for name, record in by_name.items():
        wanted = set()
        for spec in record.get("depends") or ():
            match = _DEPENDENCY_NAME.match(spec) if isinstance(spec, str) else None
            if match and match.group(1) in by_name and match.group(1) != name:
                wanted.add(match.group(1))
        needs[name] = wanted
    needed_by: dict[str, set[str]] = {name: set() for name in by_name}
    for name, wanted in needs.items():
        for dependency in wanted:
            needed_by[dependency].add(name)
    ready = [name for name, wanted in needs.items() if not wanted]
    heapq.heapify(ready)
    ordered: list[str] = []
    left = {name: len(wanted) for name, wanted in needs.items()}
    while len(ordered) < len(by_name):
        if not ready:  # a cycle: break it at its first name
            heapq.heappush(ready, min(n for n, count in left.items() if count > 0))
        name = heapq.heappop(ready)
        if left.get(name) == -1:
            continue
        left[name] = -1
        ordered.append(name)
        for dependent in needed_by[name]:
            if left[dependent] > 0:
                left[dependent] -= 1
                if left[dependent] == 0:
                    heapq.heappush(ready, dependent)
    return [by_name[name] for name in ordered]


def host_subdir() -> str:
    """This machine's conda platform (``linux-64``, ``osx-arm64``, ...)."""
    system = platform.system()
    os_name = {"Linux": "linux", "Darwin": "osx", "Windows": "win"}.get(system, system.lower())
    machine = platform.machine().lower()
    arch = {"x86_64": "64", "amd64": "64", "i386": "32", "i686": "32", "x86": "32"}.get(
        machine, machine
    )
    if os_name == "linux" and arch == "arm64":
        arch = "aarch64"
    return f"{os_name}-{arch}"


def _record_url(record: dict[str, Any]) -> str | None:
    url = record.get("url")
    if isinstance(url, str) and url:
        return url
    channel, subdir, fn = record.get("channel"), record.get("subdir"), record.get("fn")
    if not (isinstance(channel, str) and "://" in channel and isinstance(fn, str) and fn):
        return None  # conda too says it has no URL for such a record
    base = channel.rstrip("/")
    # Conda writes the channel with its subdir (".../conda-forge/linux-64"), rattler without.
    if isinstance(subdir, str) and subdir and not base.endswith("/" + subdir):
        base = f"{base}/{subdir}"
    return f"{base}/{fn}"


def conda_explicit(prefix: Path) -> str | None:
    if not (prefix / "conda-meta").is_dir():
        return None
    records = _dependencies_first(_conda_records(prefix))
    subdirs = Counter(
        r["subdir"]
        for r in records
        if isinstance(r.get("subdir"), str) and r["subdir"] not in ("", "noarch")
    )
    subdir = subdirs.most_common(1)[0][0] if subdirs else host_subdir()
    lines = [
        "# This file may be used to create an environment using:",
        "# $ conda create --name <env> --file <this file>",
        f"# platform: {subdir}",
        "# created-by: gpufleet",
        "@EXPLICIT",
    ]
    for record in records:
        url = _record_url(record)
        if url is None:
            lines.append(f"# no URL for: {record.get('fn') or record['name']}")
            continue
        md5 = record.get("md5")
        lines.append(f"{url}#{md5}" if isinstance(md5, str) and md5 else url)
    return "".join(f"{line}\n" for line in lines)


# -------------------------------------------------------------------- pip
def python_version(prefix: Path) -> str | None:
    """The prefix's Python as ``3.11``: from ``pyvenv.cfg``, else from conda's record."""
    try:
        config = (prefix / "pyvenv.cfg").read_text(errors="replace")
    except OSError:
        config = ""
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            found = re.match(r"\s*(\d+)\.(\d+)", value)
            if found:
                return f"{found.group(1)}.{found.group(2)}"
    for record in sorted((prefix / "conda-meta").glob("python-[0-9]*.json")):
        try:
            data = json.loads(record.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("name") == "python":
            found = re.match(r"(\d+)\.(\d+)", str(data.get("version", "")))
            if found:
                return f"{found.group(1)}.{found.group(2)}"
    return None


def site_packages(prefix: Path) -> list[Path]:
    """The site-packages of the prefix's Python; every one there is when it cannot tell which
    (a Python upgraded in place leaves the old version's directory and what pip put there)."""
    found = sorted(prefix.glob("lib/python3*/site-packages"))
    found += sorted(prefix.glob("lib/pypy3*/site-packages"))
    found += sorted(prefix.glob("Lib/site-packages"))
    found = [p for p in found if p.is_dir()]
    version = python_version(prefix)
    if version is not None:
        names = {f"python{version}", f"python{version}t", f"pypy{version}", "Lib"}
        current = [p for p in found if p.parent.name in names]
        if current:
            return current
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _file_path(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return url
    return unquote(parsed.path)


def _freeze_entry(dist: metadata.Distribution) -> tuple[str, str] | None:
    """The name of one distribution and what ``pip freeze`` prints for it; None for broken
    metadata (no name, or neither a version nor a direct URL)."""
    try:
        fields = dist.metadata
        if fields is None:  # newer Pythons, for a directory with no metadata file
            return None
        # get_all: no warning (or KeyError, on newer Pythons) for a field that is missing
        name, version = (str((fields.get_all(k) or [""])[0]) for k in ("Name", "Version"))
        direct_text = dist.read_text("direct_url.json")
    except (OSError, ValueError):
        return None
    if not name:
        return None
    try:
        direct = json.loads(direct_text) if direct_text else None
    except ValueError:
        direct = None
    url = direct.get("url") if isinstance(direct, dict) else None
    if isinstance(direct, dict) and isinstance(url, str) and url:
        vcs, archive, folder = (direct.get(k) for k in ("vcs_info", "archive_info", "dir_info"))
        if isinstance(folder, dict) and folder.get("editable"):
            return name, (
                f"# Editable install with no version control ({name}=={version})\n"
                f"-e {_file_path(url)}"
            )
        fragments = []
        line = f"{name} @ {url}"
        if isinstance(vcs, dict) and vcs.get("vcs") and vcs.get("commit_id"):
            line = f"{name} @ {vcs['vcs']}+{url}@{vcs['commit_id']}"
        elif isinstance(archive, dict):
            hashes = archive.get("hashes")
            if isinstance(archive.get("hash"), str):
                fragments.append(archive["hash"])
            elif isinstance(hashes, dict) and hashes:
                algorithm = "sha256" if "sha256" in hashes else sorted(hashes)[0]
                fragments.append(f"{algorithm}={hashes[algorithm]}")
        if isinstance(direct.get("subdirectory"), str) and direct["subdirectory"]:
            fragments.append(f"subdirectory={direct['subdirectory']}")
        return name, line + ("#" + "&".join(fragments) if fragments else "")
    if not version:
        return None
    return name, f"{name}=={version}"


def pip_freeze(prefix: Path) -> str | None:
    paths = [str(p) for p in site_packages(prefix)]
    if not paths:
        return None
    entries: dict[str, tuple[str, str]] = {}  # canonical name -> (name, what pip prints)
    for path in paths:
        # In the order of their metadata directories' names, not the file system's.
        found = sorted(
            metadata.distributions(path=[path]), key=lambda d: str(getattr(d, "_path", ""))
        )
        for dist in found:
            entry = _freeze_entry(dist)
            if entry is not None and _canonical(entry[0]) not in entries:
                entries[_canonical(entry[0])] = entry  # the first one found wins, as in pip
    ordered = sorted(entries.values(), key=lambda item: item[0].lower())
    return "".join(f"{entry}\n" for _, entry in ordered)


def spec(prefix: Path) -> dict[str, str]:
    out = {}
    explicit = conda_explicit(prefix)
    if explicit is not None:
        out["conda-explicit"] = explicit
    frozen = pip_freeze(prefix)
    if frozen is not None:
        out["pip-freeze"] = frozen
    return out


# ------------------------------------------------------------ finding them
def conda_environments(homes: Iterable[Path]) -> list[Path]:
    """Prefixes conda itself recorded for these users (``~/.conda/environments.txt``), that
    still exist, wherever they are: inside the home or outside it."""
    found: list[Path] = []
    for home in homes:
        listing = home / ".conda" / "environments.txt"
        try:
            raw = listing.read_bytes()
        except OSError:
            continue
        for line in raw.splitlines():
            text = os.fsdecode(line.strip())  # a path need not be UTF-8
            if not text or not os.path.isabs(text):
                continue
            path = Path(os.path.normpath(text))
            if path not in found and is_prefix(path):
                found.append(path)
    return found


def home_excludes() -> tuple[str, ...]:
    """The defaults for a home: package and model caches (configurable by the admin)."""
    return (
        ".cache/pip",
        ".cache/conda",
        ".conda/pkgs",
        ".cache/huggingface",
        ".cache/torch",
        ".npm/_cacache",
        os.path.join(".local", "share", "Trash"),
    )
