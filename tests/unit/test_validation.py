"""Validation of session requests: every rejection tells the user what to change."""

from __future__ import annotations

import pytest

from gpufleet.scheduler.errors import InvalidRequest
from gpufleet.scheduler.validation import (
    Catalogue,
    ProfileRule,
    SessionRequest,
    ValidRequest,
    name_problem,
    parse_gpu_count,
    validate_session_request,
)

CATALOGUE = Catalogue(
    largest_node={"A100": 4, "H100": 8},
    user_projects=frozenset({"vision", "nlp"}),
    profiles={
        "pytorch": ProfileRule(is_default=True),
        "jax-h100": ProfileRule(gpu_types=("H100",)),
        "vision-only": ProfileRule(projects=("vision",)),
    },
)


def request(**changes: object) -> SessionRequest:
    fields: dict[str, object] = {
        "username": "alice",
        "server_name": "",
        "project": "vision",
        "gpu_type": "A100",
        "gpus": 1,
        "profile": None,
    }
    fields.update(changes)
    return SessionRequest(**fields)


def rejection(req: SessionRequest, catalogue: Catalogue = CATALOGUE) -> str:
    with pytest.raises(InvalidRequest) as caught:
        validate_session_request(req, catalogue)
    return str(caught.value)


# ----------------------------------------------------------------- GPU count
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("two", "the GPU count must be a whole number such as 1 or 2, not 'two'"),
        ("1.5", "the GPU count must be a whole number such as 1 or 2, not '1.5'"),
        ("", "the GPU count must be a whole number such as 1 or 2, not ''"),
        (2.0, "the GPU count must be a whole number such as 1 or 2, not 2.0"),
        (None, "the GPU count must be a whole number such as 1 or 2, not None"),
        (True, "the GPU count must be a whole number such as 1 or 2"),
        (False, "the GPU count must be a whole number such as 1 or 2"),
        (0, "ask for at least 1 GPU (got 0)"),
        (-1, "ask for at least 1 GPU (got -1)"),
        ("0", "ask for at least 1 GPU (got 0)"),
        ("-1", "ask for at least 1 GPU (got -1)"),
    ],
)
def test_a_bad_gpu_count_is_rejected_with_what_to_type(value: object, message: str) -> None:
    assert rejection(request(gpus=value)) == message


@pytest.mark.parametrize("value", ["--1", "²"])
def test_a_malformed_number_gets_the_whole_number_message(value: str) -> None:
    with pytest.raises(InvalidRequest, match="whole number"):
        parse_gpu_count(value)


@pytest.mark.parametrize(("value", "count"), [(1, 1), ("2", 2), ("3", 3), (8, 8)])
def test_a_gpu_count_as_typed_in_a_form_becomes_an_int(value: object, count: int) -> None:
    assert parse_gpu_count(value) == count


@pytest.mark.parametrize("value", [" 1", "1 ", " 3 ", "\t2", "2\n", "\u00a02"])
def test_a_count_with_spaces_around_its_digits_is_refused_saying_to_send_them_alone(
    value: str,
) -> None:
    # The spawn form's reader strips the field (spawner/form.py): only another client sends
    # these, and it sends something other than the number it meant.
    assert rejection(request(gpus=value)) == (
        f"the GPU count must be a whole number such as 1 or 2, not {value!r}: send the "
        "digits alone, without spaces"
    )


@pytest.mark.parametrize("value", ["+1", "1_0", "1e0", "\u0661", "\uff11"])
def test_a_count_in_text_that_int_would_read_is_still_refused(value: str) -> None:
    # int() reads each of these (a sign, an underscore, Arabic-Indic and fullwidth digits).
    assert rejection(request(gpus=value)) == (
        f"the GPU count must be a whole number such as 1 or 2, not {value!r}"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1" * 4301, "the GPU count must be a whole number such as 1 or 2 up to 9007199254740992"),
        ("0" * 4300 + "1", "the GPU count must be a whole number such as 1 or 2 up to"),
        ("-" + "1" * 4301, "the GPU count must be a whole number such as 1 or 2 up to"),
        (10**5000, "not a whole number of about 5000 digits"),
        (-(10**5000), "ask for at least 1 GPU (got a whole number of about 5000 digits)"),
        (2**53 + 1, "up to 9007199254740992, not 9007199254740993"),
        ("x" * 10_000, "not '" + "x" * 38 + "…"),
    ],
    # Named, not shown: pytest would print the values, and cannot print an int this big.
    ids=["digits", "zeros", "negative", "int", "negative-int", "2**53+1", "text"],
)
def test_a_count_past_what_python_converts_is_refused_without_echoing_it(
    value: object, message: str
) -> None:
    # int() and str() refuse 4,301 digits or more: a ValueError, not an InvalidRequest.
    with pytest.raises(InvalidRequest) as caught:
        parse_gpu_count(value)
    assert message in str(caught.value)
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize(("value", "count"), [("0001", 1), ("9" * 16, 10**16 - 1)])
def test_a_count_of_up_to_16_digits_is_read(value: str, count: int) -> None:
    if count > 2**53:
        with pytest.raises(InvalidRequest, match="up to 9007199254740992"):
            parse_gpu_count(value)
    else:
        assert parse_gpu_count(value) == count


# ---------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a\0b", "holds a NUL character (U+0000)"),
        ("a\nb", "holds the control character U+000A"),
        ("a\x85b", "holds the control character U+0085"),
        *[
            (f"vision{c}", f"holds the bidirectional control U+{ord(c):04X}")
            for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
        ],
    ],
)
def test_a_name_with_nul_a_control_or_a_bidi_control_is_unfit(text: str, problem: str) -> None:
    found = name_problem(text)
    assert found is not None and found.startswith(problem)


@pytest.mark.parametrize(
    "text", ["", "alice", "Zoë", "研究", "a b", "user@example.org", "A100-80GB"]
)
def test_plain_names_in_any_script_are_fit(text: str) -> None:
    assert name_problem(text) is None


@pytest.mark.parametrize(
    "field_name", ["username", "server_name", "project", "gpu_type", "profile"]
)
def test_a_request_with_an_unfit_name_says_which_field(field_name: str) -> None:
    message = rejection(request(**{field_name: "vision\u202e"}))
    assert message.startswith(f"{field_name} holds the bidirectional control U+202E")


# ---------------------------------------------------------------- membership
def test_a_user_in_no_project_is_told_to_ask_an_admin() -> None:
    catalogue = Catalogue(largest_node={"A100": 4}, user_projects=frozenset())
    assert rejection(request(), catalogue) == (
        "alice is in no gpufleet project; ask an admin to add you to a project's group"
    )


def test_a_project_that_is_not_the_users_lists_the_users_projects() -> None:
    assert rejection(request(project="robotics")) == (
        "alice is not a member of project 'robotics'; choose one of: nlp, vision"
    )


# ------------------------------------------------------------------ profiles
def test_an_unknown_profile_lists_the_profiles() -> None:
    assert rejection(request(profile="tensorflow")) == (
        "unknown profile 'tensorflow'; choose one of: jax-h100, pytorch, vision-only"
    )


def test_a_profile_not_offered_to_the_project_is_rejected() -> None:
    assert rejection(request(project="nlp", profile="vision-only")) == (
        "profile 'vision-only' is not offered to project 'nlp'"
    )


def test_a_profile_for_another_gpu_type_names_the_types_it_runs_on() -> None:
    assert rejection(request(gpu_type="A100", profile="jax-h100")) == (
        "profile 'jax-h100' runs on H100, not 'A100'"
    )


# ----------------------------------------------------------------- GPU types
def test_an_unknown_gpu_type_lists_the_fleets_types() -> None:
    assert rejection(request(gpu_type="V100")) == (
        "unknown GPU type 'V100'; this fleet has: A100, H100"
    )


def test_a_gpu_type_in_an_empty_fleet_says_none_registered_yet() -> None:
    catalogue = Catalogue(largest_node={}, user_projects=frozenset({"vision"}))
    assert rejection(request(), catalogue) == (
        "unknown GPU type 'A100'; this fleet has: none registered yet"
    )


def test_more_gpus_than_the_largest_node_names_the_largest_node() -> None:
    assert rejection(request(gpus=5)) == (
        "5 × A100 cannot fit: a session runs on one node and the largest A100 node has 4"
    )


# --------------------------------------------------------------------- valid
def test_a_valid_request_is_normalised_and_gets_the_default_profile() -> None:
    assert validate_session_request(request(gpus="2"), CATALOGUE) == ValidRequest(
        project="vision", gpu_type="A100", gpus=2, profile="pytorch"
    )


def test_the_largest_node_itself_is_allowed() -> None:
    valid = validate_session_request(
        request(project="nlp", gpu_type="H100", gpus=8, profile="jax-h100"), CATALOGUE
    )
    assert valid == ValidRequest(project="nlp", gpu_type="H100", gpus=8, profile="jax-h100")


def test_without_a_default_the_first_profile_by_name_is_picked() -> None:
    catalogue = Catalogue(
        largest_node={"A100": 4},
        user_projects=frozenset({"vision"}),
        profiles={"zeta": ProfileRule(), "alpha": ProfileRule()},
    )
    assert validate_session_request(request(), catalogue).profile == "alpha"


def test_without_profiles_the_request_has_none() -> None:
    catalogue = Catalogue(largest_node={"A100": 4}, user_projects=frozenset({"vision"}))
    assert validate_session_request(request(gpus=4), catalogue) == ValidRequest(
        project="vision", gpu_type="A100", gpus=4, profile=None
    )
