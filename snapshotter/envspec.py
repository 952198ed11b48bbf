"""Environment prefixes: finding them, and their specs stored beside each snapshot.

A prefix comes back at the same absolute path, byte for byte, so nothing in it needs
relocating. Its spec is kept so a person can see what was installed, or rebuild it
elsewhere, without restoring it:
- ``conda-explicit``: what ``conda list --explicit --md5`` prints, read from the prefix's
  ``conda-meta/*.json`` records (no conda needed);
- ``pip-freeze``: what ``pip freeze`` prints, read from the ``*.dist-info`` metadata of the
  prefix's site-packages (no interpreter is started: a broken environment still has one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def is_prefix(path: Path) -> bool:
    """A conda environment (``conda-meta/``) or a virtualenv (``pyvenv.cfg``)."""
    return (path / "conda-meta").is_dir() or (path / "pyvenv.cfg").is_file()


def conda_explicit(prefix: Path) -> str | None:
    meta = prefix / "conda-meta"
    if not meta.is_dir():
        return None
    lines = []
    for record in sorted(meta.glob("*.json")):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        url = data.get("url") or ""
        if not url:
            channel, fn = data.get("channel", ""), data.get("fn", "")
            url = f"{channel.rstrip('/')}/{data.get('subdir', '')}/{fn}" if channel and fn else ""
        if url:
            md5 = data.get("md5")
            lines.append(f"{url}#{md5}" if md5 else url)
    return "# platform: recorded by gpufleet\n@EXPLICIT\n" + "".join(f"{x}\n" for x in lines)


def site_packages(prefix: Path) -> list[Path]:
    found = sorted(prefix.glob("lib/python3*/site-packages"))
    found += sorted(prefix.glob("Lib/site-packages"))
    return [p for p in found if p.is_dir()]


def pip_freeze(prefix: Path) -> str | None:
    paths = [str(p) for p in site_packages(prefix)]
    if not paths:
        return None
    lines = set()
    for dist in metadata.distributions(path=paths):
        name = dist.metadata["Name"]
        if not name:
            continue
        direct = dist.read_text("direct_url.json")
        if direct:
            try:
                url = json.loads(direct).get("url")
            except ValueError:
                url = None
            if url:
                lines.add(f"{name} @ {url}")
                continue
        lines.add(f"{name}=={dist.version}")
    return "".join(f"{x}\n" for x in sorted(lines, key=str.lower))


def spec(prefix: Path) -> dict[str, str]:
    out = {}
    explicit = conda_explicit(prefix)
    if explicit is not None:
        out["conda-explicit"] = explicit
    frozen = pip_freeze(prefix)
    if frozen is not None:
        out["pip-freeze"] = frozen
    return out


def conda_environments(homes: Iterable[Path]) -> list[Path]:
    """Prefixes conda itself recorded for these users (``~/.conda/environments.txt``), that
    still exist."""
    found: list[Path] = []
    for home in homes:
        listing = home / ".conda" / "environments.txt"
        try:
            lines = listing.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            path = Path(line.strip())
            if line.strip() and path.is_absolute() and is_prefix(path) and path not in found:
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
