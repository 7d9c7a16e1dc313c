"""The three wire formats, one module each, behind three functions: offer the tools, read an
answer, and look a format up by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from saga.agents.formats.anthropic_messages import AnthropicMessages
from saga.agents.formats.base import WireFormat
from saga.agents.formats.openai_chat import OpenAIChat
from saga.agents.formats.openai_responses import OpenAIResponses
from saga.agents.messages import ModelFormat, ModelTurn
from saga.agents.schema import offered_tools
from saga.tools import ToolRegistry

_FORMATS: dict[ModelFormat, WireFormat] = {
    f.format: f for f in (OpenAIChat(), OpenAIResponses(), AnthropicMessages())
}


def wire_format(fmt: ModelFormat | str) -> WireFormat:
    """The format named ``fmt`` (a ``ModelFormat`` or its value, e.g. ``"anthropic"``)."""
    try:
        return _FORMATS[ModelFormat(fmt)]
    except ValueError:
        known = ", ".join(f.value for f in ModelFormat)
        raise ValueError(f"unknown model format {fmt!r}; known: {known}") from None


def tool_definitions(
    registry: ToolRegistry,
    fmt: ModelFormat | str,
    *,
    names: Iterable[str] | None = None,
    strict: bool = False,
) -> list[dict[str, Any]]:
    """The tools the agent may call, as ``fmt`` offers them in a request's ``tools``.

    ``names`` restricts them to an agent's allowed tools (an unknown one raises
    ``UnknownToolError``); compensations are never exported. ``strict`` asks OpenAI to hold
    the model to the schema, which needs every parameter required.
    """
    spec = wire_format(fmt)
    return [spec.tool_definition(t, strict=strict) for t in offered_tools(registry, names)]


def parse_response(fmt: ModelFormat | str, response: Any) -> ModelTurn:
    """The model's answer in ``fmt`` (an SDK response object or its JSON) as a ``ModelTurn``."""
    return wire_format(fmt).parse(response)


__all__ = [
    "AnthropicMessages",
    "OpenAIChat",
    "OpenAIResponses",
    "WireFormat",
    "parse_response",
    "tool_definitions",
    "wire_format",
]
