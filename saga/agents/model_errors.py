"""Why a model call failed, and whether asking again can help.

The SDKs' exceptions are classified by what they carry (``status_code``, ``response.headers``,
the class names every OpenAI-style SDK shares) rather than by importing them, so saga needs no
SDK installed and treats the OpenAI and Anthropic clients, and look-alikes, the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any

from saga.errors import ModelCallError

#: Statuses worth asking again: request timeout, conflict (a concurrent request), rate limit.
#: Every 5xx is too (Anthropic's 529 "overloaded" included).
RETRYABLE_STATUSES = frozenset({408, 409, 429})
#: The SDKs' names for "no response came back": both SDKs use these, timeouts subclass the first.
_NO_RESPONSE = frozenset({"APIConnectionError", "APITimeoutError"})
#: Error codes that come with a retryable status but will not clear by waiting.
_NOT_TRANSIENT = frozenset({"insufficient_quota"})


def model_call_error(exc: BaseException) -> ModelCallError | None:
    """The ``ModelCallError`` that ``exc`` amounts to, or ``None`` when ``exc`` is not a
    failure to reach or hear the model (a bug in the request, say): that should propagate."""
    if isinstance(exc, ModelCallError):
        return exc
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        headers = response_headers(exc)
        retryable = _should_retry(headers)
        if retryable is None:
            retryable = status in RETRYABLE_STATUSES or status >= 500
        if getattr(exc, "code", None) in _NOT_TRANSIENT:
            retryable = False
        return ModelCallError(
            f"model call failed with HTTP {status}: {exc}",
            retryable=retryable,
            retry_after=retry_after_seconds(headers),
            status=status,
        )
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _NO_RESPONSE or isinstance(exc, TimeoutError | ConnectionError):
        return ModelCallError(f"model unreachable: {type(exc).__name__}: {exc}", retryable=True)
    return None


def response_headers(exc: BaseException) -> dict[str, str]:
    """The failed response's headers, lower-cased; empty when there was no response."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if not isinstance(headers, Mapping):
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()}


def retry_after_seconds(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """How long the provider asked us to wait: ``retry-after-ms``, then ``retry-after`` as
    seconds or as an HTTP date; ``None`` when it did not say (or said nonsense)."""
    millis = _number(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _should_retry(headers: Mapping[str, str]) -> bool | None:
    # The providers' own verdict overrides the status (both SDKs honour it).
    verdict = headers.get("x-should-retry", "").strip().lower()
    return {"true": True, "false": False}.get(verdict)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None
