"""Validation of a request for GPUs against what the fleet offers the user (pure).

Every rejection says what to change. Nothing is recorded for a rejected request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import InvalidRequest


@dataclass(frozen=True)
class ProfileRule:
    gpu_types: tuple[str, ...] = ()  # empty: any type
    projects: tuple[str, ...] = ()  # empty: any project
    is_default: bool = False


@dataclass(frozen=True)
class Catalogue:
    """What a user may ask for: GPU types with the most GPUs one node has of each."""

    largest_node: Mapping[str, int]
    user_projects: frozenset[str]
    profiles: Mapping[str, ProfileRule] = field(default_factory=dict)
    # For jobs: the most GPUs of each type one zone has (a gang never spans zones), and
    # the priority classes a job may ask for.
    largest_zone: Mapping[str, int] = field(default_factory=dict)
    priority_classes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SessionRequest:
    username: str
    server_name: str
    project: str
    gpu_type: str
    gpus: object  # as received: validated here, so a form's "two" gets a clear message
    profile: str | None = None


@dataclass(frozen=True)
class ValidRequest:
    project: str
    gpu_type: str
    gpus: int
    profile: str | None


def parse_gpu_count(value: object) -> int:
    if isinstance(value, bool):
        raise InvalidRequest("the GPU count must be a whole number such as 1 or 2")
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        count = int(value.strip())
    else:
        raise InvalidRequest(f"the GPU count must be a whole number such as 1 or 2, not {value!r}")
    if count < 1:
        raise InvalidRequest(f"ask for at least 1 GPU (got {count})")
    return count


def _check_membership(username: str, project: str, catalogue: Catalogue) -> None:
    if not catalogue.user_projects:
        raise InvalidRequest(
            f"{username} is in no gpufleet project; ask an admin to add you to a project's group"
        )
    if project not in catalogue.user_projects:
        raise InvalidRequest(
            f"{username} is not a member of project {project!r}; choose one "
            f"of: {', '.join(sorted(catalogue.user_projects))}"
        )


def _largest_node(gpu_type: str, catalogue: Catalogue) -> int:
    largest = catalogue.largest_node.get(gpu_type)
    if largest is None:
        offered = ", ".join(sorted(catalogue.largest_node)) or "none registered yet"
        raise InvalidRequest(f"unknown GPU type {gpu_type!r}; this fleet has: {offered}")
    return largest


def validate_session_request(request: SessionRequest, catalogue: Catalogue) -> ValidRequest:
    gpus = parse_gpu_count(request.gpus)
    _check_membership(request.username, request.project, catalogue)
    profile_name = request.profile
    if catalogue.profiles:
        if profile_name is None:
            defaults = [n for n, p in catalogue.profiles.items() if p.is_default]
            profile_name = defaults[0] if defaults else sorted(catalogue.profiles)[0]
        profile = catalogue.profiles.get(profile_name)
        if profile is None:
            raise InvalidRequest(
                f"unknown profile {profile_name!r}; choose one of: "
                f"{', '.join(sorted(catalogue.profiles))}"
            )
        if profile.projects and request.project not in profile.projects:
            raise InvalidRequest(
                f"profile {profile_name!r} is not offered to project {request.project!r}"
            )
        if profile.gpu_types and request.gpu_type not in profile.gpu_types:
            raise InvalidRequest(
                f"profile {profile_name!r} runs on {', '.join(profile.gpu_types)}, not "
                f"{request.gpu_type!r}"
            )
    largest = _largest_node(request.gpu_type, catalogue)
    if gpus > largest:
        raise InvalidRequest(
            f"{gpus} × {request.gpu_type} cannot fit: a session runs on one node and the "
            f"largest {request.gpu_type} node has {largest}"
        )
    return ValidRequest(request.project, request.gpu_type, gpus, profile_name)


JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class JobRequest:
    username: str
    project: str
    gpu_type: str
    gpus: object  # the job's total, as received
    gpus_per_pod: object | None = None  # None: a whole node's worth
    priority_class: str | None = None  # None: the project's default
    name: str = ""


@dataclass(frozen=True)
class ValidJob:
    project: str
    gpu_type: str
    pods: int
    gpus_per_pod: int
    priority_class: str | None
    name: str


def validate_job_request(request: JobRequest, catalogue: Catalogue) -> ValidJob:
    """A training job: ``gpus`` in pods of ``gpus_per_pod``, all in one zone."""
    gpus = parse_gpu_count(request.gpus)
    _check_membership(request.username, request.project, catalogue)
    if request.name and not JOB_NAME.fullmatch(request.name):
        raise InvalidRequest(
            f"job name {request.name!r}: use up to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    largest = _largest_node(request.gpu_type, catalogue)
    if request.gpus_per_pod is None:
        per_pod = min(gpus, largest)
    else:
        per_pod = parse_gpu_count(request.gpus_per_pod)
        if per_pod > largest:
            raise InvalidRequest(
                f"pods of {per_pod} × {request.gpu_type} cannot fit: a pod runs on one node "
                f"and the largest {request.gpu_type} node has {largest}"
            )
    if gpus % per_pod:
        raise InvalidRequest(
            f"{gpus} GPUs do not split into pods of {per_pod}; ask for a multiple of "
            f"{per_pod} GPUs, or for pods whose size divides {gpus}"
        )
    in_zone = catalogue.largest_zone.get(request.gpu_type)
    if in_zone is not None and gpus > in_zone:
        raise InvalidRequest(
            f"{gpus} × {request.gpu_type} can never run: a job runs inside one zone and the "
            f"largest zone has {in_zone} {request.gpu_type}"
        )
    priority = request.priority_class
    if priority is not None and priority not in catalogue.priority_classes:
        offered = ", ".join(sorted(catalogue.priority_classes)) or "none"
        raise InvalidRequest(f"unknown priority class {priority!r}; choose one of: {offered}")
    return ValidJob(
        request.project, request.gpu_type, gpus // per_pod, per_pod, priority, request.name
    )
