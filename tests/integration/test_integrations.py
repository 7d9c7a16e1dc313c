"""Agents of other frameworks on a real worker: each tool call of a Pydantic AI agent and of an
OpenAI Agents SDK agent is a step of a saga run, checked in the demo's three systems.

The models are the frameworks' own test doubles, scripted (Pydantic AI's ``FunctionModel``,
the Agents SDK's ``ScriptedModel``): no network, and every model turn is known in advance.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner
from agents.exceptions import UserError
from agents.testing import ScriptedModel, assistant_message, function_call
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import DeferredToolRequests, DeferredToolResults
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from saga import RunState, StepFailedError
from saga.integrations.openai_agents import function_tools
from saga.integrations.pydantic_ai import SagaToolset
from tasks import systems
from tests.integration.helpers import CREDIT, EMAIL, ORDER, TICKET

pytestmark = pytest.mark.timeout(90)

#: One model turn: the calls it asks for, in order, or its final text.
Turn = list[tuple[str, Any]] | str

GET_ORDER = ("get_order", {"order_id": ORDER})
ISSUE_CREDIT = ("issue_credit", {"order_id": ORDER, "amount_cents": CREDIT, "memo": "late"})
SET_TICKET = ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"})
SEND_REPLY = ("send_reply", {"to": EMAIL, "subject": "Your credit", "body": "We credited you."})
CREDIT_SCENARIO: list[Turn] = [[GET_ORDER], [ISSUE_CREDIT], [SET_TICKET], [SEND_REPLY], "Done."]
#: How long one tool call may wait for its step in these tests.
WAIT = 20.0


def world() -> dict[str, Any]:
    """The effects in the three systems: credits and reversals, the ticket, the mails."""
    entries = systems.ledger(ORDER)
    return {
        "credits": [e["amount_cents"] for e in entries if e["kind"] == "credit"],
        "reversals": [e["amount_cents"] for e in entries if e["kind"] == "reversal"],
        "ticket": systems.get_ticket(TICKET)["status"],
        "mails": [m["recipient"] for m in systems.outbox()],
    }


COMPLETED_WORLD = {
    "credits": [CREDIT],
    "reversals": [],
    "ticket": "pending_refund",
    "mails": [EMAIL],
}


# -- Pydantic AI ----------------------------------------------------------------------------


class PydanticScript:
    """A ``FunctionModel`` playing ``turns`` in order, keeping what each turn was shown."""

    def __init__(self, turns: Sequence[Turn]) -> None:
        self.turns = list(turns)
        self.shown: list[dict[str, Any]] = []
        self.model = FunctionModel(self.respond)

    def respond(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        index = sum(isinstance(m, ModelResponse) for m in messages)
        returns = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        self.shown.append({p.tool_name: p.content for p in returns})
        turn = self.turns[index]
        if isinstance(turn, str):
            return ModelResponse(parts=[TextPart(turn)])
        calls = [
            ToolCallPart(name, args, tool_call_id=f"t{index}c{i}")
            for i, (name, args) in enumerate(turn)
        ]
        return ModelResponse(parts=calls)


def pydantic_agent(script: PydanticScript) -> PydanticAgent[None, Any]:
    return PydanticAgent(script.model, output_type=[str, DeferredToolRequests])


def run_pydantic(agent: PydanticAgent[None, Any], prompt: str | None, **options: Any) -> Any:
    """One agent run on a loop of its own (``run_sync`` would keep a loop open past the test)."""
    return asyncio.run(agent.run(prompt, **options))


def test_pydantic_ai_runs_the_credit_scenario_as_saga_steps(saga: Any) -> None:
    # Given a run and a scripted agent calling the four tools in order
    run = saga.start_run()
    script = PydanticScript(CREDIT_SCENARIO)
    # When it runs with the run's tools
    result = run_pydantic(
        pydantic_agent(script),
        "Order 4921 arrived late.",
        toolsets=[SagaToolset(run, timeout=WAIT)],
    )
    picture = run.finish(timeout=20)
    # Then each call was a step, the mail is the pivot, and the world has every effect once
    assert result.output == "Done."
    assert picture.state is RunState.COMPLETED
    assert [s.tool for s in picture.steps] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert picture.pivot_step == 4
    assert script.shown[2]["issue_credit"]["amount_cents"] == CREDIT  # the result came back
    assert world() == COMPLETED_WORLD


def test_pydantic_ai_an_early_mail_is_refused_and_fed_back_then_sent(saga: Any) -> None:
    # Given an agent that asks for the mail in the same answer as the credit
    run = saga.start_run()
    script = PydanticScript([[ISSUE_CREDIT, SEND_REPLY], [SET_TICKET], [SEND_REPLY], "Done."])
    # When it runs
    run_pydantic(
        pydantic_agent(script),
        "Order 4921 arrived late.",
        toolsets=[SagaToolset(run, timeout=WAIT)],
    )
    # Then the mail was refused, told why, never reserved; asked again later, it went out once
    told = script.shown[1]["send_reply"]
    assert "irreversible (class 5)" in told and "same answer as issue_credit" in told
    assert script.shown[1]["issue_credit"]["amount_cents"] == CREDIT
    picture = run.finish(timeout=20)
    assert [s.tool for s in picture.steps] == ["issue_credit", "set_ticket_status", "send_reply"]
    assert world() == COMPLETED_WORLD


def test_pydantic_ai_bad_arguments_and_a_rejection_are_fed_back(saga: Any) -> None:
    # Given an agent that first sends a string amount, then too much, then the right credit
    run = saga.start_run()
    as_text = ("issue_credit", {"order_id": ORDER, "amount_cents": "2500"})
    too_much = ("issue_credit", {"order_id": ORDER, "amount_cents": 10_000_000})
    script = PydanticScript([[as_text], [too_much], [ISSUE_CREDIT], "Done."])
    # When it runs (three refusals are within the tool's retries)
    run_pydantic(
        pydantic_agent(script), "Credit order 4921.", toolsets=[SagaToolset(run, timeout=WAIT)]
    )
    # Then the model read what was wrong each time, and only the right credit happened
    assert (
        'amount_cents: Input should be a valid integer, got "2500" (a string)'
        in script.shown[1]["issue_credit"]
    )
    assert "exceeds order total" in script.shown[2]["issue_credit"]
    picture = run.finish(timeout=20)
    assert [s.state.value for s in picture.steps] == ["rejected", "succeeded"]
    assert world()["credits"] == [CREDIT]


def test_pydantic_ai_a_failed_write_stops_the_agent_and_unwinds_the_credit(saga: Any) -> None:
    # Given the ticket system is down
    systems.set_down("tickets")
    run = saga.start_run()
    script = PydanticScript(CREDIT_SCENARIO)
    # When the agent reaches the ticket update
    with pytest.raises(StepFailedError) as failed:
        run_pydantic(
            pydantic_agent(script),
            "Order 4921 arrived late.",
            toolsets=[SagaToolset(run, timeout=WAIT)],
        )
    # Then the agent stopped there, and the run unwound: the credit is reversed, no mail
    assert failed.value.tool == "set_ticket_status"
    assert len(script.shown) == 3  # the model was not asked again
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert world() == {"credits": [CREDIT], "reversals": [-CREDIT], "ticket": "open", "mails": []}


def test_pydantic_ai_an_approved_mail_waits_for_a_person(saga: Any) -> None:
    # Given the mail needs a person's approval
    run = saga.start_run()
    script = PydanticScript([[ISSUE_CREDIT], [SEND_REPLY], "Done."])
    agent = pydantic_agent(script)
    toolset = SagaToolset(run, approval=["send_reply"], timeout=WAIT)
    # When the agent asks for it, the run stops with the request, and nothing was sent
    first = run_pydantic(agent, "Order 4921 arrived late.", toolsets=[toolset])
    assert isinstance(first.output, DeferredToolRequests)
    assert [c.tool_name for c in first.output.approvals] == ["send_reply"]
    assert world()["mails"] == []
    # and once approved, it goes out
    approvals = {c.tool_call_id: True for c in first.output.approvals}
    second = run_pydantic(
        agent,
        None,
        message_history=first.all_messages(),
        deferred_tool_results=DeferredToolResults(approvals=approvals),
        toolsets=[toolset],
    )
    assert second.output == "Done."
    assert run.finish(timeout=20).pivot_step == 2
    assert world()["mails"] == [EMAIL]


# -- OpenAI Agents SDK ----------------------------------------------------------------------


def scripted(turns: Sequence[Turn]) -> ScriptedModel:
    """The Agents SDK's own test model, playing ``turns``; a call's arguments may be raw text."""
    steps: list[Any] = []
    for index, turn in enumerate(turns):
        if isinstance(turn, str):
            steps.append([assistant_message(turn)])
            continue
        steps.append(
            [
                function_call(name, args, call_id=f"t{index}c{i}")
                for i, (name, args) in enumerate(turn)
            ]
        )
    return ScriptedModel(steps)


def shown(model: ScriptedModel, turn: int) -> dict[str, str]:
    """The outputs of turn ``turn``'s calls, by call id, as the model read them the turn after."""
    call = model.calls[turn + 1]
    items = call.input if isinstance(call.input, list) else []
    prefix = f"t{turn}c"
    return {
        item["call_id"]: item["output"]
        for item in items
        if isinstance(item, dict)
        and item.get("type") == "function_call_output"
        and str(item.get("call_id", "")).startswith(prefix)
    }


def run_openai(model: ScriptedModel, tools: list[Any]) -> tuple[Agent[Any], Any]:
    """The agent, and its run on the prompt (tracing off: nothing leaves the machine)."""
    agent = Agent(name="refunds", instructions="Make it right.", model=model, tools=tools)
    return agent, resume(agent, "Order 4921 arrived late.")


def resume(agent: Agent[Any], prompt: Any) -> Any:
    return asyncio.run(Runner.run(agent, prompt, run_config=RunConfig(tracing_disabled=True)))


def test_openai_agents_runs_the_credit_scenario_as_saga_steps(saga: Any) -> None:
    # Given a run and a scripted agent calling the four tools in order
    run = saga.start_run()
    model = scripted(CREDIT_SCENARIO)
    # When it runs with the run's tools
    _, result = run_openai(model, function_tools(run, timeout=WAIT))
    picture = run.finish(timeout=20)
    # Then each call was a step, the mail is the pivot, and the world has every effect once
    assert result.final_output == "Done."
    assert picture.state is RunState.COMPLETED
    assert [s.tool for s in picture.steps] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert picture.pivot_step == 4
    assert json.loads(shown(model, 1)["t1c0"])["amount_cents"] == CREDIT
    assert world() == COMPLETED_WORLD


def test_openai_agents_an_early_mail_is_refused_and_fed_back_then_sent(saga: Any) -> None:
    # Given an agent that asks for the mail first, in the same answer as the credit
    run = saga.start_run()
    model = scripted([[SEND_REPLY, ISSUE_CREDIT], [SET_TICKET], [SEND_REPLY], "Done."])
    # When it runs (the SDK runs the answer's calls concurrently)
    run_openai(model, function_tools(run, timeout=WAIT))
    # Then the mail was refused and told why, while the credit went through
    first = shown(model, 0)
    assert "same answer as issue_credit" in json.loads(first["t0c0"])["error"]
    assert json.loads(first["t0c1"])["amount_cents"] == CREDIT
    # and asked again once the writes had settled, it went out once
    picture = run.finish(timeout=20)
    assert [s.tool for s in picture.steps] == ["issue_credit", "set_ticket_status", "send_reply"]
    assert world() == COMPLETED_WORLD


def test_openai_agents_bad_arguments_and_a_rejection_are_fed_back(saga: Any) -> None:
    # Given an agent that sends broken JSON, then a string amount, then too much, then right
    run = saga.start_run()
    turns: list[Turn] = [
        [("issue_credit", '{"order_id": 4921, "amount_cents": ')],
        [("issue_credit", {"order_id": ORDER, "amount_cents": "2500"})],
        [("issue_credit", {"order_id": ORDER, "amount_cents": 10_000_000})],
        [ISSUE_CREDIT],
        "Done.",
    ]
    model = scripted(turns)
    # When it runs
    run_openai(model, function_tools(run, timeout=WAIT))
    # Then the model read what was wrong each time, and only the right credit happened
    errors = [json.loads(shown(model, k)[f"t{k}c0"])["error"] for k in range(3)]
    assert errors[0].startswith("arguments are not valid JSON")
    assert 'got "2500" (a string)' in errors[1]
    assert "exceeds order total" in errors[2]
    picture = run.finish(timeout=20)
    assert [s.state.value for s in picture.steps] == ["rejected", "succeeded"]
    assert world()["credits"] == [CREDIT]


def test_openai_agents_a_failed_write_stops_the_agent_and_unwinds_the_credit(saga: Any) -> None:
    # Given the ticket system is down
    systems.set_down("tickets")
    run = saga.start_run()
    model = scripted(CREDIT_SCENARIO)
    # When the agent reaches the ticket update, the SDK stops with the saga's error as cause
    with pytest.raises(UserError) as stopped:
        run_openai(model, function_tools(run, timeout=WAIT))
    assert isinstance(stopped.value.__cause__, StepFailedError)
    assert stopped.value.__cause__.tool == "set_ticket_status"
    assert len(model.calls) == 3  # the model was not asked again
    # Then the run unwound: the credit is reversed, no mail
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert world() == {"credits": [CREDIT], "reversals": [-CREDIT], "ticket": "open", "mails": []}


def test_openai_agents_an_approved_mail_waits_for_a_person(saga: Any) -> None:
    # Given the mail needs a person's approval
    run = saga.start_run()
    model = scripted([[ISSUE_CREDIT], [SEND_REPLY], "Done."])
    tools = function_tools(run, approval=["send_reply"], timeout=WAIT)
    # When the agent asks for it, the run stops with an interruption, and nothing was sent
    agent, first = run_openai(model, tools)
    assert [i.tool_name for i in first.interruptions] == ["send_reply"]
    assert world()["mails"] == []
    # and once approved, it goes out
    state = first.to_state()
    for interruption in first.interruptions:
        state.approve(interruption)
    second = resume(agent, state)
    assert second.final_output == "Done."
    assert run.finish(timeout=20).pivot_step == 2
    assert world()["mails"] == [EMAIL]
