"""What the model is told about each tool: its JSON Schema, its purpose, and its class.

The class sentence is the point: a model that knows ``send_reply`` cannot be undone can leave it
for last, which is what keeps the pivot late and the unwind useful.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from saga.errors import ToolDefinitionError
from saga.model import ToolClass
from saga.tools import Tool, ToolRegistry

#: One sentence per class, appended to every exported description.
CLASS_SENTENCES: dict[ToolClass, str] = {
    ToolClass.READ: "Class 1: read-only — changes nothing; safe to call at any time.",
    ToolClass.CONVERGENT_WRITE: (
        "Class 2: convergent write — calling it again with the same arguments changes nothing more."
    ),
    ToolClass.REVERSIBLE_WRITE: (
        "Class 3: reversible write — undone automatically if the run fails later."
    ),
    ToolClass.COMPENSATABLE_WRITE: (
        "Class 4: compensatable write — if the run fails later, a visible compensating action "
        "offsets it."
    ),
    ToolClass.IRREVERSIBLE_WRITE: (
        "Class 5: irreversible — cannot be undone; call it only after every other change has "
        "succeeded."
    ),
}

#: Schema keywords whose value maps names to schemas (the names themselves are data).
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
#: Schema keywords whose value is one schema.
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then")
#: Schema keywords whose value is a list of schemas.
_SCHEMA_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")


def offered_tools(registry: ToolRegistry, names: Iterable[str] | None = None) -> tuple[Tool, ...]:
    """The tools an agent may be offered: all of them, or the ``names`` it is allowed.

    Compensation-only tools are never offered: the model must not undo things on its own, the
    unwind does. An unknown (or compensation-only) name raises ``UnknownToolError``, naming the
    tools that could be offered, because a typo in an agent's allow-list should fail loudly.
    """
    if names is None:
        return tuple(t for t in registry if t.offered and t.tool_class is not None)
    chosen: dict[str, Tool] = {}
    for name in names:
        chosen.setdefault(name, registry.offered(name))
    return tuple(chosen.values())


def describe(tool: Tool) -> str:
    """The tool's docstring (or declared description), then the sentence for its class."""
    if tool.tool_class is None:
        raise ToolDefinitionError(f"tool {tool.name} is a compensation and is never offered")
    sentence = CLASS_SENTENCES[tool.tool_class]
    return f"{tool.description.strip()}\n\n{sentence}" if tool.description.strip() else sentence


def json_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of the tool's arguments (``Tool.json_schema()``, what strict validation
    accepts), without pydantic's generated ``title`` noise."""
    schema = clean_schema(tool.json_schema())
    schema.setdefault("properties", {})  # providers want an object schema with properties
    return schema


def clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop the ``title`` keyword everywhere, but never a property that happens to be called
    ``title`` (or a default value holding one): the walk follows the schema's structure."""
    cleaned: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            cleaned[key] = {name: _clean_any(sub) for name, sub in value.items()}
        elif key in _SCHEMA_ONE:
            cleaned[key] = _clean_any(value)
        elif key in _SCHEMA_LIST and isinstance(value, list):
            cleaned[key] = [_clean_any(sub) for sub in value]
        else:
            cleaned[key] = value
    return cleaned


def check_strict(tool: Tool, schema: dict[str, Any]) -> None:
    """OpenAI's strict mode wants every parameter required and no extra ones; say which
    parameters stand in the way rather than let the provider answer with a 400."""
    optional = sorted(set(schema.get("properties", {})) - set(schema.get("required", [])))
    if optional or schema.get("additionalProperties") is not False:
        raise ToolDefinitionError(
            f"tool {tool.name} cannot be strict: every parameter must be required "
            f"(optional: {', '.join(optional) or 'none'})"
        )


def _clean_any(value: Any) -> Any:
    return clean_schema(value) if isinstance(value, dict) else value
