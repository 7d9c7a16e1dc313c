"""The hosted loop's plain-Python parts: declaring agents, what each call is told, the limits,
and the loop state read back from its Redis hash. No broker, no Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from saga.agents import Agent, AgentRegistry, Limits, OnFailure, OnLimit, ScriptedPolicy
from saga.agents.hosted import _limit_reached
from saga.agents.messages import ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.turn_calls import _refusal
from saga.agents.turn_state import LoopState, consecutive_refusals, result_of, transcript_until
from saga.errors import ToolDefinitionError, UnknownAgentError, UnknownToolError
from saga.model import StepState, ToolClass
from saga.picture import StepRecord
from tasks.tools import tools
from tests.conftest import ROOT

POLICY = ScriptedPolicy(["done"])


def registry() -> AgentRegistry:
    return AgentRegistry(tools)


def agent(**options: Any) -> Agent:
    return registry().declare("refund", POLICY, **options)


def test_an_agent_is_offered_only_the_tools_it_names_in_that_order() -> None:
    """The allow-list is checked against the registry and kept in the order given."""
    declared = agent(tools=["send_reply", "get_order"])
    assert declared.tool_names == ("send_reply", "get_order")
    assert "reverse_credit" not in agent().tool_names  # compensations are never offered


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"tools": ["refund_everything"]}, UnknownToolError, "unknown tool 'refund_everything'"),
        ({"tools": ["reverse_credit"]}, UnknownToolError, "is not offered to agents"),
        (
            {"on_failure": {"send_reply": "feed_back"}, "tools": ["get_order"]},
            ToolDefinitionError,
            "which it may not call",
        ),
        ({"on_failure": {"get_order": "ignore"}}, ToolDefinitionError, "use one of"),
        ({"limits": None, "deadline": 0}, ToolDefinitionError, "deadline"),
        ({"approval": ["issue_credit"]}, ToolDefinitionError, "only the irreversible"),
        ({"approval": ["send_reply"], "tools": ["get_order"]}, ToolDefinitionError, "class 5"),
    ],
)
def test_a_bad_declaration_fails_loudly(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        agent(**options)


def test_names_are_checked_and_unique() -> None:
    agents = registry()
    agents.declare("refund", POLICY)
    with pytest.raises(ToolDefinitionError, match="declared twice"):
        agents.declare("refund", POLICY)
    with pytest.raises(ToolDefinitionError, match="must match"):
        agents.declare("Refund Agent", POLICY)
    with pytest.raises(UnknownAgentError, match="known: refund"):
        agents.get("refunds")


def test_limits_are_positive_and_on_limit_takes_its_word() -> None:
    with pytest.raises(ToolDefinitionError, match="max_turns"):
        Limits(max_turns=0)
    assert Limits(on_limit="finish").on_limit is OnLimit.FINISH
    with pytest.raises(ValueError):
        Limits(on_limit="explode")


def test_reads_are_fed_back_and_writes_unwind_unless_overridden() -> None:
    """The seed's rule by default; the override is per tool."""
    declared = agent(on_failure={"set_ticket_status": OnFailure.FEED_BACK})
    modes = {t.name: declared.failure_mode(t) for t in declared.tools}
    assert modes["get_order"] is OnFailure.FEED_BACK
    assert modes["issue_credit"] is OnFailure.UNWIND
    assert modes["set_ticket_status"] is OnFailure.FEED_BACK
    assert modes["send_reply"] is OnFailure.UNWIND


# -- what a call is told ----------------------------------------------------------------------

REPLY = ToolCall("c0", "send_reply", {"to": "a@b.c", "subject": "s", "body": "b"})
CREDIT = ToolCall("c1", "issue_credit", {"order_id": 1, "amount_cents": 1})
READ = ToolCall("c2", "get_order", {"order_id": 1})


def refusal(calls: list[ToolCall], i: int) -> str:
    declared = agent()
    return _refusal(declared, calls[i], i, ModelTurn(calls=tuple(calls)))


def test_an_irreversible_call_beside_writes_waits_for_the_next_turn_whatever_its_place() -> None:
    """Before or after the credit in the answer, the reply is refused; alone, or beside a
    read, it is not."""
    assert "same answer as issue_credit" in refusal([REPLY, CREDIT], 0)
    assert "same answer as issue_credit" in refusal([CREDIT, REPLY], 1)
    assert refusal([READ, REPLY], 1) == ""
    assert refusal([CREDIT, READ], 0) == ""


def test_unknown_and_unparseable_calls_are_told_why() -> None:
    unknown = ToolCall("c3", "refund_everything", {})
    broken = ToolCall("c4", "get_order", {}, {}, "arguments are not valid JSON")
    assert refusal([unknown], 0).startswith("unknown tool 'refund_everything'; you may call: ")
    assert refusal([broken], 0) == "arguments are not valid JSON"


def step(state: StepState, result: Any = None, message: str = "") -> StepRecord:
    error = {"message": message} if message else None
    return StepRecord(1, "get_order", ToolClass.READ, {}, state, 1, result, error)


def test_each_settled_step_becomes_a_result_and_an_unsettled_one_none() -> None:
    assert result_of(READ, step(StepState.SUCCEEDED, {"id": 1}), None) == ToolResult(
        "c2", {"id": 1}
    )
    rejected = result_of(READ, step(StepState.REJECTED, message="no such order"), None)
    assert rejected == ToolResult.failure("c2", "no such order")
    assert result_of(READ, None, "refused: wait") == ToolResult.failure("c2", "refused: wait")
    assert result_of(READ, step(StepState.RUNNING), None) is None
    assert result_of(READ, None, None) is None


def test_a_result_that_could_not_be_recorded_is_an_error_for_the_model() -> None:
    """The effect happened but its result is a placeholder: the model is told why, never
    handed ``{"unrecorded": ...}`` as if it were the tool's answer; a retried success is not."""
    problem = {"type": "ToolResultError", "message": "result of get_order is 9 bytes, over 8"}
    unrecorded = {"unrecorded": problem["message"]}
    record = StepRecord(1, "get_order", ToolClass.READ, {}, StepState.SUCCEEDED, 1, unrecorded)
    told = result_of(READ, replace(record, error=problem), None)
    assert told == ToolResult.failure("c2", f"get_order ran, but {problem['message']}")
    retried = replace(record, result={"id": 1}, error={"type": "OSError", "message": "reset"})
    assert result_of(READ, retried, None) == ToolResult("c2", {"id": 1})


# -- the loop's state and limits ----------------------------------------------------------------


def fields(**extra: str) -> dict[str, str]:
    first = ModelTurn(calls=(READ,), usage=Usage(100, 10))
    results = [ToolResult.failure("c2", "no").to_dict()]
    base = {
        "name": "refund",
        "input": "Refund order 1.",
        "1:answer": json.dumps(first.to_dict()),
        "1:results": json.dumps(results),
        "1:0:refused": "no",
        "1:advanced": "next",
        "model_calls": "1",
        "tokens_in": "100",
        "tokens_out": "10",
    }
    return {**base, **extra}


def test_the_loop_state_reads_back_from_its_hash_into_a_transcript() -> None:
    state = LoopState.parse(fields())
    assert state is not None and state.current_turn == 2
    assert state.refused == {(1, 0): "no"}
    transcript = transcript_until(state, 2)
    assert transcript.last_results == (ToolResult.failure("c2", "no"),)
    assert LoopState.parse({"input": "x"}) is None  # a run.call run has no agent


def test_refusals_in_a_row_reset_on_a_success() -> None:
    ok, no = ToolResult("a", 1), ToolResult.failure("b", "no")
    state = LoopState("a", "i", results={1: (no, no), 2: (ok, no), 3: (no,)})
    assert consecutive_refusals(state, 4) == 2
    assert consecutive_refusals(state, 2) == 2
    assert consecutive_refusals(state, 3) == 1


@pytest.mark.parametrize(
    ("limits", "extra", "turn", "expected"),
    [
        (Limits(max_turns=1), {}, 2, (OnLimit.UNWIND, "turn limit: 1 turns")),
        (Limits(token_budget=110, on_limit="finish"), {}, 2, (OnLimit.FINISH, "token budget")),
        (Limits(token_budget=111), {}, 2, None),
        (Limits(max_consecutive_refusals=1), {}, 2, None),
        (Limits(), {"bytes": "5000"}, 2, (OnLimit.UNWIND, "transcript limit")),
    ],
)
def test_limits_are_checked_before_each_model_call(
    limits: Limits, extra: dict[str, str], turn: int, expected: tuple[OnLimit, str] | None
) -> None:
    state = LoopState.parse(fields(**extra))
    assert state is not None
    reached = _limit_reached(agent(limits=limits), state, turn, 4096)
    if expected is None:
        assert reached is None
    else:
        assert reached is not None and reached[0] == expected[0]
        assert reached[1].startswith(expected[1])


def test_too_many_refusals_always_unwind() -> None:
    no = ToolResult.failure("b", "no")
    state = LoopState("a", "i", results={1: (no, no, no)})
    limits = Limits(max_consecutive_refusals=2, on_limit="finish")
    assert _limit_reached(agent(limits=limits), state, 2, 4096) == (
        OnLimit.UNWIND,
        "3 refused or failed calls in a row",
    )


def test_a_web_app_needs_no_tool_code_to_use_the_client() -> None:
    """``saga.client`` imports no tools (no ``tasks``) and a Client needs only two URLs."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from saga.client import Client; "
            "Client('redis://127.0.0.1:1/0', 'redis://127.0.0.1:1/0'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tasks'))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("flag", "events"), [(None, False), ("0", False), ("1", True)])
def test_turns_send_task_events_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, events: bool
) -> None:
    """Flower lists hosted turns only with SAGA_TURN_EVENTS=1; tool calls always send theirs."""
    from celery import Celery

    from saga import Saga, Settings
    from saga.constants import AGENT_TURN_TASK, START_UNWIND_TASK, tool_task_name

    if flag is None:
        monkeypatch.delenv("SAGA_TURN_EVENTS", raising=False)
    else:
        monkeypatch.setenv("SAGA_TURN_EVENTS", flag)
    app = Celery("turn-events", broker="redis://127.0.0.1:1/0")  # never contacted
    Saga(app, tools, Settings.from_env())
    assert app.tasks[AGENT_TURN_TASK].send_events is events
    assert app.tasks[START_UNWIND_TASK].send_events is events
    assert app.tasks[tool_task_name("issue_credit")].send_events is True


def test_a_bad_turn_events_flag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from saga import Settings

    monkeypatch.setenv("SAGA_TURN_EVENTS", "sometimes")
    with pytest.raises(ValueError, match="SAGA_TURN_EVENTS must be 1 or 0"):
        Settings.from_env()


def test_a_turn_message_shows_its_arguments_as_celery_would_repr_them() -> None:
    """send_turn writes the repr itself; Flower must still show what saferepr would."""
    from celery import Celery
    from celery.utils.saferepr import saferepr

    from saga.agents.launch import send_turn

    app = Celery("repr-check", broker="memory://")
    sent: list[Any] = []
    app.amqp.send_task_message = lambda producer, name, message, **options: sent.append(message)
    run_id = "3f2a" * 8
    send_turn(app, run_id, 7)
    headers = sent[0].headers
    assert headers["kwargsrepr"] == saferepr({"run_id": run_id, "turn": 7})
    assert headers["argsrepr"] == saferepr(())
