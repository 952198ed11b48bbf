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


def validate_session_request(request: SessionRequest, catalogue: Catalogue) -> ValidRequest:
    gpus = parse_gpu_count(request.gpus)
    if not catalogue.user_projects:
        raise InvalidRequest(
            f"{request.username} is in no gpufleet project; ask an admin to add you to a "
            "project's group"
        )
    if request.project not in catalogue.user_projects:
        raise InvalidRequest(
            f"{request.username} is not a member of project {request.project!r}; choose one "
            f"of: {', '.join(sorted(catalogue.user_projects))}"
        )
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
    largest = catalogue.largest_node.get(request.gpu_type)
    if largest is None:
        offered = ", ".join(sorted(catalogue.largest_node)) or "none registered yet"
        raise InvalidRequest(f"unknown GPU type {request.gpu_type!r}; this fleet has: {offered}")
    if gpus > largest:
        raise InvalidRequest(
            f"{gpus} × {request.gpu_type} cannot fit: a session runs on one node and the "
            f"largest {request.gpu_type} node has {largest}"
        )
    return ValidRequest(request.project, request.gpu_type, gpus, profile_name)
