"""``since`` as a person writes it, parsed once for the ``saga`` command and the API
(``saga.listing.parse_since``): durations ago, ISO dates, and clear refusals."""

from __future__ import annotations

import pytest

from saga.listing import parse_since

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", NOW - 1800),
        ("2h", NOW - 7200),
        (" 7d ", NOW - 7 * 86400),
        ("1.5w", NOW - 1.5 * 7 * 86400),
        ("2026-01-01", 1767225600.0),  # UTC unless it says otherwise
        ("2026-01-01T02:00:00+02:00", 1767225600.0),
    ],
)
def test_durations_and_iso_dates(text: str, expected: float) -> None:
    assert parse_since(text, now=NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "2 h", "-2h", "", "999999999w"])
def test_anything_else_is_a_value_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=r"neither a duration|before the year 1"):
        parse_since(text, now=NOW)
