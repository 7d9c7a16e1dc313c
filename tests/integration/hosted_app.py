"""The app the hosted-loop tests run on their workers: the demo app (its tools and its
``refund`` agent) plus scripted agents for each way a call can go wrong, and ``openai``, a
``ChatModelPolicy`` over the real OpenAI client whose HTTP goes to a fake provider in-process.

The fake provider picks its scenario from the first word of the user's message and counts, in
Redis, how often each turn was asked (so a 429 can be followed by a success, across worker
processes and redeliveries).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from saga.agents import ChatModelPolicy, Limits, ModelTurn, OnFailure, ScriptedPolicy, ToolCall
from tasks.agents import CREDIT, GET_ORDER, REPLY, TICKET_STATUS
from tasks.app import app, saga
from tests.unit.agents.helpers import exchange, http_module, sdk

__all__ = ["app", "saga"]

WRITES = ["get_order", "issue_credit", "set_ticket_status", "send_reply"]
NO_TICKET = ("set_ticket_status", {"ticket_id": 1, "status": "pending_refund"})
BROKEN = ToolCall("call_broken", "issue_credit", {}, {}, "arguments are not valid JSON: {amou")

saga.agent(
    "mistakes",  # an unknown tool, bad arguments and unparseable ones: all told, then done
    ScriptedPolicy(
        [
            [
                ("refund_everything", {}),
                ("issue_credit", {"order_id": 4921, "amount_cents": "a lot"}),
                BROKEN,
            ],
            "I could not do it.",
        ]
    ),
    tools=WRITES,
)
saga.agent(
    "rejected",  # billing refuses too large a credit: the model asks for less
    ScriptedPolicy(
        [
            [("issue_credit", {"order_id": 4921, "amount_cents": 900_000})],
            [CREDIT],
            "Credited $2,500.",
        ]
    ),
    tools=WRITES,
)
saga.agent(
    "stubborn",  # a credit, then refusals past the limit: the run unwinds
    ScriptedPolicy([[CREDIT], *[[("refund_everything", {})]] * 5]),
    tools=WRITES,
    limits=Limits(max_consecutive_refusals=2),
)
saga.agent(
    "failed_write",  # the ticket does not exist: a write failed, the run unwinds
    ScriptedPolicy([[CREDIT], [NO_TICKET], "unreachable"]),
    tools=WRITES,
)
saga.agent(
    "failed_read",  # an order that does not exist: the read's failure is fed back
    ScriptedPolicy([[("get_order", {"order_id": 1})], [GET_ORDER], "Order 4921 it is."]),
    tools=WRITES,
)
saga.agent(
    "told_about_writes",  # the ticket's failure is fed back (per-tool override): done anyway
    ScriptedPolicy([[CREDIT, NO_TICKET], "Credited; the ticket was not found."]),
    tools=WRITES,
    on_failure={"set_ticket_status": OnFailure.FEED_BACK},
)
saga.agent(
    "turn_limit",
    ScriptedPolicy([[GET_ORDER]] * 5),
    tools=WRITES,
    limits=Limits(max_turns=2, on_limit="finish"),
)
saga.agent(
    "parallel",  # three calls in one answer (crash tests kill between the 2nd and the 3rd)
    ScriptedPolicy([[GET_ORDER, CREDIT, TICKET_STATUS], [REPLY], "Done."]),
    tools=WRITES,
)


# -- a fake OpenAI provider ------------------------------------------------------------------

MODEL = "gpt-4o-2024-08-06"


def _completion(turn: int, calls: list[tuple[str, dict[str, Any]]], text: str = "") -> Any:
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_t{turn}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]
    body = {
        "id": f"chatcmpl-{turn}",
        "object": "chat.completion",
        "created": 1733130000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if calls else "stop",
            }
        ],
        "usage": {"prompt_tokens": 400, "completion_tokens": 50, "total_tokens": 450},
    }
    return {"status": 200, "headers": {"content-type": "application/json"}, "body": body}


def _answer(scenario: str, turn: int, attempt: int) -> dict[str, Any]:
    """What the provider says to ``turn`` (0-based) of ``scenario``, on its ``attempt``."""
    if scenario == "parallel":
        script: list[Any] = [[GET_ORDER, CREDIT, TICKET_STATUS], [REPLY]]
        return _completion(turn, script[turn]) if turn < 2 else _completion(turn, [], "Done.")
    if scenario == "rate_limited":
        if turn == 0 and attempt == 1:
            return exchange("openai_chat", "rate_limited")
        return _completion(turn, [GET_ORDER]) if turn == 0 else _completion(turn, [], "Done.")
    if scenario == "bad_request":
        if turn == 0:
            return _completion(turn, [CREDIT])
        return exchange("openai_chat", "bad_request")
    raise AssertionError(f"no scenario {scenario!r}")


class FakeProvider:
    def __init__(self) -> None:
        self.redis = redis.Redis.from_url(os.environ["SAGA_REDIS_URL"], decode_responses=True)
        self.http = http_module(sdk("openai"))

    def __call__(self, request: Any) -> Any:
        sent = json.loads(request.content)
        messages = sent["messages"]
        ask = next(m["content"] for m in messages if m["role"] == "user")
        turn = sum(1 for m in messages if m["role"] == "assistant")
        attempt = self.redis.hincrby(f"fake-provider:{ask}", str(turn), 1)
        answer = _answer(ask.split()[0], turn, attempt)
        return self.http.Response(answer["status"], headers=answer["headers"], json=answer["body"])


_provider = FakeProvider()
_client = sdk("openai").OpenAI(
    api_key="test",
    base_url="http://fake-provider/v1",
    http_client=_provider.http.Client(transport=_provider.http.MockTransport(_provider)),
    max_retries=0,
)
saga.agent(
    "openai",
    ChatModelPolicy(_client, MODEL, "openai_chat", system="You resolve billing tickets."),
    tools=WRITES,
)


def _slow_model(transcript: Any, tools: Any) -> ModelTurn:
    """A model that thinks for a while (time for a web app to abort the run)."""
    time.sleep(1.5)
    if transcript.last_results:
        return ModelTurn(text="Done.")
    return ModelTurn(calls=(ToolCall("call_slow", "get_order", {"order_id": 4921}),))


saga.agent("slow", _slow_model, tools=WRITES)
saga.agent(
    "after_pivot",  # the reply goes out, then a credit is asked for: refused past the pivot
    ScriptedPolicy([[REPLY], [CREDIT], "The reply went out; no credit."]),
    tools=WRITES,
)


def _after_the_person(results: tuple[Any, ...]) -> str:
    said = results[0]
    return f"Not sent: {said.content['error']}" if said.is_error else "Sent."


saga.agent(
    "approver",  # the reply waits for a person
    ScriptedPolicy([[REPLY], _after_the_person]),
    tools=WRITES,
    approval=["send_reply"],
)
