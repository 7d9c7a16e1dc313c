"""The normalised conversation: what a model asked for, what the tools answered, and what was said.

Three providers spell the same exchange three ways; everything past the formats speaks only these
types. Each is a frozen dataclass that round-trips through plain JSON (``to_dict``/``from_dict``),
because a hosted agent loop hands the conversation from one Celery task to the next.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class ModelFormat(StrEnum):
    """The wire format a model speaks: how tools are offered, calls returned, results sent back."""

    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"


#: Stop reasons meaning the model ran out of room rather than chose to stop.
_TRUNCATED = frozenset({"length", "max_tokens", "max_output_tokens"})


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model asked for.

    ``error`` is set when the call cannot be run as asked (its arguments are not a JSON object):
    the call is kept, so it can be answered with ``error_result()`` and the model can correct
    itself, instead of an exception ending the run. A call naming an unknown tool is kept too;
    refusing it is the dispatcher's job.
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    #: The call as the provider sent it (JSON), for logs and replay.
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def error_result(self) -> ToolResult:
        """The result that tells the model why this call was not run."""
        return ToolResult.failure(self.id, self.error or f"tool call {self.name} was not run")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "arguments": self.arguments,
            "raw": self.raw,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        return cls(
            id=data["id"],
            name=data["name"],
            arguments=dict(data.get("arguments") or {}),
            raw=dict(data.get("raw") or {}),
            error=data.get("error"),
        )


@dataclass(frozen=True)
class ToolResult:
    """What a tool call produced (or why it failed), on its way back to the model.

    ``content`` is any JSON value. Only Anthropic carries ``is_error`` on the wire; the OpenAI
    formats see the failure in the content, which is why ``failure()`` says it there too.
    """

    call_id: str
    content: Any
    is_error: bool = False

    @classmethod
    def failure(cls, call_id: str, message: str) -> ToolResult:
        return cls(call_id, {"error": message}, is_error=True)

    def text(self) -> str:
        """The content as the model reads it: JSON text, except that a string stays as it is
        (a quoted, escaped string helps no model)."""
        if isinstance(self.content, str):
            return self.content
        return json.dumps(self.content, ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "content": self.content, "is_error": self.is_error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolResult:
        return cls(data["call_id"], data.get("content"), bool(data.get("is_error", False)))


@dataclass(frozen=True)
class Usage:
    """Tokens one model call consumed (prompt in, completion out); add them up per run."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens
        )


@dataclass(frozen=True)
class ModelTurn:
    """One answer of the model: the tool calls it wants run, or its final text.

    ``raw`` is the provider's whole response as JSON; the format that produced it (``format``)
    replays it verbatim in the next request, which is what the providers require (reasoning
    items, thinking blocks and ids must come back unchanged). A turn from another format, or a
    scripted one (``format`` is ``None``), is rebuilt from the normalised fields instead.
    """

    calls: tuple[ToolCall, ...] = ()
    text: str = ""
    usage: Usage = field(default_factory=Usage)
    raw: dict[str, Any] = field(default_factory=dict)
    format: ModelFormat | None = None
    #: The provider's own word for why it stopped ("tool_calls", "end_turn", "max_tokens", ...).
    stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        """True for a final answer; False while the model waits for tool results.

        Decided by the calls, not the stop reason: a call must be answered whatever the
        provider says about why it stopped.
        """
        return not self.calls

    def with_usable_call_ids(self, turn: int) -> ModelTurn:
        """This answer with every call answerable: a call without an id, or with the id of an
        earlier call of the same answer (some OpenAI-compatible servers send either), gets
        ``saga_<turn>_<i>``, so each result pairs with exactly one call. Such an answer is no
        longer replayed verbatim (the provider's own text carries the bad ids): the next
        request rebuilds it from the normalised calls, with the ids given here."""
        taken = {call.id for call in self.calls}
        seen: set[str] = set()
        calls = []
        for i, call in enumerate(self.calls):
            if not call.id or call.id in seen:
                given = f"saga_{turn}_{i}"
                while given in taken:
                    given += "_"
                taken.add(given)
                call = dataclasses.replace(call, id=given)
            seen.add(call.id)
            calls.append(call)
        if all(a.id == b.id for a, b in zip(calls, self.calls, strict=True)):
            return self
        return dataclasses.replace(self, calls=tuple(calls), format=None)

    @property
    def truncated(self) -> bool:
        """The model stopped because it ran out of tokens, not because it was done."""
        return self.stop_reason in _TRUNCATED

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": [call.to_dict() for call in self.calls],
            "text": self.text,
            "usage": {
                "input_tokens": self.usage.input_tokens,
                "output_tokens": self.usage.output_tokens,
            },
            "raw": self.raw,
            "format": None if self.format is None else self.format.value,
            "stop_reason": self.stop_reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelTurn:
        usage = data.get("usage") or {}
        fmt = data.get("format")
        return cls(
            calls=tuple(ToolCall.from_dict(c) for c in data.get("calls") or ()),
            text=data.get("text") or "",
            usage=Usage(int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))),
            raw=dict(data.get("raw") or {}),
            format=None if fmt is None else ModelFormat(fmt),
            stop_reason=data.get("stop_reason"),
        )


@dataclass(frozen=True)
class UserMessage:
    """Text from the person (or the application) the agent works for."""

    text: str


@dataclass(frozen=True)
class ToolResults:
    """The answers to every call of the turn before, in the order the calls were made."""

    results: tuple[ToolResult, ...]


#: One entry of a conversation's history.
Entry = UserMessage | ModelTurn | ToolResults
