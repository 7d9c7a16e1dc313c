"""Reading a model's answer: its tool calls, its text, why it stopped, what it cost.

From the recorded response bodies as plain dicts, and as the SDKs' own response objects.
"""

from __future__ import annotations

import pytest

from saga.agents import ModelFormat, ModelTurn, ToolCall, Usage, parse_response
from saga.agents.wire import parse_arguments
from tests.unit.agents.helpers import body, sdk

#: The call ids, names and arguments of each format's parallel-calls recording.
PARALLEL = {
    ModelFormat.OPENAI_CHAT: ["call_8WjKq3Lm2NpR5sTv7XyZ1aBc", "call_Qd4Fg6Hj8Kl0Mn2Pq4Rs6Tu8"],
    ModelFormat.OPENAI_RESPONSES: [
        "call_Hn4Km6Pq8Rs0Tu2Vw4Xy6Za8",
        "call_Bc1De3Fg5Hi7Jk9Lm1No3Pq5",
    ],
    ModelFormat.ANTHROPIC: ["toolu_01A09q90qw90lq917835lq9", "toolu_01BpWx7rGn3kQ2tJmV8yLcZe"],
}
USAGE = {
    ModelFormat.OPENAI_CHAT: Usage(412, 58),
    ModelFormat.OPENAI_RESPONSES: Usage(398, 189),
    ModelFormat.ANTHROPIC: Usage(1204, 112),
}
STOP = {
    ModelFormat.OPENAI_CHAT: ("tool_calls", "stop"),
    ModelFormat.OPENAI_RESPONSES: ("completed", "completed"),
    ModelFormat.ANTHROPIC: ("tool_use", "end_turn"),
}


def test_parallel_calls_in_one_answer(fmt: ModelFormat) -> None:
    """Two calls in one answer come out as two ToolCalls, in order, with object arguments."""
    turn = parse_response(fmt, body(fmt, "parallel_tool_calls"))

    assert [c.id for c in turn.calls] == PARALLEL[fmt]
    assert [c.name for c in turn.calls] == ["get_order", "set_ticket_status"]
    assert [c.arguments for c in turn.calls] == [
        {"order_id": 4921},
        {"ticket_id": 77, "status": "pending_refund"},
    ]
    assert all(c.error is None for c in turn.calls)
    assert not turn.finished
    assert turn.usage == USAGE[fmt]
    assert turn.stop_reason == STOP[fmt][0]
    assert turn.format is fmt
    assert turn.raw == body(fmt, "parallel_tool_calls")


def test_text_beside_calls_is_kept() -> None:
    """Anthropic may say something before its tool use; the text is part of the turn."""
    turn = parse_response("anthropic", body("anthropic", "parallel_tool_calls"))
    assert turn.text == "I'll look up the order and mark the ticket while I do."


def test_a_final_answer(fmt: ModelFormat) -> None:
    """No calls: the turn is finished, and its text is the answer."""
    turn = parse_response(fmt, body(fmt, "final_answer"))

    assert turn.finished
    assert turn.calls == ()
    assert turn.text.startswith("I issued a $2,500.00 credit on order 4921")
    assert turn.stop_reason == STOP[fmt][1]
    assert not turn.truncated


def test_an_unknown_tool_name_is_kept(fmt: ModelFormat) -> None:
    """Parsing keeps a call to a tool nobody registered; refusing it is the dispatcher's job."""
    [call] = parse_response(fmt, body(fmt, "unknown_tool")).calls
    assert call.name == "refund_everything"
    assert call.arguments == {"order_id": 4921}
    assert call.error is None


@pytest.mark.parametrize("fmt_value", ["openai_chat", "openai_responses"])
def test_invalid_json_arguments_become_an_error_result_not_an_exception(fmt_value: str) -> None:
    """Truncated arguments: the call is kept with an error the model can read and fix."""
    turn = parse_response(fmt_value, body(fmt_value, "invalid_arguments"))
    broken = next(c for c in turn.calls if c.name == "issue_credit")

    assert broken.arguments == {}
    assert broken.error is not None
    assert broken.error.startswith("arguments are not valid JSON (Unterminated string")
    assert '"memo":' in broken.error.replace(" ", "")
    result = broken.error_result()
    assert result.call_id == broken.id
    assert result.is_error
    assert result.content == {"error": broken.error}
    # The other call of the same answer is unaffected.
    assert all(c.error is None for c in turn.calls if c is not broken)


@pytest.mark.parametrize(
    ("text", "arguments", "error"),
    [
        ('{"a": 1}', {"a": 1}, None),
        ("", {}, None),
        (None, {}, None),
        ("[1, 2]", {}, "arguments must be a JSON object, got [1, 2]"),
        ("42", {}, "arguments must be a JSON object, got 42"),
        (7, {}, "arguments must be a JSON object, got int"),
    ],
)
def test_argument_strings(text: object, arguments: dict[str, int], error: str | None) -> None:
    """Empty means no arguments; anything but an object is the model's error to fix."""
    assert parse_arguments(text) == (arguments, error)


def test_anthropic_input_that_is_not_an_object_is_an_error() -> None:
    message = body("anthropic", "unknown_tool")
    message["content"][0]["input"] = "order 4921"
    [call] = parse_response("anthropic", message).calls
    assert call.error == 'arguments must be a JSON object, got "order 4921"'


def test_a_truncated_answer_is_finished_and_says_so() -> None:
    """Out of tokens without a call: finished (nothing to run), but flagged as truncated."""
    completion = body("openai_chat", "final_answer")
    completion["choices"][0]["finish_reason"] = "length"
    assert parse_response("openai_chat", completion).truncated
    response = body("openai_responses", "final_answer")
    response["status"] = "incomplete"
    response["incomplete_details"] = {"reason": "max_output_tokens"}
    turn = parse_response("openai_responses", response)
    assert (turn.finished, turn.truncated, turn.stop_reason) == (True, True, "max_output_tokens")


def test_a_chat_refusal_is_the_text() -> None:
    completion = body("openai_chat", "final_answer")
    completion["choices"][0]["message"].update(content=None, refusal="I can't help with that.")
    assert parse_response("openai_chat", completion).text == "I can't help with that."


def test_an_unsupported_chat_call_type_is_kept_with_an_error() -> None:
    """A custom (free-text) tool call is not one of saga's; it still needs an answer."""
    completion = body("openai_chat", "unknown_tool")
    completion["choices"][0]["message"]["tool_calls"] = [
        {"id": "call_1", "type": "custom", "custom": {"name": "grep", "input": "x"}}
    ]
    [call] = parse_response("openai_chat", completion).calls
    assert (call.name, call.error) == ("grep", "unsupported tool call type 'custom'")


def sdk_object(fmt: ModelFormat, name: str) -> object:
    """The recorded body as the SDK's own response type, built the way the SDK builds what it
    receives (``model_construct``: recursive and lenient, as newer fields may be missing)."""
    data = body(fmt, name)
    if fmt is ModelFormat.ANTHROPIC:
        return sdk("anthropic").types.Message.model_construct(**data)
    if fmt is ModelFormat.OPENAI_RESPONSES:
        return sdk("openai").types.responses.Response.model_construct(**data)
    return sdk("openai").types.chat.ChatCompletion.model_construct(**data)


@pytest.mark.parametrize("name", ["parallel_tool_calls", "final_answer", "unknown_tool"])
def test_sdk_objects_and_dicts_parse_the_same(fmt: ModelFormat, name: str) -> None:
    """An SDK response object gives the same turn as its JSON, raw included."""
    assert parse_response(fmt, sdk_object(fmt, name)) == parse_response(fmt, body(fmt, name))


def test_turns_round_trip_through_json(fmt: ModelFormat) -> None:
    """A turn survives being handed to the next task as JSON."""
    turn = parse_response(fmt, body(fmt, "parallel_tool_calls"))
    assert ModelTurn.from_dict(turn.to_dict()) == turn
    assert ToolCall.from_dict(turn.calls[0].to_dict()) == turn.calls[0]
