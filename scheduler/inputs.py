"""Reading the simulator's inputs: a job trace (CSV), a fleet and a project tree (YAML).

Trace columns: ``job_id,submit_s,duration_s,num_gpus,group`` and, optionally, ``kind``
(session|job), ``priority``, ``gpu_type`` and ``gpus_per_pod``. ``group`` names the
project; a group that names no project runs as an opportunistic project without a
guarantee (the simulator decides that, not the reader).

Fleet file::

    clusters:
      - name: east
        zones:
          - name: us-east-1a
            pools:
              - {name: a100, count: 16, gpus_per_node: 8, gpu_type: A100-80GB,
                 labels: {network: ib}}

Projects file: ``projects:`` followed by the same entries as ``c.FleetController.projects``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import InputError
from .model import FleetNode, ProjectTree, project_tree

REQUIRED_COLUMNS = ("job_id", "submit_s", "duration_s", "num_gpus", "group")
KINDS = ("session", "job")


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    duration_s: float
    num_gpus: int
    group: str
    kind: str = "job"
    priority: str | None = None
    gpu_type: str | None = None
    gpus_per_pod: int | None = None  # None: the simulator packs whole nodes


# The most seconds a trace time may be (about 317 years): room for Unix times as
# ``submit_s``, and a bound on how far the replay's clock runs (NaN, infinity and
# ``1e400``, which reads as infinity, would run it forever).
MAX_SECONDS = 10**10  # "1e10" in the messages
# A GPU count has at most this many digits (Python's int() refuses past 4,300).
MAX_WHOLE_DIGITS = 16
MAX_SHOWN = 40  # characters of a bad value a message repeats


def _shown(raw: str) -> str:
    return repr(raw if len(raw) <= MAX_SHOWN else raw[: MAX_SHOWN - 1] + "…")


def _seconds(row: Mapping[str, str], column: str, where: str, zero: bool) -> float:
    """A time of the trace: a finite number of seconds up to ``MAX_SECONDS``; 0 only
    where ``zero``."""
    raw = (row.get(column) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not ((value >= 0 if zero else value > 0) and value <= MAX_SECONDS):
        least = "from 0" if zero else "more than 0"
        raise InputError(
            f"{where}: {column} must be a number of seconds {least} up to 1e10 "
            f"(about 317 years), not {_shown(raw)}"
        )
    return value


def _whole(row: Mapping[str, str], column: str, where: str) -> int:
    """A GPU count of the trace: ASCII digits, 1 or more."""
    raw = (row.get(column) or "").strip()
    digits = raw.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise InputError(f"{where}: {column} must be a whole number, not {_shown(raw)}")
    if len(digits) > MAX_WHOLE_DIGITS:
        raise InputError(
            f"{where}: {column} must be a whole number of at most {MAX_WHOLE_DIGITS} digits, "
            f"not {_shown(raw)}"
        )
    if raw.startswith("-") or int(digits) == 0:
        raise InputError(f"{where}: {column} must be positive, not {raw!r}")
    return int(digits)


def _text(path: Path) -> str:
    """The trace's text: UTF-8, a byte-order mark (which spreadsheets write) dropped."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the trace as "
            "CSV in UTF-8"
        ) from None


def read_trace(path: Path) -> list[TraceJob]:
    """Every job of the trace, in file order; the first bad line stops with its number
    (data lines from 2, after the header, in file order)."""
    reader = csv.DictReader(io.StringIO(_text(path), newline=""))
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    header_read = False
    try:
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}: the trace lacks the column(s) {', '.join(missing)}")
        header_read = True
        for line, row in enumerate(reader, start=2):
            jobs.append(_trace_job(row, f"{path}:{line}", seen))
    except csv.Error as e:
        # Each line read became a job: the one the reader choked on is the next.
        line = len(jobs) + 2 if header_read else 1
        raise InputError(f"{path}:{line}: not CSV as the trace needs it: {e}") from None
    return jobs


def _trace_job(row: Mapping[str, str], where: str, seen: set[str]) -> TraceJob:
    job_id = (row["job_id"] or "").strip()
    if not job_id or job_id in seen:
        raise InputError(f"{where}: job_id must be present and unique, not {_shown(job_id)}")
    seen.add(job_id)
    kind = (row.get("kind") or "job").strip()
    if kind not in KINDS:
        raise InputError(f"{where}: kind must be session or job, not {_shown(kind)}")
    per_pod = (row.get("gpus_per_pod") or "").strip()
    return TraceJob(
        job_id=job_id,
        submit_s=_seconds(row, "submit_s", where, zero=True),
        duration_s=_seconds(row, "duration_s", where, zero=False),
        num_gpus=_whole(row, "num_gpus", where),
        group=(row["group"] or "").strip() or "default",
        kind=kind,
        priority=(row.get("priority") or "").strip() or None,
        gpu_type=(row.get("gpu_type") or "").strip() or None,
        gpus_per_pod=_whole(row, "gpus_per_pod", where) if per_pod else None,
    )


def _load_yaml(path: Path, top: str) -> Any:
    try:
        document = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(document, dict) or top not in document:
        raise InputError(f"{path}: expected a mapping with a {top!r} list at the top")
    return document[top]


_FLEET_KEYS = {
    "cluster": {"name", "zones"},
    "zone": {"name", "pools"},
    "pool": {"name", "count", "gpus_per_node", "gpu_type", "labels"},
}


def _known_keys(entry: Any, what: str, where: str) -> None:
    """A cluster, zone or pool entry is a mapping of the keys it may have, and only those:
    a misspelt key would otherwise leave an empty fleet without a word."""
    if not isinstance(entry, dict):
        raise InputError(f"{where}: each {what} is a mapping, not {entry!r}")
    unknown = set(entry) - _FLEET_KEYS[what]
    if unknown:
        raise InputError(
            f"{where}: unknown {what} key(s) {', '.join(sorted(map(str, unknown)))}; a {what} "
            f"has {', '.join(sorted(_FLEET_KEYS[what]))}"
        )


def read_fleet(path: Path) -> list[FleetNode]:
    nodes: list[FleetNode] = []
    for c, cluster in enumerate(_load_yaml(path, "clusters") or []):
        _known_keys(cluster, "cluster", f"{path}: cluster {c}")
        cname = str(cluster.get("name") or f"cluster-{c}")
        for z, zone in enumerate(cluster.get("zones") or []):
            _known_keys(zone, "zone", f"{path}: cluster {cname}, zone {z}")
            zname = str(zone.get("name") or f"zone-{z}")
            for p, pool in enumerate(zone.get("pools") or []):
                where = f"{path}: cluster {cname}, zone {zname}, pool {p}"
                _known_keys(pool, "pool", where)
                count, per_node = pool.get("count"), pool.get("gpus_per_node")
                for value, field_name in ((count, "count"), (per_node, "gpus_per_node")):
                    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                        raise InputError(f"{where}: {field_name} must be a whole number >= 1")
                gpu_type = pool.get("gpu_type")
                if not gpu_type:
                    raise InputError(f"{where}: gpu_type is required")
                prefix = pool.get("name") or f"{cname}-{zname}-{p}"
                labels = {str(k): str(v) for k, v in (pool.get("labels") or {}).items()}
                nodes.extend(
                    FleetNode(f"{prefix}-{i}", cname, zname, str(gpu_type), per_node, labels)
                    for i in range(count)
                )
    if not nodes:
        raise InputError(
            f"{path}: the fleet has no nodes: each cluster lists zones, each zone pools "
            "of {count, gpus_per_node, gpu_type}"
        )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise InputError(f"{path}: two pools give their nodes the same names; name the pools")
    return nodes


def read_projects(path: Path) -> ProjectTree:
    specs = _load_yaml(path, "projects") or []
    if not isinstance(specs, list):
        raise InputError(f"{path}: 'projects' must be a list")
    try:
        return project_tree(specs)
    except InputError as e:
        raise InputError(f"{path}: {e}") from e
