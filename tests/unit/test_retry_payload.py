"""Retry settings (backoff, cap, jitter) and the JSON edge every payload crosses."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from saga import payload
from saga.errors import PayloadError, ToolDefinitionError
from saga.retry import RetryPolicy

# -- RetryPolicy ---------------------------------------------------------------------------


def test_delay_grows_exponentially_until_the_cap() -> None:
    """Without jitter: backoff * 2**(attempt-1), never above backoff_max."""
    policy = RetryPolicy(attempts=10, backoff=0.5, backoff_max=5.0, jitter=False)

    delays = [policy.delay(attempt) for attempt in range(1, 8)]

    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_delay_of_a_huge_attempt_is_still_capped() -> None:
    """Attempt 500 does not overflow past the cap."""
    policy = RetryPolicy(backoff=1.0, backoff_max=60.0, jitter=False)

    assert policy.delay(500) == 60.0


def test_zero_backoff_means_no_wait() -> None:
    """A zero backoff retries at once, every time."""
    policy = RetryPolicy(attempts=4, backoff=0.0, jitter=False)

    assert [policy.delay(a) for a in (1, 2, 3)] == [0.0, 0.0, 0.0]


def test_jitter_stays_within_zero_and_the_ceiling() -> None:
    """Full jitter: uniform in [0, ceiling], and it really varies."""
    policy = RetryPolicy(attempts=10, backoff=1.0, backoff_max=8.0, jitter=True)
    rng = random.Random(1234)

    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        samples = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0.0 <= s <= ceiling for s in samples), (attempt, max(samples))
        assert len(set(samples)) > 150
        assert max(samples) > ceiling * 0.9


def test_jitter_is_reproducible_with_a_seeded_random() -> None:
    """The same seed gives the same delays: the rng passed in is the one used."""
    policy = RetryPolicy(backoff=2.0, backoff_max=30.0)

    first = [policy.delay(a, random.Random(7)) for a in (1, 2, 3)]
    second = [policy.delay(a, random.Random(7)) for a in (1, 2, 3)]
    expected = [random.Random(7).uniform(0, c) for c in (2.0, 4.0, 8.0)]

    assert first == second == expected


@pytest.mark.parametrize(
    ("attempts", "attempt", "allowed"),
    [(3, 1, True), (3, 2, True), (3, 3, False), (3, 4, False), (1, 1, False)],
)
def test_allows_another(attempts: int, attempt: int, allowed: bool) -> None:
    """After attempt N of ``attempts``, another is allowed only while N < attempts."""
    assert RetryPolicy(attempts=attempts).allows_another(attempt) is allowed


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"attempts": 0}, "at least 1, got 0"),
        ({"attempts": -2}, "at least 1, got -2"),
        ({"backoff": -0.1}, "must not be negative"),
        ({"backoff_max": -1.0}, "must not be negative"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    """A policy that could never run, or waits a negative time, is a definition error."""
    with pytest.raises(ToolDefinitionError, match=message):
        RetryPolicy(**settings)


# -- payload.dumps -------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ({"ids": {1, 2}}, "arguments of issue_credit"),
        ({"when": Opaque()}, "result of get_order"),
        ({"amount": math.nan}, "undo of issue_credit"),
        ([math.inf], "error"),
        ({("a", "b"): 1}, "arguments of tuple_keys"),
    ],
)
def test_non_json_is_refused_naming_its_role(value: Any, what: str) -> None:
    """A set, an arbitrary object, NaN/inf or a non-string key: refused, saying whose it was."""
    with pytest.raises(PayloadError) as err:
        payload.dumps(value, what=what, limit=10_000)

    assert str(err.value).startswith(f"{what} is not JSON: ")
    assert isinstance(err.value.__cause__, TypeError | ValueError)


def test_over_the_limit_is_refused_with_both_sizes() -> None:
    """A payload one byte too large names its size and the limit."""
    value = {"note": "x" * 100}
    size = len(json.dumps(value, separators=(",", ":")))

    with pytest.raises(PayloadError) as err:
        payload.dumps(value, what="result of get_order", limit=size - 1)

    assert str(err.value) == (
        f"result of get_order is {size} bytes, over the limit of {size - 1} bytes"
    )


def test_exactly_at_the_limit_passes() -> None:
    """The limit is inclusive, and counted in UTF-8 bytes, not characters."""
    value = {"name": "Zoë ✓"}
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode())
    assert size > len(text)  # multi-byte characters make the two counts differ

    assert payload.dumps(value, what="arguments", limit=size) == text
    with pytest.raises(PayloadError, match=f"is {size} bytes, over the limit of {size - 1}"):
        payload.dumps(value, what="arguments", limit=size - 1)


def test_dumps_is_compact_and_round_trips() -> None:
    """No spaces, unicode kept, and ``loads`` gives the value back."""
    value = {"a": [1, 2.5, None, True], "b": {"ü": "✓"}}

    text = payload.dumps(value, what="result", limit=1000)

    assert text == '{"a":[1,2.5,null,true],"b":{"ü":"✓"}}'
    assert payload.loads(text) == value
    assert payload.loads(text.encode()) == value
    assert payload.loads(None) is None


@pytest.mark.parametrize(
    ("value", "finite"),
    [
        ({"a": [1, "x", None, True, 2.5]}, True),
        ({"a": math.nan}, False),
        ([1.0, math.inf], False),
        ({1: "int key"}, False),
        ({"when": Opaque()}, False),
        ((1, 2), False),
    ],
)
def test_is_finite_json(value: Any, finite: bool) -> None:
    """Only plain, finite JSON values survive a round trip unchanged in kind."""
    assert payload.is_finite_json(value) is finite


def test_a_lone_surrogate_is_a_payload_error_not_a_unicode_crash() -> None:
    """A string truncated mid-emoji cannot be stored: a PayloadError saying so (defect 4)."""
    with pytest.raises(PayloadError, match="result is not valid text: surrogates not allowed"):
        payload.dumps({"title": "Refund \ud83d"}, what="result", limit=1000)
