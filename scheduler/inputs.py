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


def _number(row: Mapping[str, str], column: str, where: str, whole: bool = False) -> float:
    raw = (row.get(column) or "").strip()
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise InputError(f"{where}: {column} must be {kind}, not {raw!r}") from None
    if value < 0 or (whole and value == 0 and column != "submit_s"):
        raise InputError(f"{where}: {column} must be positive, not {raw!r}")
    return value


def read_trace(path: Path) -> list[TraceJob]:
    """Every job of the trace, in file order; the first bad line stops with its number."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}: the trace lacks the column(s) {', '.join(missing)}")
        jobs = []
        seen: set[str] = set()
        for line, row in enumerate(reader, start=2):
            where = f"{path}:{line}"
            job_id = (row["job_id"] or "").strip()
            if not job_id or job_id in seen:
                raise InputError(f"{where}: job_id must be present and unique, not {job_id!r}")
            seen.add(job_id)
            kind = (row.get("kind") or "job").strip()
            if kind not in KINDS:
                raise InputError(f"{where}: kind must be session or job, not {kind!r}")
            per_pod = (row.get("gpus_per_pod") or "").strip()
            jobs.append(
                TraceJob(
                    job_id=job_id,
                    submit_s=_number(row, "submit_s", where),
                    duration_s=_number(row, "duration_s", where),
                    num_gpus=int(_number(row, "num_gpus", where, whole=True)),
                    group=(row["group"] or "").strip() or "default",
                    kind=kind,
                    priority=(row.get("priority") or "").strip() or None,
                    gpu_type=(row.get("gpu_type") or "").strip() or None,
                    gpus_per_pod=int(_number(row, "gpus_per_pod", where, whole=True))
                    if per_pod
                    else None,
                )
            )
        return jobs


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
