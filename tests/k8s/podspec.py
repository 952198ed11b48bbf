"""What the test kubelet reads from a pod's manifest, computed without running anything.

Every function here is pure: a manifest (the API's JSON, as dicts) in, a value or a
:class:`PodSpecError` out, so the rules a real kubelet applies can be checked without a
cluster:

- ``$(VAR)`` expansion (:func:`expand`), exactly Kubernetes' (``third_party/forked/golang/
  expansion``): ``$(NAME)`` is replaced by the variable's value where it is defined and left
  as it is where not, ``$$`` is one ``$``. An env value may name variables defined before it
  in the list; command and args may name any variable of the container's environment.
- the container's environment (:func:`container_env`): ``envFrom``, then ``env`` in order,
  with the downward API (``valueFrom.fieldRef``: :func:`field_value`) and keys of Secrets
  and ConfigMaps (looked up through callables, so the caller does the I/O);
- whom a container runs as (:func:`run_as`: the container's securityContext over the
  pod's) and whether ``runAsNonRoot`` refuses it (:func:`run_as_refusal`);
- which devices each container gets (:func:`allocate_devices`), as NVIDIA's device plugin
  and the kubelet's device manager hand them out;
- the pod's phase (:func:`pod_phase`, the kubelet's ``getPhase``) and its conditions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Manifest = Mapping[str, Any]
# A Secret's or ConfigMap's data by name (decoded), or None where there is none.
DataLookup = Callable[[str], Mapping[str, str] | None]

_OPERATOR, _OPENER, _CLOSER = "$", "(", ")"
_KEYED_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


class PodSpecError(Exception):
    """A manifest the test kubelet cannot run; the message says what and why, as the pod's
    (or container's) status shows it."""


class AdmissionError(Exception):
    """The node cannot admit the pod (its devices are taken); the message is the kubelet's."""


# ------------------------------------------------------------------ $(VAR) expansion
def expand(text: str, lookup: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of ``text`` with the variables of ``lookup``."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == _OPERATOR and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            read, is_name, advance = _read_name(text[cursor + 1 :])
            if is_name:
                out.append(lookup.get(read, f"$({read})"))
            else:
                out.append(read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def _read_name(rest: str) -> tuple[str, bool, int]:
    """What follows a ``$``: (text, whether it is a variable's name, characters consumed)."""
    if rest[0] == _OPERATOR:  # "$$": an escaped operator
        return _OPERATOR, False, 1
    if rest[0] == _OPENER:
        close = rest.find(_CLOSER, 1)
        if close != -1:
            return rest[1:close], True, close + 1
        return _OPERATOR + _OPENER, False, 1  # an unclosed reference stays as written
    return _OPERATOR + rest[0], False, 1


# ------------------------------------------------------------------ the environment
def field_value(pod: Manifest, path: str, pod_ip: str, host_ip: str) -> str:
    """The downward API's value of ``path`` (``valueFrom.fieldRef.fieldPath``) for ``pod``,
    which runs at ``pod_ip`` on a node at ``host_ip``."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": host_ip,
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,  # one address per pod here
    }
    if path in simple:
        return str(simple[path])
    keyed = _KEYED_FIELD.fullmatch(path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    raise PodSpecError(f"the downward API field {path!r} is not supported by the test kubelet")


def container_env(
    pod: Manifest,
    container: Manifest,
    *,
    pod_ip: str,
    host_ip: str,
    secret: DataLookup,
    config_map: DataLookup,
) -> dict[str, str]:
    """The variables the manifest gives ``container``, in the kubelet's order: ``envFrom``
    sources, then ``env`` entries, each value expanded against those before it."""
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = _source(source, ("configMapRef", "secretRef"))
        lookup = config_map if kind == "configMapRef" else secret
        data = lookup(str(ref.get("name", "")))
        if data is None:
            if ref.get("optional"):
                continue
            what = "configmap" if kind == "configMapRef" else "secret"
            raise PodSpecError(f'{what} "{ref.get("name", "")}" not found')
        for key, value in data.items():
            env[source.get("prefix", "") + key] = value
    for var in container.get("env") or []:
        name = str(var["name"])
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        found = _value_from(
            pod, var["valueFrom"], namespace, pod_ip, host_ip, secret=secret, config_map=config_map
        )
        if found is not None:
            env[name] = found
    return env


def _source(entry: Manifest, kinds: Sequence[str]) -> tuple[str, Manifest]:
    for kind in kinds:
        if entry.get(kind) is not None:
            return kind, entry[kind]
    raise PodSpecError(f"the test kubelet supports {' and '.join(kinds)} here, not {sorted(entry)}")


def _value_from(
    pod: Manifest,
    value_from: Manifest,
    namespace: str,
    pod_ip: str,
    host_ip: str,
    *,
    secret: DataLookup,
    config_map: DataLookup,
) -> str | None:
    """One ``valueFrom``; None for an optional key that is missing (no variable is set)."""
    kind, ref = _source(value_from, ("fieldRef", "secretKeyRef", "configMapKeyRef"))
    if kind == "fieldRef":
        return field_value(pod, str(ref["fieldPath"]), pod_ip, host_ip)
    name, key = str(ref.get("name", "")), str(ref["key"])
    data = (secret if kind == "secretKeyRef" else config_map)(name)
    what = "Secret" if kind == "secretKeyRef" else "ConfigMap"
    if data is None or key not in data:
        if ref.get("optional"):
            return None
        if data is None:
            raise PodSpecError(f'{what.lower()} "{name}" not found')
        raise PodSpecError(f"couldn't find key {key} in {what} {namespace}/{name}")
    return data[key]


def command_line(container: Manifest, env: Mapping[str, str]) -> list[str]:
    """``command`` then ``args``, expanded against the container's environment. There are no
    images here, so no entrypoint: a container without either cannot run."""
    command = [expand(str(c), env) for c in container.get("command") or []]
    args = [expand(str(a), env) for a in container.get("args") or []]
    if not command and not args:
        raise PodSpecError(
            f"container {container.get('name')!r} has no command: the test kubelet runs no "
            "images, so a container must say what to run (command, or args)"
        )
    return [*command, *args]


# ------------------------------------------------------------------ whom it runs as
@dataclass(frozen=True)
class RunAs:
    """A container's effective securityContext: its own fields over the pod's. ``uid`` and
    ``gid`` None: the image's user, which is root here (no image has another)."""

    uid: int | None
    gid: int | None
    non_root: bool

    @property
    def user(self) -> tuple[int, int]:
        """The uid and gid the process gets (a container's group is 0 unless given)."""
        return (self.uid or 0, self.gid or 0)


def run_as(pod: Manifest, container: Manifest) -> RunAs:
    pod_context = (pod.get("spec") or {}).get("securityContext") or {}
    own = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        return own[key] if own.get(key) is not None else pod_context.get(key)

    uid, gid = pick("runAsUser"), pick("runAsGroup")
    return RunAs(
        None if uid is None else int(uid),
        None if gid is None else int(gid),
        bool(pick("runAsNonRoot")),
    )


def run_as_refusal(pod: Manifest, container: Manifest) -> str | None:
    """The kubelet's CreateContainerConfigError message when ``runAsNonRoot`` forbids the
    container's user (root, or an image's unknown user, which is root here); else None."""
    who = run_as(pod, container)
    if not who.non_root or (who.uid is not None and who.uid != 0):
        return None
    meta = pod.get("metadata") or {}
    ref = f'pod: "{meta.get("name")}_{meta.get("namespace")}({meta.get("uid")})", '
    ref += f"container: {container.get('name')}"
    if who.uid is None:
        return f"container has runAsNonRoot and image will run as root ({ref})"
    return f"container's runAsUser breaks non-root policy ({ref})"


# ------------------------------------------------------------------ devices
def device_request(container: Manifest, resource: str) -> int:
    """How many of ``resource`` the container asks for (an extended resource's limit, which
    is also its request)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(resource)
    if value is None:
        value = (resources.get("requests") or {}).get(resource)
    return 0 if value is None else int(str(value))


def allocate_devices(
    pod: Manifest, served: Mapping[str, Sequence[str]], held: Collection[str]
) -> dict[str, tuple[str, ...]]:
    """The device IDs each container of ``pod`` gets, by container name, from the devices
    this node serves per resource name (``served``) less those other pods hold (``held``).

    As the kubelet's device manager does: the app containers get distinct devices, and an
    init container (which runs before them) reuses the pod's first ones, so the pod holds
    max(sum over app containers, largest init container). Devices are chosen in the order
    served. Raises :class:`AdmissionError` with the kubelet's message when too few are free.
    """
    spec = pod.get("spec") or {}
    inits = list(spec.get("initContainers") or [])
    apps = list(spec.get("containers") or [])
    chosen: dict[str, list[str]] = {str(c["name"]): [] for c in [*inits, *apps]}
    for resource, devices in served.items():
        wanted_apps = [device_request(c, resource) for c in apps]
        wanted_inits = [device_request(c, resource) for c in inits]
        needed = max([sum(wanted_apps), *wanted_inits])
        if needed == 0:
            continue
        free = [d for d in devices if d not in held]
        if needed > len(free):
            raise AdmissionError(
                f"Allocate failed due to requested number of devices unavailable for "
                f"{resource}. Requested: {needed}, Available: {len(free)}, which is unexpected"
            )
        start = 0
        for container, wanted in zip(apps, wanted_apps, strict=True):
            chosen[str(container["name"])] += free[start : start + wanted]
            start += wanted
        for container, wanted in zip(inits, wanted_inits, strict=True):
            chosen[str(container["name"])] += free[:wanted]
    return {name: tuple(ids) for name, ids in chosen.items()}


# ------------------------------------------------------------------ phase and conditions
def pod_phase(
    restart_policy: str,
    init_containers: Sequence[str],
    containers: Sequence[str],
    statuses: Mapping[str, Manifest],
) -> str:
    """The kubelet's ``getPhase``: the pod's phase from its containers' statuses (by name;
    a container without one has not been seen yet)."""
    pending_init = failed_init = 0
    for name in init_containers:
        status = statuses.get(name)
        state = (status or {}).get("state") or {}
        last = ((status or {}).get("lastState") or {}).get("terminated")
        if "terminated" in state:
            failed_init += state["terminated"]["exitCode"] != 0
        elif "waiting" in state and last is not None:
            failed_init += last["exitCode"] != 0
        else:
            pending_init += 1
    unknown = running = waiting = stopped = succeeded = 0
    for name in containers:
        status = statuses.get(name)
        if status is None:
            unknown += 1
            continue
        state = status.get("state") or {}
        if "running" in state:
            running += 1
        elif "terminated" in state:
            stopped += 1
            succeeded += state["terminated"]["exitCode"] == 0
        elif "waiting" in state:
            if (status.get("lastState") or {}).get("terminated") is not None:
                stopped += 1
            else:
                waiting += 1
        else:
            unknown += 1
    if failed_init and restart_policy == "Never":
        return "Failed"
    if pending_init or waiting:
        return "Pending"
    if running and not unknown:
        return "Running"
    if not running and stopped and not unknown:
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def pod_conditions(
    phase: str,
    init_containers: Sequence[str],
    containers: Sequence[str],
    statuses: Mapping[str, Manifest],
) -> dict[str, tuple[str, str, str]]:
    """The kubelet's conditions, ``{type: (status, reason, message)}``: Initialized,
    ContainersReady and Ready (a pod without readiness gates is Ready when its containers
    are)."""

    def succeeded(name: str) -> bool:
        state = (statuses.get(name) or {}).get("state") or {}
        return bool(state.get("terminated", {}).get("exitCode") == 0)

    incomplete = [name for name in init_containers if not succeeded(name)]
    unready = [name for name in containers if not (statuses.get(name) or {}).get("ready")]
    result: dict[str, tuple[str, str, str]] = {}
    if incomplete and phase not in ("Succeeded", "Failed"):
        listed = " ".join(incomplete)
        message = f"containers with incomplete status: [{listed}]"
        result["Initialized"] = ("False", "ContainersNotInitialized", message)
    else:
        result["Initialized"] = ("True", "", "")
    if phase in ("Succeeded", "Failed"):
        ready = ("False", "PodCompleted", "")
    elif unready:
        ready = (
            "False",
            "ContainersNotReady",
            f"containers with unready status: [{' '.join(unready)}]",
        )
    else:
        ready = ("True", "", "")
    result["ContainersReady"] = ready
    result["Ready"] = ready
    return result
