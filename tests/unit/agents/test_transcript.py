"""The conversation: every call answered before anything else, results in call order, each
format's request rendered with the system prompt where that format wants it.
"""

from __future__ import annotations

import json

import pytest

from saga.agents import (
    ModelFormat,
    ModelTurn,
    ToolCall,
    ToolResult,
    Transcript,
    Usage,
    parse_response,
)
from saga.errors import ConversationError
from tests.unit.agents.helpers import body


def scripted_turn() -> ModelTurn:
    return ModelTurn(
        calls=(
            ToolCall("c1", "get_order", {"order_id": 4921}),
            ToolCall("c2", "send_reply", {"to": "a@b.c", "subject": "s", "body": "b"}),
        ),
        text="Looking.",
    )


def with_calls(turn: ModelTurn | None = None) -> Transcript:
    transcript = Transcript()
    transcript.add_user("Refund order 4921.")
    transcript.add_turn(turn or scripted_turn())
    return transcript


def test_results_are_kept_in_the_order_of_the_calls() -> None:
    """Results may finish in any order; the providers pair them by position too."""
    transcript = with_calls()
    transcript.add_results([ToolResult("c2", "sent"), ToolResult("c1", {"id": 4921})])
    assert [r.call_id for r in transcript.last_results] == ["c1", "c2"]
    assert transcript.pending_calls == ()


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([ToolResult("c1", 1)], "missing: c2; not pending: none"),
        ([ToolResult("c1", 1), ToolResult("c2", 2), ToolResult("c9", 9)], "not pending: c9"),
        ([ToolResult("c1", 1), ToolResult("c1", 1)], "two results for tool call c1"),
    ],
)
def test_results_must_answer_the_calls_exactly(results: list[ToolResult], message: str) -> None:
    """A forgotten or stray result fails here, not as a 400 on the next request."""
    transcript = with_calls()
    with pytest.raises(ConversationError, match=message):
        transcript.add_results(results)
    assert len(transcript) == 2


def test_nothing_else_is_said_while_calls_wait() -> None:
    transcript = with_calls()
    with pytest.raises(ConversationError, match=r"answer the pending tool calls \(c1, c2\)"):
        transcript.add_user("hello?")
    with pytest.raises(ConversationError, match="before another model turn"):
        transcript.add_turn(ModelTurn(text="done"))


def test_results_without_calls_are_refused() -> None:
    with pytest.raises(ConversationError, match="no tool calls are waiting"):
        Transcript().add_results([ToolResult("c1", 1)])


def test_system_prompt_placement_differs_per_format() -> None:
    """Chat: a system message first; Responses: ``instructions``; Anthropic: ``system``."""
    transcript = Transcript()
    transcript.add_user("Hi")

    chat = transcript.request("openai_chat", system="Be careful.")
    responses = transcript.request("openai_responses", system="Be careful.")
    anthropic = transcript.request("anthropic", system="Be careful.")

    assert chat == {
        "messages": [
            {"role": "system", "content": "Be careful."},
            {"role": "user", "content": "Hi"},
        ]
    }
    assert responses == {
        "input": [{"role": "user", "content": "Hi"}],
        "instructions": "Be careful.",
    }
    assert anthropic == {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "system": "Be careful.",
    }
    assert set(transcript.request("anthropic")) == {"messages"}


def test_anthropic_puts_all_results_first_in_one_user_message() -> None:
    """Both tool_result blocks, then the user's follow-up text, in a single user message."""
    transcript = with_calls()
    transcript.add_results([ToolResult("c1", {"total": 2500}), ToolResult.failure("c2", "down")])
    transcript.add_user("Also note the refund.")

    messages = transcript.request("anthropic")["messages"]

    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "c1", "name": "get_order", "input": {"order_id": 4921}},
        {
            "type": "tool_use",
            "id": "c2",
            "name": "send_reply",
            "input": {"to": "a@b.c", "subject": "s", "body": "b"},
        },
    ]
    assert messages[2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "c1",
            "content": '{"total": 2500}',
            "is_error": False,
        },
        {
            "type": "tool_result",
            "tool_use_id": "c2",
            "content": '{"error": "down"}',
            "is_error": True,
        },
        {"type": "text", "text": "Also note the refund."},
    ]


def test_openai_formats_answer_each_call_separately() -> None:
    """Chat: one ``tool`` message per call; Responses: one ``function_call_output`` each."""
    transcript = with_calls()
    transcript.add_results([ToolResult("c1", {"total": 2500}), ToolResult("c2", "sent")])

    chat = transcript.request("openai_chat")["messages"]
    responses = transcript.request("openai_responses")["input"]

    assert chat[1] == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_order", "arguments": '{"order_id": 4921}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {
                    "name": "send_reply",
                    "arguments": '{"to": "a@b.c", "subject": "s", "body": "b"}',
                },
            },
        ],
    }
    assert chat[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": '{"total": 2500}'},
        {"role": "tool", "tool_call_id": "c2", "content": "sent"},
    ]
    assert [item.get("type") for item in responses] == [
        None,
        None,
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert responses[4] == {
        "type": "function_call_output",
        "call_id": "c1",
        "output": '{"total": 2500}',
    }


def test_a_providers_own_answer_is_replayed_verbatim(fmt: ModelFormat) -> None:
    """The assistant's answer goes back exactly as it came (ids, reasoning, annotations)."""
    recorded = body(fmt, "parallel_tool_calls")
    transcript = with_calls(parse_response(fmt, recorded))

    request = transcript.request(fmt)

    if fmt is ModelFormat.OPENAI_CHAT:
        assert request["messages"][1] == recorded["choices"][0]["message"]
    elif fmt is ModelFormat.OPENAI_RESPONSES:
        assert request["input"][1:] == recorded["output"]
        assert request["input"][1]["type"] == "reasoning"
    else:
        assert request["messages"][1] == {"role": "assistant", "content": recorded["content"]}


def test_a_turn_from_another_format_is_rebuilt() -> None:
    """Switching provider mid-run: the normalised calls, in the new format's spelling."""
    anthropic_turn = parse_response("anthropic", body("anthropic", "parallel_tool_calls"))
    transcript = with_calls(anthropic_turn)
    [assistant] = transcript.request("openai_chat")["messages"][1:]
    assert [c["id"] for c in assistant["tool_calls"]] == [c.id for c in anthropic_turn.calls]
    assert assistant["content"] == anthropic_turn.text


def test_the_transcript_round_trips_through_json(fmt: ModelFormat) -> None:
    """A hosted loop hands the conversation between tasks as JSON; nothing is lost."""
    transcript = with_calls(parse_response(fmt, body(fmt, "parallel_tool_calls")))
    transcript.add_results([call.error_result() for call in transcript.pending_calls])
    transcript.add_turn(parse_response(fmt, body(fmt, "final_answer")))

    again = Transcript.from_dict(json.loads(json.dumps(transcript.to_dict())))

    assert again.entries == transcript.entries
    assert again.request(fmt, "S") == transcript.request(fmt, "S")


def test_usage_adds_up_over_turns() -> None:
    transcript = with_calls(parse_response("anthropic", body("anthropic", "parallel_tool_calls")))
    transcript.add_results([ToolResult(c.id, "ok") for c in transcript.pending_calls])
    transcript.add_turn(parse_response("anthropic", body("anthropic", "final_answer")))
    assert transcript.usage == Usage(1204 + 1611, 112 + 31)
    assert transcript.usage.total_tokens == 2958


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ({"credit_id": "cr_1", "amount": 2500}, '{"credit_id": "cr_1", "amount": 2500}'),
        ("plain words", "plain words"),
        ([1, "é"], '[1, "é"]'),
        (None, "null"),
    ],
)
def test_result_content_is_json_text_but_strings_stay(content: object, text: str) -> None:
    assert ToolResult("c1", content).text() == text
