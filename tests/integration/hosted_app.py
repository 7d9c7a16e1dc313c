"""The app the hosted-loop tests run on their workers: the demo app (its tools and its
``refund`` agent) plus scripted agents for each way a call can go wrong, and one agent per
model format (``openai_chat``, ``openai_responses``, ``anthropic``): a ``ChatModelPolicy`` over
the real SDK client whose HTTP goes to a fake provider in-process.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from saga import RetryPolicy
from saga.agents import ChatModelPolicy, Limits, ModelTurn, OnFailure, ScriptedPolicy, ToolCall
from saga.errors import ModelCallError
from saga.redis_urls import redis_client
from tasks.agents import CREDIT, GET_ORDER, REFUND_SCRIPT, REPLY, TICKET_STATUS
from tasks.app import app, saga
from tests.unit.agents.helpers import body, exchange, http_module, sdk

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


# -- a fake provider speaking the three formats ------------------------------------------------
#
# One in-process provider answers OpenAI Chat Completions (``/chat/completions``), OpenAI
# Responses (``/responses``) and Anthropic Messages (``/messages``) through the real SDK
# clients. The user's message names the scenario and the run (``"parallel <run id>"``); the
# turn is read from the call ids of earlier answers (``..._t<turn>_<i>``), which every format
# sends back to the model.

MODELS = {
    "openai_chat": "gpt-4o-2024-08-06",
    "openai_responses": "o4-mini-2025-04-16",
    "anthropic": "claude-sonnet-4-5-20250929",
}
SCENARIOS = ("parallel", "early_reply", "mistakes", "rate_limited", "bad_request")
_ASK = re.compile(r"\b(" + "|".join(SCENARIOS) + r") ([0-9a-f]{32})\b")
_TURN = re.compile(r"_t(\d+)_\d+")
_USAGE = (400, 50)

Script = list[list[tuple[str, dict[str, Any]]] | str]

#: What the model answers, turn by turn (a list of calls, or the final text).
_SCRIPTS: dict[str, Script] = {
    "parallel": [[GET_ORDER, CREDIT, TICKET_STATUS], [REPLY], "Done."],
    "early_reply": [*REFUND_SCRIPT],
    "mistakes": [
        [("refund_everything", {}), ("issue_credit", {"order_id": 4921, "amount_cents": "a lot"})],
        "I could not do it.",
    ],
    "rate_limited": [[GET_ORDER], "Done."],
    "bad_request": [[CREDIT]],  # then the provider refuses the request
}


def _chat(turn: int, calls: list[tuple[str, dict[str, Any]]], text: str) -> dict[str, Any]:
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
    return {
        "id": f"chatcmpl-{turn}",
        "object": "chat.completion",
        "created": 1733130000,
        "model": MODELS["openai_chat"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": _USAGE[0],
            "completion_tokens": _USAGE[1],
            "total_tokens": sum(_USAGE),
        },
    }


def _responses(turn: int, calls: list[tuple[str, dict[str, Any]]], text: str) -> dict[str, Any]:
    answer = body("openai_responses", "final_answer")
    answer["id"] = f"resp_t{turn}"
    answer["output"] = [
        {
            "id": f"fc_t{turn}_{i}",
            "type": "function_call",
            "status": "completed",
            "arguments": json.dumps(args),
            "call_id": f"call_t{turn}_{i}",
            "name": name,
        }
        for i, (name, args) in enumerate(calls)
    ] or [
        {
            "id": f"msg_t{turn}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
        }
    ]
    answer["usage"] = {
        "input_tokens": _USAGE[0],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": _USAGE[1],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": sum(_USAGE),
    }
    return answer


def _anthropic(turn: int, calls: list[tuple[str, dict[str, Any]]], text: str) -> dict[str, Any]:
    answer = body("anthropic", "final_answer")
    answer["id"] = f"msg_t{turn}"
    answer["content"] = [
        {"type": "tool_use", "id": f"toolu_t{turn}_{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(calls)
    ] or [{"type": "text", "text": text}]
    answer["stop_reason"] = "tool_use" if calls else "end_turn"
    answer["usage"] = {"input_tokens": _USAGE[0], "output_tokens": _USAGE[1]}
    return answer


_BUILD = {"openai_chat": _chat, "openai_responses": _responses, "anthropic": _anthropic}
_FORMAT_OF_PATH = {
    "/v1/chat/completions": "openai_chat",
    "/v1/responses": "openai_responses",
    "/v1/messages": "anthropic",
}


def _answer(fmt: str, scenario: str, turn: int, attempt: int) -> dict[str, Any]:
    """What the provider says to ``turn`` (0-based) of ``scenario``, on its ``attempt``."""
    if scenario == "rate_limited" and turn == 0 and attempt == 1:
        return exchange(fmt, "rate_limited")
    if scenario == "bad_request" and turn > 0:
        return exchange(fmt, "bad_request")
    said = _SCRIPTS[scenario][turn]
    calls, text = (said, "") if isinstance(said, list) else ([], said)
    ok = {"content-type": "application/json"}
    return {"status": 200, "headers": ok, "body": _BUILD[fmt](turn, calls, text)}


class FakeProvider:
    """Counts, in Redis, how often each turn of each run was asked, so a 429 can be followed
    by a success across worker processes and redeliveries."""

    def __init__(self, sdk_name: str) -> None:
        self.redis = redis_client(os.environ["SAGA_REDIS_URL"], decode_responses=True)
        self.http = http_module(sdk(sdk_name))

    def __call__(self, request: Any) -> Any:
        fmt = _FORMAT_OF_PATH[request.url.path]
        sent = request.content.decode()
        asked = _ASK.search(sent)
        assert asked, f"no scenario in the request: {sent[:300]}"
        turn = max((int(t) + 1 for t in _TURN.findall(sent)), default=0)
        attempt = self.redis.hincrby(f"fake-provider:{asked.group(2)}", str(turn), 1)
        answer = _answer(fmt, asked.group(1), turn, attempt)
        return self.http.Response(answer["status"], headers=answer["headers"], json=answer["body"])


def _client(fmt: str) -> Any:
    """The real SDK client for ``fmt``, its HTTP going to the fake provider, retries off."""
    name = "anthropic" if fmt == "anthropic" else "openai"
    provider = FakeProvider(name)
    http_client = provider.http.Client(transport=provider.http.MockTransport(provider))
    if name == "anthropic":
        return sdk(name).Anthropic(
            api_key="test", base_url="http://fake-provider", http_client=http_client, max_retries=0
        )
    return sdk(name).OpenAI(
        api_key="test", base_url="http://fake-provider/v1", http_client=http_client, max_retries=0
    )


for _fmt in MODELS:
    saga.agent(
        _fmt,
        ChatModelPolicy(_client(_fmt), MODELS[_fmt], _fmt, system="You resolve billing tickets."),
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
saga.agent(
    "approver_and_read",  # the reply waits for a person; the read beside it settles meanwhile
    ScriptedPolicy([[REPLY, GET_ORDER], _after_the_person]),
    tools=WRITES,
    approval=["send_reply"],
)
saga.agent(
    "asks_again",  # five requests nobody answers, each expiring and fed back, then done
    ScriptedPolicy([*[[REPLY]] * 5, "Nobody approved; I gave up."]),
    tools=WRITES,
    approval=["send_reply"],
    limits=Limits(max_consecutive_refusals=10),
)
saga.agent(
    "patient",  # runs on its own deadline: a web app's runs of it must too
    ScriptedPolicy(["Nothing to do."]),
    tools=WRITES,
    deadline=7,
)

#: Three status changes in one answer, each a third of the payload limit: every result fits
#: on its own, but a result also reports the status before it, so together they exceed it.
_BIG = saga.settings.max_payload_bytes // 3 - 200
saga.agent(
    "big_statuses",
    ScriptedPolicy(
        [
            [
                ToolCall(f"call_big_{i}", "set_ticket_status", {"ticket_id": 9104, "status": s})
                for i, s in enumerate(("a" * _BIG, "b" * _BIG, "c" * _BIG))
            ],
            lambda results: f"Saw {len(results)} results.",
        ]
    ),
    tools=WRITES,
)


def _flaky_model(transcript: Any, tools: Any) -> ModelTurn:
    """Answers with a 429 the first time it is asked for a run, then finishes."""
    run = re.search(r"[0-9a-f]{32}", transcript.entries[0].text)
    assert run is not None, "the input names the run"
    client = redis_client(os.environ["SAGA_REDIS_URL"], decode_responses=True)
    with client:
        asked = client.incr(f"flaky-model:{run.group(0)}")
        client.expire(f"flaky-model:{run.group(0)}", 300)
    if asked == 1:
        raise ModelCallError("429 Too Many Requests", retryable=True, retry_after=0.2, status=429)
    return ModelTurn(text="Done after one 429.")


saga.agent("flaky", _flaky_model, tools=WRITES, model_retry=RetryPolicy(attempts=2, backoff=0.2))
