"""The tools as each format offers them: schema, description with the class, and which tools.

The demo registry's definitions are pinned as golden JSON per format; regenerate them with
``SAGA_REGENERATE_GOLDEN=1`` after a deliberate change, and read the diff.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from pydantic import BaseModel

from saga.agents import CLASS_SENTENCES, ModelFormat, offered_tools, tool_definitions, wire_format
from saga.agents.schema import clean_schema, json_schema
from saga.errors import ToolDefinitionError, UnknownToolError
from saga.model import ToolClass, Undo
from saga.tools import ToolRegistry
from tasks.tools import tools as demo_tools
from tests.unit.agents.helpers import FIXTURES

REGENERATE = os.environ.get("SAGA_REGENERATE_GOLDEN") == "1"


def names_of(definitions: list[dict[str, Any]]) -> list[str]:
    return [d["function"]["name"] if "function" in d else d["name"] for d in definitions]


def test_demo_definitions_match_the_golden_files(fmt: ModelFormat) -> None:
    """The demo registry's tools, exported in ``fmt``, are exactly the pinned JSON."""
    # Given the demo registry / When exported
    definitions = tool_definitions(demo_tools, fmt)
    golden = FIXTURES / fmt.value / "tools.json"
    if REGENERATE:
        golden.write_text(json.dumps(definitions, indent=2, ensure_ascii=False) + "\n")
    # Then it is the golden file
    assert definitions == json.loads(golden.read_text())


@pytest.mark.parametrize(
    ("fmt_value", "shape"),
    [
        ("openai_chat", {"type", "function"}),
        ("openai_responses", {"type", "name", "description", "parameters", "strict"}),
        ("anthropic", {"name", "description", "input_schema"}),
    ],
)
def test_each_format_has_its_own_shape(fmt_value: str, shape: set[str]) -> None:
    """Chat nests under ``function``; Responses is flat with ``strict``; Anthropic uses
    ``input_schema``."""
    for definition in tool_definitions(demo_tools, fmt_value):
        assert set(definition) == shape
    if fmt_value == "openai_chat":
        function = tool_definitions(demo_tools, fmt_value)[0]["function"]
        assert set(function) == {"name", "description", "parameters"}


def test_compensations_are_never_exported(fmt: ModelFormat) -> None:
    """``reverse_credit`` only undoes; the model never sees it."""
    assert "reverse_credit" not in names_of(tool_definitions(demo_tools, fmt))
    assert names_of(tool_definitions(demo_tools, fmt)) == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
        "notify_webhook",
    ]


def test_a_tool_not_offered_is_not_exported() -> None:
    """``offered=False`` keeps a forward tool away from the model too."""
    registry = ToolRegistry()

    @registry.tool(ToolClass.READ, offered=False)
    def internal_lookup(key: str) -> str:
        return key

    assert tool_definitions(registry, "anthropic") == []


def test_names_restrict_to_the_agents_tools_in_their_order(fmt: ModelFormat) -> None:
    """An agent allowed two tools is offered those two, in the order it lists them, once."""
    chosen = tool_definitions(demo_tools, fmt, names=["send_reply", "get_order", "send_reply"])
    assert names_of(chosen) == ["send_reply", "get_order"]


@pytest.mark.parametrize("name", ["refund_everything", "reverse_credit"])
def test_an_unknown_or_compensation_name_fails_loudly(name: str) -> None:
    """A typo (or a compensation) in an allow-list names the tools that could be offered."""
    with pytest.raises(UnknownToolError, match=f"tool '{name}'.*may call: get_order"):
        tool_definitions(demo_tools, "openai_chat", names=[name])


def test_every_description_states_the_class() -> None:
    """The model reads which tools cannot be undone; class 5 says to call it last."""
    for tool, definition in zip(
        offered_tools(demo_tools), tool_definitions(demo_tools, "anthropic"), strict=True
    ):
        assert tool.tool_class is not None
        assert definition["description"].startswith(tool.description)
        assert definition["description"].endswith(CLASS_SENTENCES[tool.tool_class])
    assert set(CLASS_SENTENCES) == set(ToolClass)
    assert "cannot be undone" in CLASS_SENTENCES[ToolClass.IRREVERSIBLE_WRITE]


def test_a_tool_without_docstring_still_states_its_class() -> None:
    registry = ToolRegistry()

    @registry.tool(ToolClass.CONVERGENT_WRITE)
    def set_flag(on: bool) -> None:
        return None

    [definition] = tool_definitions(registry, "anthropic")
    assert definition["description"] == CLASS_SENTENCES[ToolClass.CONVERGENT_WRITE]


def generated_titles(value: Any) -> list[str]:
    """Every ``"title": "<text>"`` pair anywhere (a property called title maps to a schema)."""
    if isinstance(value, dict):
        own = [value["title"]] if isinstance(value.get("title"), str) else []
        return own + [t for v in value.values() for t in generated_titles(v)]
    if isinstance(value, list):
        return [t for v in value for t in generated_titles(v)]
    return []


class Address(BaseModel):
    title: str
    city: str


def test_titles_go_but_a_parameter_called_title_stays() -> None:
    """pydantic's generated ``title`` keywords are noise; a field named ``title`` is data."""
    registry = ToolRegistry()

    @registry.tool(ToolClass.READ)
    def find(title: str, ship_to: Address, tags: list[str] | None = None) -> None:
        """Find a book."""

    schema = json_schema(registry.get("find"))
    assert "title" in schema["properties"]
    assert schema["required"] == ["title", "ship_to"]
    assert "title" in schema["$defs"]["Address"]["properties"]
    assert generated_titles(schema) == []
    assert schema["properties"]["tags"]["anyOf"] == [
        {"items": {"type": "string"}, "type": "array"},
        {"type": "null"},
    ]


def test_clean_schema_keeps_defaults_and_enums_untouched() -> None:
    """Values that merely contain a ``title`` key are data, not schema."""
    schema = {"title": "x", "type": "object", "default": {"title": "kept"}, "enum": [{"title": 1}]}
    assert clean_schema(schema) == {
        "type": "object",
        "default": {"title": "kept"},
        "enum": [{"title": 1}],
    }


def test_strict_marks_openai_tools_and_refuses_optional_parameters() -> None:
    """Strict mode needs every parameter required; saga says which one is not, before the
    provider answers with a 400."""
    [chat] = tool_definitions(demo_tools, "openai_chat", names=["get_order"], strict=True)
    assert chat["function"]["strict"] is True
    [responses] = tool_definitions(demo_tools, "openai_responses", names=["get_order"])
    assert responses["strict"] is False
    with pytest.raises(ToolDefinitionError, match=r"issue_credit cannot be strict.*memo"):
        tool_definitions(demo_tools, "openai_responses", names=["issue_credit"], strict=True)


def test_an_unknown_format_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model format 'gemini'; known: openai_chat"):
        wire_format("gemini")


def test_undo_is_untouched_by_export() -> None:
    """Exporting reads the registry; it does not change a tool's undo behaviour."""
    tool = demo_tools.get("issue_credit")
    tool_definitions(demo_tools, "openai_chat")
    undo = tool.build_undo({"order_id": 1}, {"credit_id": "cr_1", "amount_cents": 100})
    assert isinstance(undo, Undo)
