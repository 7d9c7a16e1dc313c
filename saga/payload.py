"""JSON in, JSON out, with a size limit.

Arguments, results and undo records cross Redis and the broker, so they must be plain JSON: a
value that only pickle could carry is refused here, at the edge, before anything runs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from saga.errors import PayloadError


def dumps(value: Any, *, what: str, limit: int) -> str:
    """Encode ``value`` as compact JSON or say exactly why not."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"{what} is not JSON: {exc}") from exc
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate: JSON takes it, UTF-8 does not
        raise PayloadError(f"{what} is not valid text: {exc.reason} at {exc.start}") from exc
    if size > limit:
        raise PayloadError(f"{what} is {size} bytes, over the limit of {limit} bytes")
    return text


def loads(text: str | bytes | None) -> Any:
    return None if text is None else json.loads(text)


def is_finite_json(value: Any) -> bool:
    """True if ``value`` survives a JSON round trip unchanged in kind (no NaN, no objects)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_finite_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(is_finite_json(v) for v in value)
    return value is None or isinstance(value, str | int | bool)
