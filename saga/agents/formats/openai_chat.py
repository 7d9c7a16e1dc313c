"""OpenAI Chat Completions: tools under ``function``, arguments as a JSON string, one ``tool``
message per result, and the system prompt as the first message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from saga.agents.formats.base import WireFormat
from saga.agents.messages import ModelFormat, ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.wire import as_json, as_object, parse_arguments, text_of, usage_count


class OpenAIChat(WireFormat):
    format = ModelFormat.OPENAI_CHAT
    # ``max_tokens`` is deprecated there, and refused by the reasoning models.
    max_tokens_key = "max_completion_tokens"

    def define(
        self, name: str, description: str, schema: dict[str, Any], strict: bool
    ) -> dict[str, Any]:
        function: dict[str, Any] = {"name": name, "description": description, "parameters": schema}
        if strict:
            function["strict"] = True
        return {"type": "function", "function": function}

    def parse(self, response: Any) -> ModelTurn:
        raw = as_object(response)
        choices = raw.get("choices") or [{}]
        message = _message(raw)
        usage = raw.get("usage") or {}
        return ModelTurn(
            calls=tuple(_call(item) for item in message.get("tool_calls") or ()),
            text=_text(message),
            usage=Usage(
                usage_count(usage, "prompt_tokens"), usage_count(usage, "completion_tokens")
            ),
            raw=raw,
            format=self.format,
            stop_reason=choices[0].get("finish_reason"),
        )

    def user_items(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def replay(self, turn: ModelTurn) -> list[dict[str, Any]]:
        return [_message(turn.raw)]

    def assistant_items(self, turn: ModelTurn) -> list[dict[str, Any]]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in turn.calls
            ]
        return [message]

    def result_items(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_call_id": r.call_id, "content": r.text()} for r in results]

    def assemble(self, items: list[dict[str, Any]], system: str | None) -> dict[str, Any]:
        head = [{"role": "system", "content": system}] if system else []
        return {"messages": head + items}

    def create(self, client: Any, request: dict[str, Any]) -> Any:
        return client.chat.completions.create(**request)


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    choices = raw.get("choices") or [{}]
    message = choices[0].get("message") or {}
    return dict(message)


def _call(item: Any) -> ToolCall:
    item = as_json(item)
    kind = item.get("type", "function")
    if kind != "function":  # e.g. a custom (free-text) tool: saga offers none
        spec = item.get(kind) or {}
        error = f"unsupported tool call type {kind!r}"
        return ToolCall(text_of(item.get("id")), text_of(spec.get("name")), raw=item, error=error)
    function = item.get("function") or {}
    arguments, problem = parse_arguments(function.get("arguments"))
    name = text_of(function.get("name"))
    return ToolCall(text_of(item.get("id")), name, arguments, item, problem)


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or message.get("refusal") or ""
