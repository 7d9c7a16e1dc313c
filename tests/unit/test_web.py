"""The web surface's pure pieces: token names, the listing's cursor, the API's settings."""

from __future__ import annotations

import json

import pytest

from saga.errors import ConfigurationError, InvalidCursorError, TokenError
from saga.listing import Position
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
