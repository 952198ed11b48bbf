"""When a timed drain runs (hub/timed.py's ``when``): a time of day or a date and time."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpufleet.hub.timed import LATEST, when

NOW = datetime(2026, 12, 3, 15, 30, tzinfo=UTC)


def test_a_time_of_day_is_the_next_one_to_come() -> None:
    assert when("16:00", NOW) == datetime(2026, 12, 3, 16, 0, tzinfo=UTC)
    assert when("02:00", NOW) == datetime(2026, 12, 4, 2, 0, tzinfo=UTC)
    assert when("15:30", NOW) == datetime(2026, 12, 4, 15, 30, tzinfo=UTC)


def test_a_date_and_time_is_utc_unless_it_says() -> None:
    assert when("2026-12-05T02:00", NOW) == datetime(2026, 12, 5, 2, 0, tzinfo=UTC)
    assert when("2026-12-05T02:00+01:00", NOW) == datetime(2026, 12, 5, 1, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("25:00", "is not a time of day"),
        ("tomorrow", "neither HH:MM nor an ISO date and time"),
        ("2026-12-01T00:00", "has passed"),
    ],
)
def test_what_cannot_be_a_time_to_come_is_refused_saying_what_to_write(
    text: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        when(text, NOW)


def test_the_latest_second_python_holds_in_utc_is_taken() -> None:
    assert when("9999-12-31T23:59:59Z", NOW) == LATEST
    assert when("9999-12-31T23:59:59+14:00", NOW) == datetime(9999, 12, 31, 9, 59, 59, tzinfo=UTC)


@pytest.mark.parametrize(
    "text",
    [
        "9999-12-31T23:59:59-14:00",  # past datetime's range once in UTC: an OverflowError
        "9999-12-31T23:59:59.5",
        "9999-12-31T23:59:59.999999+00:00",
    ],
)
def test_a_time_past_the_latest_is_refused_naming_the_latest(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        when(text, NOW)
    assert str(caught.value) == (
        f"{text} is later than 9999-12-31T23:59:59Z, the latest time a drain takes"
    )


def test_a_time_before_year_1_in_utc_has_passed() -> None:
    with pytest.raises(ValueError, match="has passed; give a time to come"):
        when("0001-01-01T00:00+01:00", NOW)
