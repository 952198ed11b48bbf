"""A test kubelet pod's volumes on the host, and where each container sees them.

There is no storage provisioner and no volume plugin: a volume is a directory of this
machine, bound into the container's sandbox at each ``volumeMount``'s ``mountPath``.

- ``hostPath``: the host's path (``type`` honoured: ``DirectoryOrCreate``/``FileOrCreate``
  make it, ``Directory``/``File``/... require it; no type makes a missing directory, as
  Docker does);
- ``emptyDir``: a directory of the pod's own (mode 0777, as the kubelet makes it), removed
  with the pod; ``medium: Memory`` is a directory too;
- ``persistentVolumeClaim``: the claim's bound PersistentVolume, which must be a static one
  whose source is ``hostPath`` or ``local`` (there is nothing else to mount);
- ``secret`` and ``configMap``: their keys (or ``items``) written as files into a directory
  of the pod's own, shown read-only;
- ``projected``: its ``configMap``, ``secret`` and ``downwardAPI`` sources' files in one
  such directory (the downward API's ``fieldRef``s of the pod's own metadata: its name,
  namespace, uid, and its labels' or annotations' values, one or all). The downward API's
  files follow the pod's labels and annotations while it runs (:func:`refresh_downward`),
  each replaced whole, as the kubelet's atomic writer does.

Any other kind fails the pod (:class:`VolumeUnsupported`); a claim that is not bound yet, or
an object the node may not read yet (the Node authorizer learns of a pod's references a
moment after it is bound), is retried (:class:`VolumeNotReady`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .podspec import DataLookup, Manifest, PodSpecError

SUPPORTED = ("hostPath", "emptyDir", "persistentVolumeClaim", "secret", "configMap", "projected")
_KINDS = (
    *SUPPORTED,
    "projected",
    "downwardAPI",
    "nfs",
    "csi",
    "ephemeral",
    "iscsi",
    "gitRepo",
)
_MUST_EXIST = {"Directory", "File", "Socket", "CharDevice", "BlockDevice"}
# What each secret or configMap file is without defaultMode (the API's default, 0644).
_DEFAULT_MODE = 0o644


class VolumeUnsupported(PodSpecError):
    """A volume the test kubelet cannot mount, ever: the pod fails with this message."""


class VolumeNotReady(Exception):
    """A volume that cannot be mounted yet (an unbound claim, a missing object): retried."""


@dataclass(frozen=True)
class VolumeLookups:
    """The API objects a pod's volumes name, looked up in its namespace by the caller:
    a claim or a PersistentVolume (None where there is none), a Secret's or a ConfigMap's
    data (decoded)."""

    claim: Callable[[str], Manifest | None]
    persistent_volume: Callable[[str], Manifest | None]
    secret: DataLookup
    config_map: DataLookup


@dataclass(frozen=True)
class Volume:
    """A pod's volume as a host path; ``read_only``: every mount of it is read-only."""

    path: Path
    read_only: bool = False


@dataclass(frozen=True)
class Mount:
    """Where a container sees a host path, and whether it may write there."""

    source: Path
    destination: Path
    read_only: bool


def volume_kind(volume: Manifest) -> str:
    for kind in _KINDS:
        if kind in volume:
            return kind
    return next((key for key in volume if key != "name"), "unknown")


def prepare_volumes(pod: Manifest, directory: Path, lookups: VolumeLookups) -> dict[str, Volume]:
    """Every volume of ``pod`` as a host path, by name; a pod's own directories (emptyDir,
    secret and configMap files) are made under ``directory``. Blocking."""
    result: dict[str, Volume] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = str(volume["name"])
        kind = volume_kind(volume)
        if kind not in SUPPORTED:
            raise VolumeUnsupported(
                f'volume "{name}" is of kind {kind}: the test kubelet mounts only '
                "hostPath, emptyDir, persistentVolumeClaim (bound to a static hostPath or local "
                "PersistentVolume), secret, configMap and projected volumes"
            )
        own = directory / name
        source: Manifest = volume[kind] or {}
        if kind == "hostPath":
            result[name] = Volume(_host_path(name, source))
        elif kind == "emptyDir":
            own.mkdir(parents=True, exist_ok=True)
            os.chmod(own, 0o777)  # whoever the containers run as may write there
            result[name] = Volume(own)
        elif kind == "persistentVolumeClaim":
            result[name] = _claimed(name, source, lookups)
        elif kind == "projected":
            default = int(source.get("defaultMode", _DEFAULT_MODE))
            for part in source.get("sources") or []:
                [(part_kind, part_source)] = part.items()
                part_source = {"defaultMode": default, **(part_source or {})}
                if part_kind == "downwardAPI":
                    _write_downward(own, pod, part_source)
                elif part_kind in ("secret", "configMap"):
                    _write_object(own, name, part_kind, part_source, lookups)
                else:
                    raise VolumeUnsupported(
                        f'projected volume "{name}": the test kubelet projects only '
                        f"configMap, secret and downwardAPI sources, not {part_kind}"
                    )
            result[name] = Volume(own, read_only=True)
        else:
            _write_object(own, name, kind, source, lookups)
            result[name] = Volume(own, read_only=True)
    return result


def _write_object(
    own: Path, name: str, kind: str, source: Manifest, lookups: VolumeLookups
) -> None:
    """A Secret's or a ConfigMap's files (a volume's, or a projected volume's source)."""
    # A projected source names its Secret "name"; a volume of its own, "secretName".
    object_name = str(source.get("secretName") or source.get("name") or "")
    data = (lookups.secret if kind == "secret" else lookups.config_map)(object_name)
    if data is None and not source.get("optional"):
        raise VolumeNotReady(f'{kind} "{object_name}" of volume "{name}" not found')
    _write_files(own, data or {}, source)


def _write_downward(directory: Path, pod: Manifest, source: Manifest) -> None:
    """The downward API's files of the pod's own metadata, as the kubelet writes them."""
    metadata = pod.get("metadata") or {}
    default = int(source.get("defaultMode", _DEFAULT_MODE))
    for item in source.get("items") or []:
        field_path = str((item.get("fieldRef") or {}).get("fieldPath", ""))
        whole, _, key = field_path.partition("[")
        if whole in ("metadata.labels", "metadata.annotations"):
            values = metadata.get(whole.removeprefix("metadata.")) or {}
            if key:
                text = str(values.get(key.rstrip("]").strip("'\""), ""))
            else:
                text = "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        elif field_path in ("metadata.name", "metadata.namespace", "metadata.uid"):
            text = str(metadata.get(field_path.removeprefix("metadata.")) or "")
        else:
            raise VolumeUnsupported(
                f"downwardAPI item {item.get('path')!r}: the test kubelet gives only the "
                f"pod's metadata (name, namespace, uid, labels, annotations), not {field_path}"
            )
        target = directory / _inside(str(item["path"]), f"item {item['path']!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o755)
        if target.exists() and target.read_text(errors="surrogateescape") == text:
            continue
        # Whole or not at all: a reader never sees half a file.
        written = target.with_name(f".{target.name}.new")
        written.write_text(text, encoding="utf-8", errors="surrogateescape")
        os.chmod(written, int(item.get("mode", default)))
        os.replace(written, target)


def refresh_downward(pod: Manifest, directory: Path) -> None:
    """Bring the downward API's files of the pod's projected volumes (under ``directory``,
    as :func:`prepare_volumes` made them) up to date with its metadata now."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        source = volume.get("projected")
        if not source:
            continue
        default = int(source.get("defaultMode", _DEFAULT_MODE))
        for part in source.get("sources") or []:
            if "downwardAPI" in part:
                own = directory / str(volume["name"])
                _write_downward(own, pod, {"defaultMode": default, **part["downwardAPI"]})


def _host_path(name: str, source: Manifest) -> Path:
    path = Path(str(source.get("path", "")))
    if not path.is_absolute():
        raise VolumeUnsupported(f'hostPath volume "{name}" needs an absolute path, not {path}')
    kind = source.get("type") or ""
    if kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind in ("", "DirectoryOrCreate") and not path.exists():
        path.mkdir(mode=0o755, parents=True)
    elif kind in _MUST_EXIST and not path.exists():
        raise VolumeNotReady(f'hostPath volume "{name}": {kind} {path} does not exist')
    return path


def _claimed(name: str, source: Manifest, lookups: VolumeLookups) -> Volume:
    claim_name = str(source.get("claimName", ""))
    claim = lookups.claim(claim_name)
    if claim is None:
        raise VolumeNotReady(f'persistentvolumeclaim "{claim_name}" not found')
    bound = (claim.get("spec") or {}).get("volumeName")
    if not bound or (claim.get("status") or {}).get("phase") != "Bound":
        raise VolumeNotReady(f'persistentvolumeclaim "{claim_name}" is not bound yet')
    volume = lookups.persistent_volume(str(bound))
    if volume is None:
        raise VolumeNotReady(f'persistentvolume "{bound}" of claim "{claim_name}" not found')
    spec: Mapping[str, Any] = volume.get("spec") or {}
    for kind in ("hostPath", "local"):
        if kind in spec:
            path = Path(str(spec[kind].get("path", "")))
            if not path.is_dir() and not path.is_file():
                raise VolumeNotReady(f'persistentvolume "{bound}": {path} does not exist')
            return Volume(path, read_only=bool(source.get("readOnly")))
    kinds = sorted(set(spec) - {"capacity", "accessModes", "claimRef", "storageClassName"})
    raise VolumeUnsupported(
        f'volume "{name}": persistentvolume "{bound}" is not a hostPath or local volume '
        f"({', '.join(kinds) or 'no source'}); the test kubelet has nothing else to mount"
    )


def _write_files(directory: Path, data: Mapping[str, str], source: Manifest) -> None:
    """A Secret's or ConfigMap's keys as files (``items`` choose and rename them)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    default = int(source.get("defaultMode", _DEFAULT_MODE))
    items = source.get("items")
    chosen = (
        [(str(i["key"]), str(i["path"]), int(i.get("mode", default))) for i in items]
        if items
        else [(key, key, default) for key in data]
    )
    for key, relative, mode in chosen:
        if key not in data:
            continue
        target = directory / _inside(relative, f"item {key!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[key].encode(errors="surrogateescape"))
        os.chmod(target, mode)


def _inside(relative: str, what: str) -> PurePosixPath:
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts:
        raise VolumeUnsupported(f"{what}: {relative!r} must be a relative path without '..'")
    return path


def container_mounts(container: Manifest, volumes: Mapping[str, Volume]) -> tuple[Mount, ...]:
    """Where ``container`` sees the pod's volumes (``volumeMounts``; ``subPath`` is a
    directory inside the volume, made if missing), shallowest mount path first, so that a
    mount inside another lands on top of it (among the read-write mounts and among the
    read-only ones: the sandbox binds all read-write ones first)."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        name = str(mount["name"])
        if name not in volumes:
            raise VolumeUnsupported(f'volumeMount "{name}" names no volume of the pod')
        volume = volumes[name]
        source = volume.path
        if mount.get("subPath"):
            source = source / _inside(str(mount["subPath"]), f'subPath of "{name}"')
            if not source.exists():
                source.mkdir(mode=0o777, parents=True)
        destination = Path(str(mount["mountPath"]))
        if not destination.is_absolute():
            raise VolumeUnsupported(f'volumeMount "{name}": {destination} is not absolute')
        read_only = volume.read_only or bool(mount.get("readOnly"))
        mounts.append(Mount(source, destination, read_only))
    return tuple(sorted(mounts, key=lambda m: len(m.destination.parts)))
