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


# The most digits a count may have: 2**53 (every JSON number a client can hold exactly)
# has 16. Python refuses to read or print an int of 4,301 digits or more, so a longer one
# must be refused before int() or an f-string sees it.
MAX_COUNT = 2**53
MAX_COUNT_DIGITS = 16
COUNT_TEXT = re.compile(r"-?[0-9]+")

# Characters no name may hold: NUL (PostgreSQL refuses it in text; C strings end at it),
# the other C0/C1 controls, and the bidirectional controls that make a name display other
# than it reads (U+202A-U+202E embeddings and overrides, U+2066-U+2069 isolates, the
# marks U+200E, U+200F and U+061C) — "Trojan Source", CVE-2021-42574.
BIDI_CONTROLS = frozenset(
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
)


def shown(value: object, limit: int = 40) -> str:
    """``value`` for a message: repr'd, and cut short so a megabyte of input is not
    echoed back (nor a 4,301-digit int converted)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a whole number of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def name_problem(text: str) -> str | None:
    """What makes ``text`` unfit to be a name (user, project, GPU type, node...), or None."""
    for char in text:
        if char == "\0":
            return "holds a NUL character (U+0000)"
        if char in BIDI_CONTROLS:
            return (
                f"holds the bidirectional control U+{ord(char):04X}, which makes text "
                "display other than it reads"
            )
        if ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0:
            return f"holds the control character U+{ord(char):04X}"
    return None


def check_names(**names: str | None) -> None:
    """Refuse the first of ``names`` (field name → value) that is unfit to be a name."""
    for field_name, text in names.items():
        problem = None if text is None else name_problem(text)
        if problem is not None:
            raise InvalidRequest(f"{field_name} {problem}; names are plain text on one line")


def parse_gpu_count(value: object) -> int:
    """A GPU count as sent: a whole number, or text of ASCII digits alone (what the spawn
    form's field held; the form's reader strips what the browser kept around it). Text
    with anything else in it, spaces included, is refused saying what to type: a client
    that sends " 1" sends something other than the number it meant."""
    whole_number = "the GPU count must be a whole number such as 1 or 2"
    if isinstance(value, bool):  # True is an int to Python, but nobody means 1 by it
        raise InvalidRequest(whole_number)
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and COUNT_TEXT.fullmatch(value):
        if len(value.lstrip("-")) > MAX_COUNT_DIGITS:  # zeros too: int() counts them
            raise InvalidRequest(f"{whole_number} up to {MAX_COUNT}, not {shown(value)}")
        count = int(value)
    elif isinstance(value, str) and COUNT_TEXT.fullmatch(value.strip()):
        raise InvalidRequest(
            f"{whole_number}, not {shown(value)}: send the digits alone, without spaces"
        )
    else:
        raise InvalidRequest(f"{whole_number}, not {shown(value)}")
    if count < 1:
        raise InvalidRequest(f"ask for at least 1 GPU (got {shown(count)})")
    if count > MAX_COUNT:
        raise InvalidRequest(f"{whole_number} up to {MAX_COUNT}, not {shown(count)}")
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
    check_names(
        username=request.username,
        server_name=request.server_name,
        project=request.project,
        gpu_type=request.gpu_type,
        profile=request.profile,
    )
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
    check_names(
        project=request.project,
        gpu_type=request.gpu_type,
        priority=request.priority_class,
        name=request.name,
    )
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
