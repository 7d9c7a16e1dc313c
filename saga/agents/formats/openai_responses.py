"""OpenAI Responses: flat tool definitions, ``function_call`` items keyed by ``call_id`` with
arguments as a JSON string, ``function_call_output`` items for results, and the system prompt as
``instructions``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from saga.agents.formats.base import WireFormat
from saga.agents.messages import ModelFormat, ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.wire import as_object, parse_arguments, text_of, usage_count


class OpenAIResponses(WireFormat):
    format = ModelFormat.OPENAI_RESPONSES
    max_tokens_key = "max_output_tokens"

    def define(
        self, name: str, description: str, schema: dict[str, Any], strict: bool
    ) -> dict[str, Any]:
        # Said explicitly: the Responses API makes functions strict unless told otherwise, and
        # strict mode refuses optional parameters.
        return {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": schema,
            "strict": strict,
        }

    def parse(self, response: Any) -> ModelTurn:
        raw = as_object(response)
        output = [item for item in raw.get("output") or () if isinstance(item, dict)]
        usage = raw.get("usage") or {}
        return ModelTurn(
            calls=tuple(_call(item) for item in output if item.get("type") == "function_call"),
            text="".join(_text(item) for item in output if item.get("type") == "message"),
            usage=Usage(usage_count(usage, "input_tokens"), usage_count(usage, "output_tokens")),
            raw=raw,
            format=self.format,
            stop_reason=_stop_reason(raw),
        )

    def user_items(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def replay(self, turn: ModelTurn) -> list[dict[str, Any]]:
        # Every output item goes back (reasoning items included), as the API asks.
        return [dict(item) for item in turn.raw.get("output") or ()]

    def assistant_items(self, turn: ModelTurn) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if turn.text:
            items.append({"role": "assistant", "content": turn.text})
        items.extend(
            {
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": json.dumps(call.arguments),
            }
            for call in turn.calls
        )
        return items

    def result_items(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        return [
            {"type": "function_call_output", "call_id": r.call_id, "output": r.text()}
            for r in results
        ]

    def assemble(self, items: list[dict[str, Any]], system: str | None) -> dict[str, Any]:
        request: dict[str, Any] = {"input": items}
        if system:
            request["instructions"] = system
        return request

    def create(self, client: Any, request: dict[str, Any]) -> Any:
        return client.responses.create(**request)


def _call(item: dict[str, Any]) -> ToolCall:
    arguments, error = parse_arguments(item.get("arguments"))
    return ToolCall(text_of(item.get("call_id")), text_of(item.get("name")), arguments, item, error)


def _text(message: dict[str, Any]) -> str:
    parts = message.get("content") or ()
    return "".join(
        str(p.get("text") or p.get("refusal") or "")
        for p in parts
        if isinstance(p, dict) and p.get("type") in ("output_text", "refusal")
    )


def _stop_reason(raw: dict[str, Any]) -> str | None:
    status = raw.get("status")
    details = raw.get("incomplete_details") or {}
    if status == "incomplete" and details.get("reason"):
        return str(details["reason"])
    return None if status is None else str(status)
