"""Small conversions every format needs: an SDK object to JSON, a string of arguments to a dict.

The SDKs return pydantic models and the tests hand in plain dicts; both become the JSON the
provider sent, so parsing and replay never depend on an SDK being installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def as_json(value: Any) -> Any:
    """``value`` as plain JSON types, as close as possible to what the provider sent.

    SDK models are dumped with ``exclude_unset``, which is what the SDKs themselves do when a
    response object is passed back in a request: fields the provider omitted stay omitted.
    """
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json", exclude_unset=True)
        except TypeError:  # a model_dump without pydantic's keywords
            return dump()
    if isinstance(value, Mapping):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


def as_object(value: Any) -> dict[str, Any]:
    """A response or item as a JSON object; anything else is an empty object."""
    converted = as_json(value)
    return converted if isinstance(converted, dict) else {}


def parse_arguments(text: Any) -> tuple[dict[str, Any], str | None]:
    """Arguments sent as a JSON string: the object, or an error for the model to read.

    Models do send broken JSON (truncated output, a stray quote). That is the model's mistake
    to correct on its next turn, so it becomes an error result, never an exception.
    """
    if isinstance(text, dict):
        return text, None
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}, None  # some models send "" for a tool without parameters
    if not isinstance(text, str):
        return {}, f"arguments must be a JSON object, got {type(text).__name__}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"arguments are not valid JSON ({exc.msg} at character {exc.pos}): {text}"
    return check_object(value)


def check_object(value: Any) -> tuple[dict[str, Any], str | None]:
    """Arguments must be a JSON object; say so when they are not."""
    if isinstance(value, dict):
        return value, None
    return {}, f"arguments must be a JSON object, got {json.dumps(value)}"


def text_of(value: Any) -> str:
    """An id or a name as the provider sent it: a JSON null (or nothing) is '', never 'None'."""
    return "" if value is None else str(value)


def usage_count(usage: Mapping[str, Any], key: str) -> int:
    """One token count from a usage object; a missing or null count is zero."""
    value = usage.get(key)
    return value if isinstance(value, int) else 0
