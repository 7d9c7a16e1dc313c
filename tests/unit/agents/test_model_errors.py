"""Classifying a failed model call by what the exception carries, without the SDKs' classes."""

from __future__ import annotations

import copy
import pickle
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import pytest

from saga.agents import ModelCallError, model_call_error
from saga.agents.model_errors import retry_after_seconds
from saga.errors import SagaError


class Response:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


class APIStatusError(Exception):
    """Shaped like the SDKs' status errors: ``status_code``, ``response.headers``, ``code``."""

    def __init__(self, status: int, headers: dict[str, str] | None = None, code: Any = None):
        super().__init__(f"HTTP {status}")
        self.status_code = status
        self.response = Response(headers or {})
        self.code = code


class APIConnectionError(Exception):
    pass


class APITimeoutError(APIConnectionError):
    pass


@pytest.mark.parametrize(
    ("status", "retryable"),
    [
        *[(s, True) for s in (408, 409, 429, 500, 503, 529)],
        *[(s, False) for s in (400, 401, 403, 404, 413, 422)],
    ],
)
def test_status_decides_retryable(status: int, retryable: bool) -> None:
    error = model_call_error(APIStatusError(status))
    assert error is not None
    assert (error.status, error.retryable, error.retry_after) == (status, retryable, None)


def test_the_providers_should_retry_header_overrides_the_status() -> None:
    """Both SDKs honour ``x-should-retry``; so does saga."""
    never = model_call_error(APIStatusError(503, {"X-Should-Retry": "false"}))
    always = model_call_error(APIStatusError(400, {"x-should-retry": "true"}))
    assert never is not None and never.retryable is False
    assert always is not None and always.retryable is True


def test_an_exhausted_quota_is_a_429_that_waiting_does_not_fix() -> None:
    error = model_call_error(APIStatusError(429, code="insufficient_quota"))
    assert error is not None and error.retryable is False


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "-3"}, None),
        ({"retry-after": "nan"}, None),
        ({}, None),
    ],
)
def test_retry_after_in_seconds(headers: dict[str, str], seconds: float | None) -> None:
    assert retry_after_seconds(headers) == seconds


def test_retry_after_as_an_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2025, 1, 1, 12, 0, 30, tzinfo=UTC), usegmt=True)
    assert retry_after_seconds({"retry-after": later}, now=now.timestamp()) == 30.0
    assert retry_after_seconds({"retry-after": later}, now=now.timestamp() + 60) == 0.0


def test_retry_after_is_read_from_the_status_errors_headers() -> None:
    error = model_call_error(APIStatusError(429, {"Retry-After": "2"}))
    assert error is not None and error.retry_after == 2.0


@pytest.mark.parametrize(
    "exc",
    [APIConnectionError("refused"), APITimeoutError("slow"), TimeoutError(), ConnectionError()],
)
def test_no_response_is_retryable_without_a_status(exc: Exception) -> None:
    error = model_call_error(exc)
    assert error is not None
    assert (error.retryable, error.status, error.retry_after) == (True, None, None)


@pytest.mark.parametrize("exc", [KeyError("x"), TypeError("bad keyword"), ValueError()])
def test_anything_else_is_not_a_model_error(exc: Exception) -> None:
    """A bug in the request is not disguised as a provider failure."""
    assert model_call_error(exc) is None


def test_a_model_call_error_is_a_saga_error_that_survives_copy_and_pickle() -> None:
    error = ModelCallError("HTTP 429", retryable=True, retry_after=2.0, status=429)
    for again in (copy.copy(error), pickle.loads(pickle.dumps(error))):
        assert isinstance(again, ModelCallError)
        assert isinstance(again, SagaError)
        assert (str(again), again.retryable, again.retry_after, again.status) == (
            "HTTP 429",
            True,
            2.0,
            429,
        )
    assert ModelCallError("x").retryable is False
    assert model_call_error(error) is error
