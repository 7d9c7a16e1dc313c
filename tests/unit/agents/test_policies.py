"""Policies decide the next turn: a script, any function, or a model behind a client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from saga.agents import (
    ChatModelPolicy,
    ModelCallError,
    ModelTurn,
    Policy,
    ScriptedPolicy,
    ScriptStep,
    ToolCall,
    ToolResult,
    Transcript,
    offered_tools,
    take_turn,
)
from saga.tools import Tool
from tasks.tools import tools as demo_tools

TOOLS = offered_tools(demo_tools)


def started() -> Transcript:
    transcript = Transcript()
    transcript.add_user("Refund order 4921.")
    return transcript


def answer_all(transcript: Transcript, content: Any = "ok") -> None:
    transcript.add_results([ToolResult(c.id, content) for c in transcript.pending_calls])


def test_a_script_plays_calls_then_a_final_answer() -> None:
    """Step 1: two calls in one turn; step 2: one call; step 3: the answer."""
    policy = ScriptedPolicy(
        [
            [("get_order", {"order_id": 4921}), ("set_ticket_status", {"ticket_id": 7})],
            ("issue_credit", {"order_id": 4921, "amount_cents": 250_000}),
            "Done.",
        ]
    )
    transcript = started()

    first = take_turn(policy, transcript, TOOLS)
    answer_all(transcript)
    second = take_turn(policy, transcript, TOOLS)
    answer_all(transcript)
    third = take_turn(policy, transcript, TOOLS)

    assert [(c.id, c.name) for c in first.calls] == [
        ("call_0_0", "get_order"),
        ("call_0_1", "set_ticket_status"),
    ]
    assert [c.arguments for c in second.calls] == [{"order_id": 4921, "amount_cents": 250_000}]
    assert (third.finished, third.text) == (True, "Done.")
    assert len(transcript.turns) == 3


def test_a_step_can_react_to_the_previous_results() -> None:
    """``lambda results: ...`` sees what the tools answered and picks the next move."""

    def after_lookup(results: tuple[ToolResult, ...]) -> Any:
        order = results[0].content
        if order["status"] == "paid":
            return [("issue_credit", {"order_id": order["id"], "amount_cents": order["total"]})]
        return "Nothing to refund."

    policy = ScriptedPolicy([[("get_order", {"order_id": 4921})], after_lookup])
    transcript = started()
    take_turn(policy, transcript, TOOLS)
    answer_all(transcript, {"id": 4921, "status": "paid", "total": 250_000})

    turn = take_turn(policy, transcript, TOOLS)

    assert turn.calls[0].arguments == {"order_id": 4921, "amount_cents": 250_000}


def test_a_script_is_stateless_so_it_resumes_anywhere() -> None:
    """A fresh policy object on a transcript halfway through plays the next step (as a new
    Celery task would)."""
    steps: list[ScriptStep] = [[("get_order", {"order_id": 1})], "Done."]
    transcript = started()
    take_turn(ScriptedPolicy(steps), transcript, TOOLS)
    answer_all(transcript)
    assert take_turn(ScriptedPolicy(steps), transcript, TOOLS).text == "Done."


def test_a_script_past_its_end_is_a_fatal_model_error() -> None:
    transcript = started()
    take_turn(ScriptedPolicy(["Done."]), transcript, TOOLS)
    transcript.add_user("And?")
    with pytest.raises(ModelCallError, match=r"the script has 1 turn\(s\); turn 2") as err:
        ScriptedPolicy(["Done."])(transcript, TOOLS)
    assert err.value.retryable is False


def test_script_steps_may_be_ready_turns_and_calls() -> None:
    turn = ModelTurn(calls=(ToolCall("x", "get_order", {"order_id": 1}),))
    assert ScriptedPolicy([turn])(started(), TOOLS) is turn
    mixed = ScriptedPolicy([[ToolCall("y", "get_order", {}), ("send_reply", {})]])
    assert [c.id for c in mixed(started(), TOOLS).calls] == ["y", "call_0_1"]


@pytest.mark.parametrize("step", [[], [("get_order",)], [42]])
def test_a_malformed_step_says_what_it_wanted(step: Any) -> None:
    with pytest.raises(TypeError, match="script step 0"):
        ScriptedPolicy([step])(started(), TOOLS)


def test_any_callable_is_a_policy() -> None:
    """A plain function with the policy's signature needs no wrapper."""

    def echo(transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn:
        return ModelTurn(text=f"{len(tools)} tools, {len(transcript)} entries")

    policy: Policy = echo
    assert take_turn(policy, started(), TOOLS).text == "5 tools, 1 entries"


def test_a_policy_must_return_a_turn() -> None:
    transcript = started()
    with pytest.raises(TypeError, match="must return a ModelTurn, not str"):
        take_turn(lambda t, tools: "Done.", transcript, TOOLS)  # type: ignore[arg-type]
    assert len(transcript) == 1


@pytest.mark.parametrize(
    "option", ["messages", "input", "instructions", "tools", "max_completion_tokens"]
)
def test_chat_model_policy_refuses_options_it_sets_itself(option: str) -> None:
    with pytest.raises(TypeError, match=f"sets {option} itself"):
        options: dict[str, Any] = {option: 1}
        ChatModelPolicy(object(), "m", "anthropic", **options)


def test_chat_model_policy_refuses_streaming() -> None:
    with pytest.raises(TypeError, match="streaming is not supported"):
        ChatModelPolicy(object(), "m", "openai_chat", stream=True)


def test_chat_model_policy_builds_the_request_without_sending_it() -> None:
    """Max tokens goes under each format's own name; Anthropic gets a default."""
    transcript = started()
    anthropic = ChatModelPolicy(object(), "claude", "anthropic", system="S", temperature=0)
    chat = ChatModelPolicy(object(), "gpt", "openai_chat", max_tokens=99)
    responses = ChatModelPolicy(object(), "o4", "openai_responses", max_tokens=99)

    assert anthropic.request(transcript, [])["max_tokens"] == 4096
    assert anthropic.request(transcript, [])["temperature"] == 0
    assert "tools" not in anthropic.request(transcript, [])
    assert chat.request(transcript, TOOLS)["max_completion_tokens"] == 99
    assert len(chat.request(transcript, TOOLS)["tools"]) == 5
    assert responses.request(transcript, TOOLS)["max_output_tokens"] == 99
    assert "max_tokens" not in chat.request(transcript, TOOLS)


def test_chat_model_policy_lets_bugs_propagate() -> None:
    """An error that is not about reaching the model is a bug: it is not disguised."""

    class Broken:
        @property
        def messages(self) -> Any:
            raise KeyError("no")

    with pytest.raises(KeyError):
        ChatModelPolicy(Broken(), "m", "anthropic")(started(), TOOLS)
