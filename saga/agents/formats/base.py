"""The shape every wire format fills in: offer a tool, read an answer, write the next request.

A request is built from the normalised history in one pass: each entry becomes the format's
items, then the format assembles them (system prompt placement, message merging) into the
keyword arguments of its SDK call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from saga.agents.messages import Entry, ModelFormat, ModelTurn, ToolResult, UserMessage
from saga.agents.schema import check_strict, describe, json_schema
from saga.tools import Tool


class WireFormat(ABC):
    """One provider API's way of spelling tools, calls and results."""

    format: ClassVar[ModelFormat]
    #: The request keyword that caps the length of the answer.
    max_tokens_key: ClassVar[str]

    def tool_definition(self, tool: Tool, *, strict: bool = False) -> dict[str, Any]:
        """The tool as this format offers it to the model."""
        schema = json_schema(tool)
        if strict:
            check_strict(tool, schema)
        return self.define(tool.name, describe(tool), schema, strict)

    def request(self, entries: Sequence[Entry], system: str | None) -> dict[str, Any]:
        """The conversation as this format's request keywords (``messages``/``input``, and
        the system prompt where this format wants it); model and tools are the caller's."""
        items: list[dict[str, Any]] = []
        for entry in entries:
            if isinstance(entry, UserMessage):
                items.extend(self.user_items(entry.text))
            elif isinstance(entry, ModelTurn):
                # The provider's own answer goes back verbatim; anything else is rebuilt.
                own = entry.format is self.format and entry.raw
                items.extend(self.replay(entry) if own else self.assistant_items(entry))
            else:
                items.extend(self.result_items(entry.results))
        return self.assemble(items, system)

    @abstractmethod
    def define(
        self, name: str, description: str, schema: dict[str, Any], strict: bool
    ) -> dict[str, Any]:
        """A tool definition from its parts."""

    @abstractmethod
    def parse(self, response: Any) -> ModelTurn:
        """The model's answer (an SDK object or its JSON) as a normalised turn."""

    @abstractmethod
    def user_items(self, text: str) -> list[dict[str, Any]]:
        """A user's text as request items."""

    @abstractmethod
    def replay(self, turn: ModelTurn) -> list[dict[str, Any]]:
        """This format's own answer, as the provider sent it."""

    @abstractmethod
    def assistant_items(self, turn: ModelTurn) -> list[dict[str, Any]]:
        """A turn from elsewhere (a script, another format), rebuilt from its normalised parts."""

    @abstractmethod
    def result_items(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        """The answers to one turn's calls."""

    @abstractmethod
    def assemble(self, items: list[dict[str, Any]], system: str | None) -> dict[str, Any]:
        """The request keywords from the items and the system prompt."""

    @abstractmethod
    def create(self, client: Any, request: dict[str, Any]) -> Any:
        """Send ``request`` with the user's SDK client; return its response object."""
