"""Anthropic Messages: ``input_schema`` tools, ``tool_use`` blocks whose input is an object, and
all the ``tool_result`` blocks first in one user message; the system prompt is top-level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from saga.agents.formats.base import WireFormat
from saga.agents.messages import ModelFormat, ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.wire import as_object, check_object, text_of, usage_count


class AnthropicMessages(WireFormat):
    format = ModelFormat.ANTHROPIC
    max_tokens_key = "max_tokens"

    def define(
        self, name: str, description: str, schema: dict[str, Any], strict: bool
    ) -> dict[str, Any]:
        # ``strict`` is an OpenAI notion; Anthropic validates against the schema as given.
        return {"name": name, "description": description, "input_schema": schema}

    def parse(self, response: Any) -> ModelTurn:
        raw = as_object(response)
        blocks = [b for b in raw.get("content") or () if isinstance(b, dict)]
        usage = raw.get("usage") or {}
        return ModelTurn(
            calls=tuple(_call(b) for b in blocks if b.get("type") == "tool_use"),
            text="".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text"),
            usage=Usage(usage_count(usage, "input_tokens"), usage_count(usage, "output_tokens")),
            raw=raw,
            format=self.format,
            stop_reason=raw.get("stop_reason"),
        )

    def user_items(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": text}]}]

    def replay(self, turn: ModelTurn) -> list[dict[str, Any]]:
        # Thinking blocks keep their signatures only if they come back untouched.
        return [{"role": "assistant", "content": list(turn.raw.get("content") or ())}]

    def assistant_items(self, turn: ModelTurn) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        if turn.text:  # the API refuses empty text blocks
            content.append({"type": "text", "text": turn.text})
        content.extend(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
            for call in turn.calls
        )
        return [{"role": "assistant", "content": content}] if content else []

    def result_items(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        blocks = [
            {
                "type": "tool_result",
                "tool_use_id": r.call_id,
                "content": r.text(),
                "is_error": r.is_error,
            }
            for r in results
        ]
        return [{"role": "user", "content": blocks}] if blocks else []

    def assemble(self, items: list[dict[str, Any]], system: str | None) -> dict[str, Any]:
        request: dict[str, Any] = {"messages": _merge_roles(items)}
        if system:
            request["system"] = system
        return request

    def create(self, client: Any, request: dict[str, Any]) -> Any:
        return client.messages.create(**request)


def _call(block: dict[str, Any]) -> ToolCall:
    arguments, error = check_object(block.get("input", {}))
    return ToolCall(text_of(block.get("id")), text_of(block.get("name")), arguments, block, error)


def _merge_roles(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive messages of one role become one, keeping their blocks in order.

    This is what puts the tool results first in the user message that follows a tool use, with
    any text the user adds after them: the API wants every result right after its call.
    """
    merged: list[dict[str, Any]] = []
    for item in items:
        content = item["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if merged and merged[-1]["role"] == item["role"]:
            merged[-1]["content"] = [*merged[-1]["content"], *blocks]
        else:
            merged.append({"role": item["role"], "content": list(blocks)})
    return merged
