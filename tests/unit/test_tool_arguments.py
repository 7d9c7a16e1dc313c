"""Tool arguments are checked strictly, as the JSON a model writes: no coercion (``true`` is no
amount of cents, ``"1200"`` no integer), while types JSON has no literal for (dates, decimals,
UUIDs) take their usual string form. The JSON Schema a model is shown says exactly that.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

import pytest

from saga.errors import CompensationBuildError, InvalidArgumentsError
from saga.model import ToolClass, Undo
from saga.tools import Tool, ToolRegistry

ORDER_UUID = "12345678-1234-5678-1234-567812345678"


def _undo(args: dict[str, Any], result: Any) -> Undo:
    return Undo("reverse_charge", {"charge_id": result["charge_id"], "amount": result["amount"]})


@pytest.fixture
def registry() -> ToolRegistry:
    """One tool with a parameter of every kind worth checking, and a compensation."""
    reg = ToolRegistry()

    @reg.tool(ToolClass.COMPENSATABLE_WRITE, compensation=_undo)
    def charge(
        cents: int,
        rush: bool,
        rate: float,
        memo: str,
        on: date,
        amount: Decimal,
        currency: Literal["EUR", "USD"],
        lines: list[int],
        order: UUID,
        note: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        return {"charge_id": "ch_1", "amount": amount}

    @reg.compensation()
    def reverse_charge(charge_id: str, amount: Decimal) -> None: ...

    return reg


@pytest.fixture
def tool(registry: ToolRegistry) -> Tool:
    return registry.get("charge")


GOOD: dict[str, Any] = {
    "cents": 1200,
    "rush": False,
    "rate": 1.5,
    "memo": "refund",
    "on": "2024-05-01",
    "amount": "2500.00",
    "currency": "EUR",
    "lines": [1, 2],
    "order": ORDER_UUID,
}


def test_json_values_of_every_kind_are_accepted(tool: Tool) -> None:
    """The JSON a model writes passes, and comes back in the same JSON form."""
    assert tool.validate(GOOD) == {**GOOD, "note": None, "limit": None}


@pytest.mark.parametrize(
    ("field", "value", "wire"),
    [
        ("rate", 2, 2.0),  # an integer is a fine number
        ("amount", 2500, "2500"),  # a JSON number is a fine decimal ...
        ("amount", "0.10", "0.10"),  # ... and a string keeps every digit
        ("on", date(2024, 5, 1), "2024-05-01"),  # Python values, as an undo may hold
        ("amount", Decimal("2.50"), "2.50"),
        ("order", UUID(ORDER_UUID), ORDER_UUID),
        ("note", "rush it", "rush it"),
        ("limit", 3, 3),
    ],
)
def test_values_that_mean_the_same_in_json_are_accepted(
    tool: Tool, field: str, value: Any, wire: Any
) -> None:
    """Ints for floats, numbers or strings for decimals, and the Python types themselves."""
    assert tool.validate({**GOOD, field: value})[field] == wire


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("cents", True, "cents: Input should be a valid integer, got true (a boolean)"),
        ("cents", "1200", 'cents: Input should be a valid integer, got "1200" (a string)'),
        ("cents", 12.0, "cents: Input should be a valid integer, got 12.0 (a number)"),
        ("rush", 1, "rush: Input should be a valid boolean, got 1 (an integer)"),
        ("rush", "true", 'rush: Input should be a valid boolean, got "true" (a string)'),
        ("rate", "1.5", 'rate: Input should be a valid number, got "1.5" (a string)'),
        ("rate", True, "rate: Input should be a valid number, got true (a boolean)"),
        ("memo", 42, "memo: Input should be a valid string, got 42 (an integer)"),
        ("on", 20240501, "on: Input should be a valid date, got 20240501 (an integer)"),
        ("on", "2024-05-01T10:00:00", "on: Input should be a valid date in the format YYYY-MM-DD"),
        ("amount", True, "amount: Decimal input should be"),
        ("currency", "eur", "currency: Input should be 'EUR' or 'USD', got \"eur\" (a string)"),
        ("lines", ["1"], 'lines.0: Input should be a valid integer, got "1" (a string)'),
        ("lines", 1, "lines: Input should be a valid array, got 1 (an integer)"),
        ("order", "not-a-uuid", "order: Input should be a valid UUID"),
        ("limit", "3", 'limit: Input should be a valid integer, got "3" (a string)'),
        ("memo", None, "memo: Input should be a valid string, got null"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_a_wrong_type_is_refused_naming_field_expectation_and_value(
    tool: Tool, field: str, value: Any, problem: str
) -> None:
    """Defect 17: nothing is coerced, and the message says which field, what it should be and
    what came, so a model can correct the call."""
    with pytest.raises(InvalidArgumentsError) as refused:
        tool.validate({**GOOD, field: value})

    assert str(refused.value).startswith(f"invalid arguments for charge: {problem}")


def test_every_problem_is_listed_at_once(tool: Tool) -> None:
    """A model fixes a call in one go when it sees every problem."""
    args = {**GOOD, "cents": True, "rush": "yes", "tip": 5}
    del args["memo"]

    with pytest.raises(InvalidArgumentsError) as refused:
        tool.validate(args)

    message = str(refused.value)
    for part in ("cents: Input", "rush: Input", "memo: Field required", "tip: no such parameter"):
        assert part in message


def test_a_long_wrong_value_is_cut_short(tool: Tool) -> None:
    """The refusal stays readable whatever the model sent."""
    with pytest.raises(InvalidArgumentsError) as refused:
        tool.validate({**GOOD, "cents": "9" * 500})

    assert len(str(refused.value)) < 200
    assert "... (a string)" in str(refused.value)


def test_arguments_that_are_not_json_are_refused(tool: Tool) -> None:
    """An object JSON cannot carry is refused as such, before any field is looked at."""
    with pytest.raises(InvalidArgumentsError, match="arguments of charge are not JSON"):
        tool.validate({**GOOD, "memo": object()})


def test_the_wire_form_goes_back_to_python_types_unchanged(tool: Tool) -> None:
    """What ``validate`` sends, the worker's ``python_args`` accepts under the same strict rules."""
    args = tool.python_args(tool.validate({**GOOD, "rate": 2}))

    assert args["rate"] == 2.0 and isinstance(args["rate"], float)
    assert args["on"] == date(2024, 5, 1)
    assert args["amount"] == Decimal("2500.00")
    assert args["order"] == UUID(ORDER_UUID)
    assert args["lines"] == [1, 2]


# -- what a model is shown -------------------------------------------------------------------


def test_json_schema_says_what_is_accepted(tool: Tool) -> None:
    """``Tool.json_schema()``: the types strict validation holds to, no extra fields."""
    schema = tool.json_schema()
    properties = schema["properties"]

    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["required"]) == set(GOOD)
    assert properties["cents"]["type"] == "integer"
    assert properties["rush"]["type"] == "boolean"
    assert properties["rate"]["type"] == "number"
    assert properties["memo"]["type"] == "string"
    assert (properties["on"]["type"], properties["on"]["format"]) == ("string", "date")
    assert properties["amount"]["anyOf"] == [{"type": "number"}, {"type": "string"}]
    assert properties["currency"]["enum"] == ["EUR", "USD"]
    assert properties["lines"] == {"items": {"type": "integer"}, "title": "Lines", "type": "array"}
    assert (properties["order"]["type"], properties["order"]["format"]) == ("string", "uuid")
    assert properties["limit"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]


def test_json_schema_is_the_argument_model_schema(tool: Tool) -> None:
    """One source: the schema shown is the one validation uses."""
    assert tool.json_schema() == tool.schema.model_json_schema()


# -- compensations -----------------------------------------------------------------------------


def test_an_undo_built_from_python_values_passes_the_same_checks(registry: ToolRegistry) -> None:
    """An undo holding a Decimal from the step's result is valid, in its JSON form."""
    undo = registry.get("charge").build_undo(GOOD, {"charge_id": "ch_1", "amount": Decimal("9.5")})

    assert registry.check_undo(undo) == {"charge_id": "ch_1", "amount": "9.5"}


def test_an_undo_with_a_coercible_wrong_type_is_unusable(registry: ToolRegistry) -> None:
    """A compensation that passes an int where a string id belongs is caught at the push, not
    silently turned into "7" at unwind time."""
    with pytest.raises(CompensationBuildError) as refused:
        registry.check_undo(Undo("reverse_charge", {"charge_id": 7, "amount": "1"}))

    assert "charge_id: Input should be a valid string, got 7 (an integer)" in str(refused.value)


def test_the_demo_tools_build_undos_that_validate() -> None:
    """The demo app's compensations pass strict validation with results as its systems return
    them (a credit id string, a ticket's previous status)."""
    from tasks.tools import tools

    credit = tools.get("issue_credit").validate({"order_id": 4921, "amount_cents": 250_000})
    undo = tools.get("issue_credit").build_undo(
        credit, {"credit_id": "cr_4921_1", "amount_cents": 250_000}
    )
    assert tools.check_undo(undo) == {"credit_id": "cr_4921_1"}

    status = tools.get("set_ticket_status").validate({"ticket_id": 9104, "status": "pending"})
    undo = tools.get("set_ticket_status").build_undo(
        status, {"ticket_id": 9104, "previous": "open", "status": "pending"}
    )
    assert tools.check_undo(undo) == {"ticket_id": 9104, "status": "open"}
