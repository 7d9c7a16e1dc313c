"""The integrations without a broker: which tools each framework is offered and how they are
described, which options are refused, and how one call's answer is sorted (a result, a
refusal the model is told, or an error that stops the agent). The calls themselves, on a real
worker, are in ``tests/integration/test_integrations.py``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from saga import Run, Settings, StepFailedError, ToolClass
from saga.agents import CLASS_SENTENCES
from saga.agents.schema import describe, json_schema
from saga.errors import (
    CallRefusedError,
    InvalidArgumentsError,
    StepRejectedError,
    ToolDefinitionError,
    ToolNotOfferedError,
)
from saga.integrations import openai_agents, pydantic_ai
from saga.integrations._bridge import Refusal, ToolBridge
from tasks.tools import tools as demo_tools

OFFERED = ["get_order", "issue_credit", "set_ticket_status", "send_reply", "notify_webhook"]


class FakeHandle:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def result(self, timeout: float | None = None) -> Any:
        assert timeout == 5.0  # the bridge's own bound, never the default
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class FakeSaga:
    """Just what a ``Run`` is asked by the integrations: its registry, settings and dispatcher."""

    def __init__(self, outcome: Any = None) -> None:
        self.registry = demo_tools
        self.settings = Settings()
        self.outcome = outcome
        self.dispatched: list[tuple[str, dict[str, Any], bool]] = []

    def dispatch(
        self, run_id: str, tool: str, args: dict[str, Any], *, feed_back_failure: bool = False
    ) -> FakeHandle:
        self.dispatched.append((tool, args, feed_back_failure))
        if isinstance(self.outcome, CallRefusedError | InvalidArgumentsError):
            raise self.outcome
        return FakeHandle(self.outcome)


class FakeRun(Run):
    """A ``Run`` whose calls come back as the fake's outcome, not a step in Redis."""

    def dispatch(self, tool: str, args: dict[str, Any], *, feed_back_failure: bool) -> Any:
        return self.core.dispatch(self.run_id, tool, args, feed_back_failure=feed_back_failure)


def fake_run(outcome: Any = None) -> Run:
    return FakeRun(FakeSaga(outcome), "r1")  # type: ignore[arg-type]


def test_pydantic_ai_is_offered_every_forward_tool_with_our_schema_and_its_class() -> None:
    # Given the demo registry / When its tools become a Pydantic AI toolset
    toolset = pydantic_ai.SagaToolset(fake_run())
    # Then every tool the agent may call is there, and no compensation
    assert list(toolset.definitions) == OFFERED
    for name, definition in toolset.definitions.items():
        tool = demo_tools.get(name)
        assert definition.parameters_json_schema == json_schema(tool)
        assert definition.description == describe(tool)
        assert tool.tool_class is not None
        assert definition.description.endswith(CLASS_SENTENCES[tool.tool_class])
    assert "reverse_credit" not in toolset.definitions


def test_openai_agents_is_offered_every_forward_tool_with_our_schema_and_its_class() -> None:
    # Given the demo registry / When its tools become function tools, the mail needing approval
    made = openai_agents.function_tools(fake_run(), approval=["send_reply"])
    # Then every tool the agent may call is there, described as our loop describes it
    assert [t.name for t in made] == OFFERED
    for function_tool in made:
        tool = demo_tools.get(function_tool.name)
        assert function_tool.params_json_schema == json_schema(tool)
        assert function_tool.description == describe(tool)
        assert function_tool.strict_json_schema is False
        assert function_tool.needs_approval is (function_tool.name == "send_reply")


def test_an_allow_list_narrows_the_tools_and_refuses_a_compensation() -> None:
    toolset = pydantic_ai.SagaToolset(fake_run(), tools=["get_order", "send_reply"])
    assert list(toolset.definitions) == ["get_order", "send_reply"]
    with pytest.raises(ToolNotOfferedError, match="only undoes other tools"):
        openai_agents.function_tools(fake_run(), tools=["reverse_credit"])


def test_strict_schemas_need_every_parameter_required() -> None:
    # issue_credit's memo is optional: OpenAI's strict mode would refuse it
    with pytest.raises(ToolDefinitionError, match=r"issue_credit cannot be strict.*memo"):
        openai_agents.function_tools(fake_run(), strict=True)
    (only,) = openai_agents.function_tools(fake_run(), tools=["get_order"], strict=True)
    assert only.strict_json_schema is True


def test_only_irreversible_tools_can_wait_for_approval_and_options_are_checked() -> None:
    with pytest.raises(ToolDefinitionError, match="only the irreversible"):
        pydantic_ai.SagaToolset(fake_run(), approval=["issue_credit"])
    with pytest.raises(ToolDefinitionError, match="which it may not call"):
        openai_agents.function_tools(
            fake_run(), tools=["get_order"], on_failure={"send_reply": "x"}
        )
    with pytest.raises(ToolDefinitionError, match="timeout"):
        pydantic_ai.SagaToolset(fake_run(), timeout=0)


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("saga.integrations.pydantic_ai", "pydantic-ai"),
        ("saga.integrations.openai_agents", "openai-agents"),
    ],
)
def test_without_its_framework_an_integration_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, extra: str
) -> None:
    # Given the framework cannot be imported (None in sys.modules blocks the import)
    framework = "pydantic_ai" if extra == "pydantic-ai" else "agents"
    monkeypatch.setitem(sys.modules, framework, None)
    monkeypatch.delitem(sys.modules, module)
    # When the integration is imported / Then the error names the extra
    with pytest.raises(ImportError, match=rf"pip install 'saga-compensation\[{extra}\]'"):
        importlib.import_module(module)


def bridge(outcome: Any, **options: Any) -> tuple[ToolBridge, FakeSaga]:
    run = fake_run(outcome)
    return ToolBridge(run, owner="the test", timeout=5.0, **options), run.core  # type: ignore[return-value]


def test_a_result_comes_back_and_reads_are_fed_back_while_writes_unwind() -> None:
    made, saga = bridge({"order_id": 1})
    assert made.call("get_order", {"order_id": 1}) == {"order_id": 1}
    made.call("issue_credit", {"order_id": 1, "amount_cents": 5})
    # a failed read is the model's to handle; a failed write unwinds (our loop's defaults)
    assert [feed_back for _, _, feed_back in saga.dispatched] == [True, False]
    overridden, saga = bridge(None, on_failure={"issue_credit": "feed_back"})
    overridden.call("issue_credit", {"order_id": 1, "amount_cents": 5})
    assert saga.dispatched[0][2] is True


@pytest.mark.parametrize(
    "outcome",
    [
        InvalidArgumentsError("invalid arguments for get_order: order_id: ..."),
        CallRefusedError("send_reply is irreversible (class 5) and is refused while ..."),
        StepRejectedError("r1", 2, "issue_credit", "credit exceeds the order total"),
    ],
    ids=["bad arguments", "pivot rules", "tool rejected"],
)
def test_what_the_model_can_fix_becomes_a_refusal(outcome: Exception) -> None:
    made, _ = bridge(outcome)
    answer = made.call("get_order", {"order_id": 1})
    assert isinstance(answer, Refusal)
    expected = outcome.error if isinstance(outcome, StepRejectedError) else str(outcome)
    assert answer.message == expected


def test_a_failed_write_is_raised_and_an_unknown_tool_refused() -> None:
    made, _ = bridge(StepFailedError("r1", 2, "issue_credit", "billing is down"))
    with pytest.raises(StepFailedError):
        made.call("issue_credit", {"order_id": 1, "amount_cents": 5})
    narrow, saga = bridge(None, tools=["get_order"])
    refused = narrow.call("send_reply", {})
    assert isinstance(refused, Refusal)
    assert refused.message == "unknown tool 'send_reply'; you may call: get_order"
    assert saga.dispatched == []


def test_an_irreversible_call_beside_writes_is_refused_beside_reads_it_is_not() -> None:
    made, _ = bridge(None)
    refused = made.beside_writes("send_reply", ["get_order", "issue_credit"])
    assert refused is not None
    assert "same answer as issue_credit" in refused.message
    assert made.beside_writes("send_reply", ["get_order", "unknown_tool"]) is None
    assert made.beside_writes("issue_credit", ["set_ticket_status"]) is None
    assert made.class_of("send_reply") is ToolClass.IRREVERSIBLE_WRITE
