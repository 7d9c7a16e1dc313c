"""Tool declarations are checked when they are declared: the class rules, the options, the
schema built from type hints, and the undo a compensation builds.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any

import pytest

from saga.errors import (
    CompensationBuildError,
    InvalidArgumentsError,
    ToolDefinitionError,
    ToolNotOfferedError,
    UnknownToolError,
)
from saga.model import StepContext, ToolClass, Undo
from saga.retry import DEFAULT_COMPENSATION_RETRY, DEFAULT_RETRY, RetryPolicy
from saga.tools import Tool, ToolRegistry


def reverse_credit_undo(args: dict[str, Any], result: Any) -> Undo:
    return Undo("reverse_credit", {"credit_id": result["credit_id"]}, "reverse the credit")


@pytest.fixture
def registry() -> ToolRegistry:
    """A registry with one read, one compensatable write and its compensation."""
    reg = ToolRegistry()

    @reg.tool(ToolClass.READ)
    def get_order(order_id: int) -> dict[str, Any]:
        """Read one order."""
        return {"order_id": order_id}

    @reg.tool(ToolClass.COMPENSATABLE_WRITE, compensation=reverse_credit_undo)
    def issue_credit(
        ctx: StepContext, order_id: int, amount: Decimal, on: date, note: str = ""
    ) -> dict[str, Any]:
        return {"credit_id": f"cr_{order_id}"}

    @reg.compensation()
    def reverse_credit(credit_id: str) -> None:
        return None

    return reg


# -- registration rules --------------------------------------------------------------------


@pytest.mark.parametrize("tool_class", [3, 4, ToolClass.REVERSIBLE_WRITE])
def test_class_3_and_4_need_a_compensation(tool_class: int) -> None:
    """A reversible write without an undo is refused at declaration."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="must declare a compensation") as err:

        @reg.tool(tool_class)
        def set_status(status: str) -> None: ...

    assert "set_status" in str(err.value)
    assert len(reg) == 0


@pytest.mark.parametrize("tool_class", [1, 2, 5])
def test_class_1_2_5_refuse_a_compensation(tool_class: int) -> None:
    """Reads, convergent and irreversible writes take no compensation."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="takes no compensation") as err:

        @reg.tool(tool_class, compensation=reverse_credit_undo)
        def do_it(x: int) -> None: ...

    assert f"class {tool_class}" in str(err.value)
    assert len(reg) == 0


def test_compensation_must_be_callable() -> None:
    """A compensation that is not a function is refused."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="must be callable"):

        @reg.tool(ToolClass.REVERSIBLE_WRITE, compensation="reverse_credit")
        def set_status(status: str) -> None: ...


def test_unknown_option_is_refused_by_name() -> None:
    """A misspelt option (``retires``) is an error naming it, never silently ignored."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError) as err:
        reg.tool(ToolClass.READ, retires=RetryPolicy())

    assert "retires" in str(err.value)
    assert "unknown tool option" in str(err.value)


def test_unknown_compensation_option_is_refused_by_name() -> None:
    """A compensation takes no ``compensation`` of its own."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="compensation"):
        reg.compensation(compensation=reverse_credit_undo)


@pytest.mark.parametrize("tool_class", [0, 6, "3", None])
def test_unknown_class_is_refused(tool_class: Any) -> None:
    """Only the five classes exist."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="unknown tool class") as err:
        reg.tool(tool_class)

    assert repr(tool_class) in str(err.value)


def test_duplicate_name_is_refused(registry: ToolRegistry) -> None:
    """Two tools may not share a name, even with different classes."""
    with pytest.raises(ToolDefinitionError, match="get_order is registered twice"):

        @registry.tool(ToolClass.CONVERGENT_WRITE)
        def get_order(order_id: int) -> None: ...

    assert registry.get("get_order").tool_class is ToolClass.READ


def test_duplicate_name_through_the_name_option_is_refused(registry: ToolRegistry) -> None:
    """``name=`` counts the same as the function's own name."""
    with pytest.raises(ToolDefinitionError, match="reverse_credit is registered twice"):

        @registry.compensation(name="reverse_credit")
        def undo_credit(credit_id: str) -> None: ...


@pytest.mark.parametrize("name", ["Bad", "1st", "has-dash", "", "_private", "with space"])
def test_bad_name_is_refused(name: str) -> None:
    """Names become Celery task names: lower snake case only."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="must match"):

        @reg.tool(ToolClass.READ, name=name)
        def fine(x: int) -> None: ...

    assert len(reg) == 0


def test_missing_type_hint_is_refused() -> None:
    """Every parameter needs a type hint: the schema is built from them."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="parameter order_id of get_order"):

        @reg.tool(ToolClass.READ)
        def get_order(order_id, verbose: bool = False) -> None:  # type: ignore[no-untyped-def]
            ...


@pytest.mark.parametrize("variadic", ["args", "kwargs"])
def test_variadic_parameters_are_refused(variadic: str) -> None:
    """``*args`` / ``**kwargs`` cannot be described to the agent."""
    reg = ToolRegistry()

    def star(*args: int) -> None: ...

    def double_star(**kwargs: int) -> None: ...

    func = star if variadic == "args" else double_star
    with pytest.raises(ToolDefinitionError, match=r"no \*args/\*\*kwargs"):
        reg.tool(ToolClass.READ)(func)


def test_bad_retry_is_refused() -> None:
    """``retry`` must be a RetryPolicy, not a number of attempts."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="retry of get_order must be a RetryPolicy"):

        @reg.tool(ToolClass.READ, retry=3)
        def get_order(order_id: int) -> None: ...


def test_registration_records_the_declaration(registry: ToolRegistry) -> None:
    """Defaults: forward tools are offered with the forward retry; compensations are not."""
    read = registry.get("get_order")
    credit = registry.get("issue_credit")
    undo = registry.get("reverse_credit")

    assert isinstance(read, Tool)
    assert (read.tool_class, read.offered, read.retry) == (ToolClass.READ, True, DEFAULT_RETRY)
    assert read.description == "Read one order."
    assert credit.compensation is reverse_credit_undo
    assert undo.tool_class is None
    assert undo.offered is False
    assert undo.retry == DEFAULT_COMPENSATION_RETRY
    assert sorted(t.name for t in registry) == ["get_order", "issue_credit", "reverse_credit"]


def test_options_override_the_defaults() -> None:
    """``name``, ``description``, ``retry`` and ``offered`` are taken as given."""
    reg = ToolRegistry()
    policy = RetryPolicy(attempts=7, backoff=0.5)

    @reg.tool(ToolClass.READ, name="lookup", description="Look up.", retry=policy, offered=False)
    def get_order(order_id: int) -> None:
        """Ignored docstring."""

    tool = reg.get("lookup")
    assert (tool.name, tool.description, tool.retry, tool.offered) == (
        "lookup",
        "Look up.",
        policy,
        False,
    )
    assert tool.func is get_order


# -- schema from type hints ----------------------------------------------------------------


def test_valid_arguments_pass_and_come_back_as_json(registry: ToolRegistry) -> None:
    """``validate`` returns JSON-ready values: Decimal and date become strings, defaults fill in."""
    tool = registry.get("issue_credit")

    wire = tool.validate({"order_id": 4921, "amount": Decimal("2500.00"), "on": date(2024, 5, 1)})

    assert wire == {"order_id": 4921, "amount": "2500.00", "on": "2024-05-01", "note": ""}


def test_python_args_restore_the_hinted_types(registry: ToolRegistry) -> None:
    """The JSON form goes back to the types the function asked for."""
    tool = registry.get("issue_credit")

    args = tool.python_args({"order_id": 4921, "amount": "2500.00", "on": "2024-05-01"})

    assert args == {
        "order_id": 4921,
        "amount": Decimal("2500.00"),
        "on": date(2024, 5, 1),
        "note": "",
    }
    assert isinstance(args["amount"], Decimal)


def test_wrong_type_is_refused_naming_the_field(registry: ToolRegistry) -> None:
    """A string where an int belongs is refused, and the message says which field."""
    tool = registry.get("get_order")

    with pytest.raises(InvalidArgumentsError) as err:
        tool.validate({"order_id": "forty-two"})

    assert "invalid arguments for get_order" in str(err.value)
    assert "order_id:" in str(err.value)


def test_missing_argument_is_refused_naming_the_field(registry: ToolRegistry) -> None:
    """A required argument left out is named."""
    tool = registry.get("issue_credit")

    with pytest.raises(InvalidArgumentsError) as err:
        tool.validate({"order_id": 1, "on": "2024-05-01"})

    assert "amount: Field required" in str(err.value)


def test_extra_argument_is_refused_naming_the_field(registry: ToolRegistry) -> None:
    """An argument the tool does not take is refused, not dropped."""
    tool = registry.get("get_order")

    with pytest.raises(InvalidArgumentsError) as err:
        tool.validate({"order_id": 1, "include_lines": True})

    assert "include_lines:" in str(err.value)
    assert "order_id" not in str(err.value).split(":", 1)[1]


def test_arguments_must_be_an_object(registry: ToolRegistry) -> None:
    """A list is not a set of named arguments."""
    with pytest.raises(InvalidArgumentsError, match="must be an object"):
        registry.get("get_order").validate([4921])  # type: ignore[arg-type]


def test_ctx_is_excluded_from_the_schema_and_detected(registry: ToolRegistry) -> None:
    """``ctx`` is supplied by saga, never by the agent."""
    credit = registry.get("issue_credit")
    read = registry.get("get_order")

    assert credit.wants_context is True
    assert read.wants_context is False
    assert set(credit.schema.model_fields) == {"order_id", "amount", "on", "note"}
    with pytest.raises(InvalidArgumentsError, match="ctx"):
        credit.validate({"order_id": 1, "amount": "1", "on": "2024-05-01", "ctx": {}})


# -- offered / get -------------------------------------------------------------------------


def test_offered_refuses_compensation_only_tools(registry: ToolRegistry) -> None:
    """The agent cannot call an undo directly; the unwind finds it with ``get``."""
    with pytest.raises(UnknownToolError) as err:
        registry.offered("reverse_credit")

    assert "reverse_credit" in str(err.value)
    assert registry.get("reverse_credit").name == "reverse_credit"


def test_a_compensation_cannot_be_declared_offered() -> None:
    """A compensation is never a forward step: ``offered`` on one is refused at declaration."""
    reg = ToolRegistry()

    with pytest.raises(ToolDefinitionError, match="offered"):
        reg.compensation(offered=True)


def test_offered_refuses_a_tool_not_offered() -> None:
    """``offered=False`` keeps a forward tool away from the agent."""
    reg = ToolRegistry()

    @reg.tool(ToolClass.READ, offered=False)
    def internal(x: int) -> None: ...

    with pytest.raises(UnknownToolError, match="the agent may call: \\(none\\)"):
        reg.offered("internal")
    assert reg.get("internal").offered is False


def test_offered_finds_a_forward_tool_and_lists_the_callable_ones(registry: ToolRegistry) -> None:
    """An unknown name lists only what the agent may call."""
    assert registry.offered("get_order").name == "get_order"

    with pytest.raises(UnknownToolError) as err:
        registry.offered("refund_everything")

    assert "the agent may call: get_order, issue_credit" in str(err.value)


def test_get_unknown_tool(registry: ToolRegistry) -> None:
    """``get`` lists every known tool, compensations included."""
    with pytest.raises(UnknownToolError) as err:
        registry.get("nope")

    assert "known: get_order, issue_credit, reverse_credit" in str(err.value)


# -- build_undo / check_undo ---------------------------------------------------------------


def test_build_undo_returns_the_compensation(registry: ToolRegistry) -> None:
    """The undo holds the reference the step captured."""
    undo = registry.get("issue_credit").build_undo({"order_id": 1}, {"credit_id": "cr_9104_1"})

    assert undo == Undo("reverse_credit", {"credit_id": "cr_9104_1"}, "reverse the credit")


def test_build_undo_wraps_a_compensation_that_raises() -> None:
    """A compensation function that raises is a CompensationBuildError naming the cause."""
    reg = ToolRegistry()

    def broken(args: dict[str, Any], result: Any) -> Undo:
        return Undo("reverse_credit", {"credit_id": result["missing"]})

    @reg.tool(ToolClass.COMPENSATABLE_WRITE, compensation=broken)
    def issue_credit(order_id: int) -> dict[str, Any]:
        return {}

    with pytest.raises(CompensationBuildError) as err:
        reg.get("issue_credit").build_undo({"order_id": 1}, {})

    assert "compensation of issue_credit raised KeyError" in str(err.value)
    assert isinstance(err.value.__cause__, KeyError)


def test_build_undo_refuses_something_that_is_not_an_undo() -> None:
    """A compensation returning a dict is refused with the type it returned."""
    reg = ToolRegistry()

    def sloppy(args: dict[str, Any], result: Any) -> Undo:
        return {"tool": "reverse_credit"}  # type: ignore[return-value]

    @reg.tool(ToolClass.REVERSIBLE_WRITE, compensation=sloppy)
    def set_status(status: str) -> None: ...

    with pytest.raises(CompensationBuildError, match="returned dict, not an Undo"):
        reg.get("set_status").build_undo({"status": "open"}, None)


def test_build_undo_without_a_compensation(registry: ToolRegistry) -> None:
    """A tool with no compensation cannot build an undo."""
    with pytest.raises(CompensationBuildError, match="get_order declares no compensation"):
        registry.get("get_order").build_undo({"order_id": 1}, None)


def test_check_undo_accepts_a_good_undo(registry: ToolRegistry) -> None:
    """A valid undo comes back with its arguments in JSON form."""
    assert registry.check_undo(Undo("reverse_credit", {"credit_id": "cr_1"})) == {
        "credit_id": "cr_1"
    }


def test_check_undo_with_an_unknown_tool(registry: ToolRegistry) -> None:
    """An undo naming a tool nobody registered is unusable."""
    with pytest.raises(CompensationBuildError, match="unusable undo cancel_credit") as err:
        registry.check_undo(Undo("cancel_credit", {"credit_id": "cr_1"}))

    assert isinstance(err.value.__cause__, UnknownToolError)


def test_check_undo_with_bad_arguments(registry: ToolRegistry) -> None:
    """An undo whose arguments do not fit its tool is unusable, and says which field."""
    with pytest.raises(CompensationBuildError) as err:
        registry.check_undo(Undo("reverse_credit", {"credit": "cr_1"}))

    assert "unusable undo reverse_credit" in str(err.value)
    assert "credit_id: Field required" in str(err.value)
    assert isinstance(err.value.__cause__, InvalidArgumentsError)


def test_refusal_never_lists_a_compensation_as_callable() -> None:
    """The "agent may call" list matches what ``offered`` accepts: no compensation in it."""
    # Given a forward tool and a compensation
    reg = ToolRegistry()

    @reg.tool(ToolClass.READ)
    def get_order(order_id: int) -> None: ...

    @reg.compensation()
    def reverse_credit(credit_id: str) -> None: ...

    # When the agent asks for the compensation
    with pytest.raises(UnknownToolError) as err:
        reg.offered("reverse_credit")

    # Then the refusal does not tell it that reverse_credit is callable
    assert str(err.value).endswith("the agent may call: get_order")


def test_a_registered_tool_that_is_not_offered_is_not_called_unknown(
    registry: ToolRegistry,
) -> None:
    """Asking for a compensation says it exists but is not offered (still an UnknownToolError
    to callers that catch that); a name nobody registered stays plain "unknown"."""
    with pytest.raises(ToolNotOfferedError) as not_offered:
        registry.offered("reverse_credit")
    with pytest.raises(UnknownToolError) as unknown:
        registry.offered("refund_everything")

    assert isinstance(not_offered.value, UnknownToolError)
    assert str(not_offered.value).startswith(
        "tool 'reverse_credit' exists but is not offered to agents (it only undoes other tools' "
        "steps, when a run unwinds); the agent may call: get_order, issue_credit"
    )
    assert "unknown" not in str(not_offered.value)
    assert type(unknown.value) is UnknownToolError


def test_a_tool_registered_with_offered_false_is_named_as_not_offered() -> None:
    """``offered=False`` on a forward tool: registered, kept from the agent, and said so."""
    reg = ToolRegistry()

    @reg.tool(ToolClass.READ, offered=False)
    def internal(x: int) -> None: ...

    with pytest.raises(
        ToolNotOfferedError, match="'internal' exists but is not offered to agents; the agent"
    ):
        reg.offered("internal")


def test_a_reversal_policy_says_why_it_asks_a_person() -> None:
    """The words shown beside the question: the policy, or the predicate that said so."""
    registry = ToolRegistry()

    def over_a_thousand(args: dict[str, Any], result: Any) -> bool:
        return bool(args["n"] > 1000)

    def undo(args: dict[str, Any], result: Any) -> Undo:
        return Undo("take_back", {})

    for name, policy in (
        ("always", "ask"),
        ("costly", over_a_thousand),
        ("broken", lambda args, result: 1 / 0),
        ("never", "auto"),
    ):

        def step(ctx: StepContext, n: int) -> dict[str, Any]:
            return {}

        registry.tool(ToolClass.COMPENSATABLE_WRITE, name=name, compensation=undo, reversal=policy)(
            step
        )
    why = {
        name: registry.get(name).reversal_question({"n": 2000}, {})
        for name in ("always", "costly", "broken", "never")
    }
    assert why == {
        "always": "always always asks a person first (reversal='ask')",
        "costly": "over_a_thousand(args, result) was true for this step",
        "broken": "broken's predicate raised ZeroDivisionError: a person weighs it",
        "never": "",
    }
    assert registry.get("costly").reversal_question({"n": 5}, {}) == ""
    assert registry.get("costly").asks_before_reversal({"n": 2000}, {}) is True
