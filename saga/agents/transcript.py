"""The conversation so far, kept in normalised form and rendered for whichever format asks.

It enforces the one rule all three providers share: every tool call of a turn is answered
before anything else is said. Breaking it would only surface as a 400 on the next request, far
from the code that forgot a result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from saga.agents.formats import wire_format
from saga.agents.messages import (
    Entry,
    ModelFormat,
    ModelTurn,
    ToolCall,
    ToolResult,
    ToolResults,
    Usage,
    UserMessage,
)
from saga.errors import ConversationError


class Transcript:
    """An append-only history: user messages, model turns, and the results of their calls."""

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._entries: list[Entry] = []
        for entry in entries:
            self._add(entry)

    # -- adding ------------------------------------------------------------------------------

    def add_user(self, text: str) -> None:
        self._refuse_if_pending("a user message")
        self._entries.append(UserMessage(text))

    def add_turn(self, turn: ModelTurn) -> None:
        self._refuse_if_pending("another model turn")
        self._entries.append(turn)

    def add_results(self, results: Sequence[ToolResult]) -> None:
        """Answer the last turn's calls: exactly one result per call, in any order (they are
        kept in the order of the calls, which is how the providers pair them)."""
        pending = self.pending_calls
        if not pending:
            raise ConversationError("no tool calls are waiting for results")
        by_id: dict[str, ToolResult] = {}
        for result in results:
            if result.call_id in by_id:
                raise ConversationError(f"two results for tool call {result.call_id}")
            by_id[result.call_id] = result
        wanted = [call.id for call in pending]
        unknown = sorted(set(by_id) - set(wanted))
        missing = [call_id for call_id in wanted if call_id not in by_id]
        if unknown or missing:
            raise ConversationError(
                f"results must answer the pending calls exactly; missing: "
                f"{', '.join(missing) or 'none'}; not pending: {', '.join(unknown) or 'none'}"
            )
        self._entries.append(ToolResults(tuple(by_id[call_id] for call_id in wanted)))

    # -- reading -----------------------------------------------------------------------------

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(self._entries)

    @property
    def turns(self) -> tuple[ModelTurn, ...]:
        return tuple(e for e in self._entries if isinstance(e, ModelTurn))

    @property
    def last_turn(self) -> ModelTurn | None:
        turns = self.turns
        return turns[-1] if turns else None

    @property
    def pending_calls(self) -> tuple[ToolCall, ...]:
        """The calls of the last entry, if it is a turn that asked for tools."""
        last = self._entries[-1] if self._entries else None
        return last.calls if isinstance(last, ModelTurn) else ()

    @property
    def last_results(self) -> tuple[ToolResult, ...]:
        """The results that answered the latest turn (empty before any, or after a user
        message): what a policy reacts to next."""
        last = self._entries[-1] if self._entries else None
        return last.results if isinstance(last, ToolResults) else ()

    @property
    def usage(self) -> Usage:
        total = Usage()
        for turn in self.turns:
            total = total + turn.usage
        return total

    def request(self, fmt: ModelFormat | str, system: str | None = None) -> dict[str, Any]:
        """The request keywords for ``fmt``: ``messages`` (Chat Completions, with the system
        prompt as the first message), ``input`` and ``instructions`` (Responses), or
        ``messages`` and top-level ``system`` (Anthropic)."""
        return wire_format(fmt).request(self._entries, system)

    # -- JSON, for handing the conversation from one task to the next -----------------------

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [_entry_to_dict(e) for e in self._entries]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transcript:
        return cls(_entry_from_dict(e) for e in data.get("entries") or ())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Transcript({len(self._entries)} entries, {len(self.turns)} turns)"

    def _add(self, entry: Entry) -> None:
        if isinstance(entry, UserMessage):
            self.add_user(entry.text)
        elif isinstance(entry, ModelTurn):
            self.add_turn(entry)
        else:
            self.add_results(entry.results)

    def _refuse_if_pending(self, what: str) -> None:
        pending = self.pending_calls
        if pending:
            ids = ", ".join(call.id for call in pending)
            raise ConversationError(f"answer the pending tool calls ({ids}) before {what}")


def _entry_to_dict(entry: Entry) -> dict[str, Any]:
    if isinstance(entry, UserMessage):
        return {"user": entry.text}
    if isinstance(entry, ModelTurn):
        return {"turn": entry.to_dict()}
    return {"results": [r.to_dict() for r in entry.results]}


def _entry_from_dict(data: dict[str, Any]) -> Entry:
    if "user" in data:
        return UserMessage(str(data["user"]))
    if "turn" in data:
        return ModelTurn.from_dict(data["turn"])
    return ToolResults(tuple(ToolResult.from_dict(r) for r in data["results"]))
