"""How a refusal looks over HTTP: one JSON shape for every error, the status saying what kind.

    {"error": "conflict", "message": "escalation run-1:0 is closed: ...", "field": null}

``field`` names the input at fault (``body.reason``, ``query.cursor``, ``path.run_id``) when
there is one; the fields an error carries (``run_id``, ``state``, ``retryable``) come beside it.
Saga's errors map to statuses here, in one table; nothing a refused request asked for has
happened. One answer in that shape is no refusal: 202 ``not_sent`` (``MessageNotSentError``)
says what was applied, on which run, and which message is pending.

A 503 says what does not answer, never how it failed: the cause's text (a host, a port) goes
to the server's log, as does every 500's traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import OperationalError as DatabaseError

from saga.errors import (
    ApprovalError,
    DispatchError,
    InvalidCorrectionError,
    InvalidCursorError,
    InvalidRunIdError,
    InvalidTextError,
    MessageNotSentError,
    NoAppError,
    OperationRefusedError,
    PayloadError,
    RunEndedError,
    RunExistsError,
    SagaError,
    StoreUnavailableError,
    TokenError,
    UnknownAgentError,
    UnknownEscalationError,
    UnknownRunError,
)

logger = logging.getLogger("saga.web")

_WORDS = {
    202: "not_sent",
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid",
    503: "unavailable",
}

#: Saga's errors, most specific first: (error, status, the input at fault).
_STATUS: list[tuple[type[BaseException], int, str | None]] = [
    (UnknownRunError, 404, None),
    (UnknownEscalationError, 404, None),
    (UnknownAgentError, 404, None),
    (InvalidRunIdError, 422, None),
    (InvalidCursorError, 422, "query.cursor"),
    (InvalidTextError, 422, None),
    (InvalidCorrectionError, 422, "body.corrections"),
    (PayloadError, 413, "body.input"),
    (TokenError, 422, None),
    (RunExistsError, 409, None),
    (RunEndedError, 409, None),
    (ApprovalError, 409, None),
    (OperationRefusedError, 409, None),
    (NoAppError, 503, None),
    (DispatchError, 503, None),
    (MessageNotSentError, 202, None),
    (StoreUnavailableError, 503, None),
]


#: What a 503 says for a dependency that failed without a saga error of its own.
_UNAVAILABLE: list[tuple[type[BaseException], str]] = [
    (StoreUnavailableError, "Redis does not answer"),
    (redis.RedisError, "Redis does not answer"),
    (BrokerError, "the broker does not answer"),
    (DatabaseError, "the records database does not answer"),
]
_SCALARS = (str, int, float, bool, type(None))
#: The failures of a dependency that reach a route without a saga error around them.
UNAVAILABLE: tuple[type[Exception], ...] = (redis.RedisError, BrokerError, DatabaseError)


def problem(
    status: int,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = {**(extra or {}), "error": _WORDS.get(status, "error"), "message": message}
    body["field"] = field
    return JSONResponse(body, status_code=status, headers=headers)


def status_of(exc: BaseException) -> tuple[int, str | None]:
    """The HTTP status (and the field at fault) a saga error answers with; 500 for a bug."""
    for kind, status, field in _STATUS:
        if isinstance(exc, kind):
            return status, field
    if isinstance(exc, UNAVAILABLE):
        return 503, None
    return 500, None


def message_of(exc: BaseException) -> str:
    status, _ = status_of(exc)
    if status == 500:
        return "internal error (see the server's log)"
    if status != 503:
        return str(exc)
    for kind, said in _UNAVAILABLE:
        if isinstance(exc, kind):
            return said
    return _without_cause(str(exc), exc.__cause__)


def _without_cause(message: str, cause: BaseException | None) -> str:
    """Saga's words about what happened, without the text of the failure under it (it names
    the broker's host and port, which the API does not tell its callers)."""
    detail = str(cause) if cause is not None else ""
    if not detail:
        return message
    for wrapped in (f" ({detail})", f": {detail}", detail):
        message = message.replace(wrapped, "")
    return message


def fields_of(exc: BaseException) -> dict[str, Any]:
    """The plain values an error carries (``RunEndedError.run_id``, ``.state``, ``retryable``):
    a client branches on these rather than on the message's prose."""
    return {
        name: value
        for name, value in vars(exc).items()
        if not name.startswith("_") and isinstance(value, _SCALARS)
    }


def validation_field(errors: list[Any]) -> tuple[str, str]:
    """The first invalid input as ``body.reason`` and what is wrong with it."""
    first = errors[0] if errors else {}
    location = ".".join(str(part) for part in first.get("loc", ()))
    return location or "body", str(first.get("msg", "invalid input"))


#: Seconds a client told ``not_sent`` waits before asking again (the broker was away).
NOT_SENT_RETRY_AFTER = 5
#: The 202 of the routes whose action sends a message, for their OpenAPI ``responses``.
NOT_SENT: dict[int | str, dict[str, Any]] = {
    202: {
        "description": "applied, its message not sent (error not_sent: run_id, applied, "
        "pending); the same request again sends it, the reaper does at the run's deadline"
    }
}


def not_sent(exc: MessageNotSentError) -> JSONResponse:
    """Applied, its message not sent: 202, not 503, so that no client retries blindly (a
    create retried without its run id would be a second run). The fields say what stands and
    what a retry with them (the run id) converges on; the reaper sends the message anyway."""
    body = {
        "error": _WORDS[202],
        "message": str(exc),
        "field": None,
        "run_id": exc.run_id,
        "applied": exc.applied,
        "pending": exc.pending,
    }
    headers = {"Retry-After": str(NOT_SENT_RETRY_AFTER)}
    return JSONResponse(body, status_code=202, headers=headers)


async def on_saga_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, MessageNotSentError):
        return not_sent(exc)
    status, field = status_of(exc)
    if status == 500:
        logger.error("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
    elif status == 503:
        logger.warning("%s %s: %s", request.method, request.url.path, _detail(exc))
    return problem(status, message_of(exc), field, extra=fields_of(exc))


async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: the caller gets the one JSON shape, the log the traceback (the server logs it
    once more as the exception goes on up, as Starlette re-raises it)."""
    if status_of(exc)[0] == 503:
        return await on_saga_error(request, exc)
    logger.error("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
    return problem(500, message_of(exc))


def _detail(exc: BaseException) -> str:
    cause = f" (cause: {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
    return f"{type(exc).__name__}: {exc}{cause}"


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    field, message = validation_field(list(exc.errors()))
    return problem(422, f"{field}: {message}", field)


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return problem(exc.status_code, str(exc.detail), None, dict(exc.headers or {}))


__all__ = [
    "NOT_SENT",
    "UNAVAILABLE",
    "SagaError",
    "fields_of",
    "message_of",
    "on_http_error",
    "on_saga_error",
    "on_unexpected_error",
    "on_validation_error",
    "problem",
    "status_of",
    "validation_field",
]
