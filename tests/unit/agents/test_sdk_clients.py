"""The real SDK clients, answered by recorded-style responses over a mock transport: what saga
sends (tools, results, system prompt, each in its place) and what it makes of the answers and
of the failures.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from saga.agents import (
    ChatModelPolicy,
    ModelCallError,
    ModelFormat,
    ToolResult,
    Transcript,
    offered_tools,
    take_turn,
    tool_definitions,
)
from saga.errors import UnknownToolError
from tasks.tools import tools as demo_tools
from tests.unit.agents.helpers import ModelServer, body, exchange, make_client

SYSTEM = "You resolve billing tickets for Acme."
ASK = "Refund order 4921 and tell the customer."
MODEL = {
    ModelFormat.OPENAI_CHAT: "gpt-4o-2024-08-06",
    ModelFormat.OPENAI_RESPONSES: "o4-mini",
    # Not a real model name: the SDK warns about deprecated ones, and warnings are errors here.
    ModelFormat.ANTHROPIC: "claude-saga-test",
}
PATH = {
    ModelFormat.OPENAI_CHAT: "/v1/chat/completions",
    ModelFormat.OPENAI_RESPONSES: "/v1/responses",
    ModelFormat.ANTHROPIC: "/v1/messages",
}
TOOLS = offered_tools(demo_tools)


def policy_for(fmt: ModelFormat, server: ModelServer) -> ChatModelPolicy:
    return ChatModelPolicy(make_client(fmt, server), MODEL[fmt], fmt, system=SYSTEM)


def started() -> Transcript:
    transcript = Transcript()
    transcript.add_user(ASK)
    return transcript


def first_request(fmt: ModelFormat) -> dict[str, Any]:
    """The exact body of the opening request: model, conversation, system prompt and tools,
    each where this format wants it."""
    tools = tool_definitions(demo_tools, fmt)
    if fmt is ModelFormat.OPENAI_CHAT:
        return {
            "model": MODEL[fmt],
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": ASK},
            ],
            "tools": tools,
        }
    if fmt is ModelFormat.OPENAI_RESPONSES:
        return {
            "model": MODEL[fmt],
            "input": [{"role": "user", "content": ASK}],
            "instructions": SYSTEM,
            "tools": tools,
        }
    return {
        "model": MODEL[fmt],
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        "system": SYSTEM,
        "tools": tools,
    }


def test_a_two_turn_run_sends_exactly_the_right_bodies(
    fmt: ModelFormat, server: ModelServer
) -> None:
    """Parallel calls, one of them failing, then the final answer: the second request replays
    the model's answer as-is and carries both results in the format's place for them."""
    # Given a provider that asks for two tools, then answers
    server.queue(exchange(fmt, "parallel_tool_calls"), exchange(fmt, "final_answer"))
    policy = policy_for(fmt, server)
    transcript = started()

    # When the loop runs both turns, the ticket update failing
    calls = take_turn(policy, transcript, TOOLS).calls
    transcript.add_results(
        [
            ToolResult(calls[0].id, {"order_id": 4921, "total_cents": 250_000}),
            ToolResult.failure(calls[1].id, "ticket 77 is locked"),
        ]
    )
    final = take_turn(policy, transcript, TOOLS)

    # Then the answer is final, and the requests are exactly these
    assert final.finished
    assert final.text.startswith("I issued a $2,500.00 credit")
    assert [s.path for s in server.seen] == [PATH[fmt], PATH[fmt]]
    first, second = server.bodies
    assert first == first_request(fmt)
    recorded = body(fmt, "parallel_tool_calls")
    order = '{"order_id": 4921, "total_cents": 250000}'
    locked = '{"error": "ticket 77 is locked"}'
    if fmt is ModelFormat.OPENAI_CHAT:
        assert second["messages"] == [
            *first["messages"],
            recorded["choices"][0]["message"],
            {"role": "tool", "tool_call_id": "call_8WjKq3Lm2NpR5sTv7XyZ1aBc", "content": order},
            {"role": "tool", "tool_call_id": "call_Qd4Fg6Hj8Kl0Mn2Pq4Rs6Tu8", "content": locked},
        ]
    elif fmt is ModelFormat.OPENAI_RESPONSES:
        assert second["instructions"] == SYSTEM
        assert second["input"] == [
            *first["input"],
            *recorded["output"],  # the reasoning item and both function_call items
            {
                "type": "function_call_output",
                "call_id": "call_Hn4Km6Pq8Rs0Tu2Vw4Xy6Za8",
                "output": order,
            },
            {
                "type": "function_call_output",
                "call_id": "call_Bc1De3Fg5Hi7Jk9Lm1No3Pq5",
                "output": locked,
            },
        ]
    else:
        assert second["system"] == SYSTEM
        assert second["messages"] == [
            *first["messages"],
            {"role": "assistant", "content": recorded["content"]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                        "content": order,
                        "is_error": False,
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01BpWx7rGn3kQ2tJmV8yLcZe",
                        "content": locked,
                        "is_error": True,
                    },
                ],
            },
        ]
    assert second["tools"] == first["tools"]


def test_an_unknown_tool_is_refused_by_the_dispatcher_and_the_model_told(
    fmt: ModelFormat, server: ModelServer
) -> None:
    """Parsing keeps the call; the registry refuses it; the refusal goes back as an error."""
    server.queue(exchange(fmt, "unknown_tool"), exchange(fmt, "final_answer"))
    policy = policy_for(fmt, server)
    transcript = started()

    [call] = take_turn(policy, transcript, TOOLS).calls
    with pytest.raises(UnknownToolError) as refused:
        demo_tools.offered(call.name)
    transcript.add_results([ToolResult.failure(call.id, str(refused.value))])
    take_turn(policy, transcript, TOOLS)

    sent = json.dumps(server.bodies[1])
    assert "unknown tool 'refund_everything'; the agent may call:" in sent
    if fmt is ModelFormat.ANTHROPIC:
        assert server.bodies[1]["messages"][-1]["content"][0]["is_error"] is True


@pytest.mark.parametrize("fmt", [ModelFormat.OPENAI_CHAT, ModelFormat.OPENAI_RESPONSES])
def test_invalid_json_arguments_go_back_as_an_error(fmt: ModelFormat, server: ModelServer) -> None:
    """The broken call is answered with its parse error; the run goes on."""
    server.queue(exchange(fmt, "invalid_arguments"), exchange(fmt, "final_answer"))
    policy = policy_for(fmt, server)
    transcript = started()

    calls = take_turn(policy, transcript, TOOLS).calls
    transcript.add_results(
        [c.error_result() if c.error else ToolResult(c.id, {"ok": True}) for c in calls]
    )
    take_turn(policy, transcript, TOOLS)

    broken = next(c for c in calls if c.error)
    sent = server.bodies[1]["messages" if fmt is ModelFormat.OPENAI_CHAT else "input"][-1]
    assert sent[("content" if fmt is ModelFormat.OPENAI_CHAT else "output")] == json.dumps(
        {"error": broken.error}
    )
    assert "not valid JSON" in sent[("content" if fmt is ModelFormat.OPENAI_CHAT else "output")]


@pytest.mark.parametrize(
    ("recording", "status", "retryable", "retry_after", "sdk_error"),
    [
        ("rate_limited", 429, True, 2.0, "RateLimitError"),
        ("server_error", 500, True, None, "InternalServerError"),
        ("bad_request", 400, False, None, "BadRequestError"),
    ],
)
def test_http_failures_are_classified(
    fmt: ModelFormat,
    server: ModelServer,
    recording: str,
    status: int,
    retryable: bool,
    retry_after: float | None,
    sdk_error: str,
) -> None:
    """429 and 5xx may be retried (after ``Retry-After`` when given); a 400 never. The SDK
    tried once (``max_retries=0``): saga owns the retries."""
    server.queue(exchange(fmt, recording))
    transcript = started()

    with pytest.raises(ModelCallError) as failed:
        take_turn(policy_for(fmt, server), transcript, TOOLS)

    error = failed.value
    assert (error.status, error.retryable, error.retry_after) == (status, retryable, retry_after)
    assert type(error.__cause__).__name__ == sdk_error
    assert str(error).startswith(f"model call failed with HTTP {status}")
    assert len(server.seen) == 1
    assert transcript.turns == ()


@pytest.mark.parametrize(
    ("failure", "sdk_error"),
    [("ConnectError", "APIConnectionError"), ("ReadTimeout", "APITimeoutError")],
)
def test_no_response_at_all_is_retryable(
    fmt: ModelFormat, server: ModelServer, failure: str, sdk_error: str
) -> None:
    """A refused connection or a timeout: no status, worth another try."""
    server.queue(getattr(server.http, failure)("simulated"))

    with pytest.raises(ModelCallError) as failed:
        take_turn(policy_for(fmt, server), started(), TOOLS)

    assert (failed.value.status, failed.value.retryable) == (None, True)
    assert type(failed.value.__cause__).__name__ == sdk_error


def test_a_lazy_policy_makes_its_client_on_the_first_model_call_only(
    fmt: ModelFormat, server: ModelServer
) -> None:
    """ChatModelPolicy.lazy: declaring the agent makes no client (a process that never asks
    the model needs no key); the first call makes it, once, for every thread; a factory that
    raises (no key) raises as itself, not as a model error, and the next call tries again."""
    made: list[Any] = []
    failures = [RuntimeError("no API key in this process")]

    def make() -> Any:
        if failures:
            raise failures.pop()
        made.append(make_client(fmt, server))
        return made[-1]

    policy = ChatModelPolicy.lazy(make, MODEL[fmt], fmt, system=SYSTEM)
    assert made == [] and "ChatModelPolicy" in repr(policy)

    with pytest.raises(RuntimeError, match="no API key"):
        policy(started(), TOOLS)
    server.queue(exchange(fmt, "final_answer"), exchange(fmt, "final_answer"))
    with ThreadPoolExecutor(2) as pool:
        turns = list(pool.map(lambda _: policy(started(), TOOLS), range(2)))

    assert len(made) == 1 and policy.client is made[0]
    assert all(not turn.calls and turn.text for turn in turns)
    assert server.bodies[0]["model"] == MODEL[fmt]


def test_a_lazy_policy_needs_a_factory() -> None:
    with pytest.raises(TypeError, match="a function that makes the SDK client"):
        ChatModelPolicy.lazy(object(), "gpt-4o", "openai_chat")
