"""The web surface's pure pieces: token names, the listing's cursor, the API's settings."""

from __future__ import annotations

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
