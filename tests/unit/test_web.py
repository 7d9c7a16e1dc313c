"""The web surface's pure pieces: token names, the listing's cursor, escalation ids, how an
error answers, a reason signed with its author, the API's settings."""

from __future__ import annotations

import json

import pytest
import redis

from saga.errors import (
    ConfigurationError,
    DispatchError,
    InvalidCursorError,
    InvalidEscalationIdError,
    InvalidTextError,
    RunEndedError,
    TokenError,
)
from saga.listing import Position
from saga.validation import parse_escalation_id
from saga.web.actions import signed
from saga.web.problems import fields_of, message_of, status_of
from saga.web.settings import WebSettings
from saga.web.tokens import check_token_name


@pytest.mark.parametrize("name", ["alice", "on-call bot", "ops@example.com", "a" * 100])
def test_token_names_people_recognise_are_accepted(name: str) -> None:
    assert check_token_name(name) == name


@pytest.mark.parametrize("name", ["", " alice", "a" * 101, "<script>", "tab\there", "é"])
def test_other_token_names_are_refused(name: str) -> None:
    with pytest.raises(TokenError):
        check_token_name(name)


def test_a_cursor_names_a_position_and_nothing_else_passes() -> None:
    """What a page hands out comes back as the same position; anything else is refused."""
    position = Position(1_764_622_564_966_182, "run-1.a_b")
    assert Position.decode(position.encode()) == position
    for bad in ("", "zzz", Position(5, "").encode(), "LTE6eA"):
        with pytest.raises(InvalidCursorError):
            Position.decode(bad)


@pytest.mark.parametrize("micros", [10**20, 300_000_000_000_000_000, 253_402_300_800_000_000])
def test_a_cursor_past_the_calendars_end_is_refused(micros: int) -> None:
    """No run is created after year 9999: such a cursor was forged, and SQL could not hold it."""
    with pytest.raises(InvalidCursorError):
        Position.decode(Position(micros, "x").encode())


@pytest.mark.parametrize(
    ("escalation_id", "parsed"),
    [("run-1:0", ("run-1", 0)), ("a.b_c:12", ("a.b_c", 12)), ("run-1:reaper", ("run-1", None))],
)
def test_escalation_ids_of_a_generation_and_of_the_reaper_are_read(
    escalation_id: str, parsed: tuple[str, int | None]
) -> None:
    assert parse_escalation_id(escalation_id) == parsed


@pytest.mark.parametrize("bad", ["run-1", "run-1:", ":0", "run-1:²", "run-1:x", "a:b:0", 5])
def test_other_escalation_ids_are_refused_saying_what_one_is(bad: object) -> None:
    with pytest.raises(InvalidEscalationIdError, match=r"escalation id|must be a string"):
        parse_escalation_id(bad)


def test_text_saga_refuses_is_a_422_and_a_503_names_no_host() -> None:
    """InvalidTextError is bad input; a 503 keeps saga's words and drops the cause's (a host
    and port); the fields an error carries come with it."""
    assert status_of(InvalidTextError("note contains a NUL")) == (422, None)
    cause = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6397. Connection refused.")
    try:
        try:
            raise cause
        except redis.ConnectionError as exc:
            raise DispatchError(
                f"run r-1: the broker did not take the step ({exc}): try again"
            ) from exc
    except DispatchError as exc:
        refused = exc
    assert status_of(refused)[0] == 503
    assert message_of(refused) == "run r-1: the broker did not take the step: try again"
    assert message_of(cause) == "Redis does not answer"
    assert fields_of(RunEndedError("r-1", "completed")) == {"run_id": "r-1", "state": "completed"}


@pytest.mark.parametrize("length", [1, 1985, 1986, 2000])
def test_a_reason_signed_with_its_author_stays_within_the_limit(length: int) -> None:
    """The ``(by alice)`` suffix never pushes a reason the API took over the limit: a reason
    too long for both is cut short, saying so with "…"."""
    reason = "r" * length
    out = signed(reason, "alice")
    assert out.endswith(" (by alice)") and len(out) <= 2000
    if length + len(" (by alice)") <= 2000:
        assert out == f"{reason} (by alice)"
    else:
        assert out.endswith("r… (by alice)") and len(out) == 2000


def test_settings_come_from_the_environment_and_bad_ones_say_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAGA_API_PORT", "8080")
    monkeypatch.setenv("SAGA_API_ROOT_PATH", "/saga/")
    monkeypatch.setenv("SAGA_APP", "tasks.app:saga")
    settings = WebSettings.from_env()
    assert (settings.port, settings.root_path, settings.app) == (8080, "/saga", "tasks.app:saga")
    monkeypatch.setenv("SAGA_API_PORT", "0")
    with pytest.raises(ConfigurationError, match="SAGA_API_PORT"):
        WebSettings.from_env()
    monkeypatch.setenv("SAGA_API_PORT", "80")
    monkeypatch.setenv("SAGA_API_SECURE_COOKIES", "maybe")
    with pytest.raises(ConfigurationError, match="SAGA_API_SECURE_COOKIES"):
        WebSettings.from_env()


def test_applied_but_not_sent_answers_202_with_what_stands() -> None:
    """The error a refused message raises carries the run, what is applied and what waits,
    survives a pickle (a worker's result), and answers 202 not_sent (no 503: nothing retries
    it blindly) with those fields and Retry-After, and no broker address in its text."""
    import pickle

    from saga.errors import MessageNotSentError
    from saga.web import problems

    error = MessageNotSentError("r-1", "aborted", "unwind", "the same abort again")
    again = pickle.loads(pickle.dumps(error))
    assert (again.run_id, again.applied, again.pending, str(again)) == (
        "r-1",
        "aborted",
        "unwind",
        str(error),
    )
    assert again.retryable
    answer = problems.not_sent(error)
    body = json.loads(bytes(answer.body))
    assert answer.status_code == 202 and answer.headers["Retry-After"].isdigit()
    assert body == {
        "error": "not_sent",
        "message": "run r-1: aborted, but the broker did not take its unwind: the same abort "
        "again sends it (the reaper does at the run's deadline)",
        "field": None,
        "run_id": "r-1",
        "applied": "aborted",
        "pending": "unwind",
    }
