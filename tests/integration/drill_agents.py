"""The hosted agents ``saga drill --agent`` drills in the tests: the demo app's tools, each
agent's model an OpenAI client made on its first call from the environment (the drill's fake
model: ``FakeModel.environ``), and the model's script for them.

``approving`` asks for the order and the credit at once, then for the reply, which waits for a
person, then answers. ``cached`` asks the same model through a gateway that caches answers by
conversation: a turn asked again after its answer was lost gets the first answer back, never
the model's second one, which the drill's ``model_differs_on_replay`` must notice.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from openai import OpenAI

from saga.agents import ChatModelPolicy, ModelTurn, Transcript
from saga.redis_urls import redis_client
from saga.tools import Tool
from tasks.agents import CREDIT, EMAIL, GET_ORDER, REPLY
from tasks.app import app, saga

__all__ = ["SCRIPT", "VARIANTS", "app", "saga"]

TOOLS = ["get_order", "issue_credit", "set_ticket_status", "send_reply"]

#: The model's answers, turn by turn.
SCRIPT: list[Any] = [[GET_ORDER, CREDIT], [REPLY], "I credited $2,500 and told Ada."]
#: Turn 2 asked again: the model words the reply differently (turn 1's parallel calls and the
#: final answer get variants of the drill's own making).
VARIANTS = {
    2: [
        (
            "send_reply",
            {"to": EMAIL, "subject": "Your credit", "body": "Order 4921: $2,500 credited."},
        )
    ]
}


def _model() -> ChatModelPolicy:
    return ChatModelPolicy.lazy(lambda: OpenAI(max_retries=0), "gpt-4o-mini", "openai_chat")


class CachingGateway:
    """A model gateway that answers a conversation it has seen as it did the first time (in
    Redis: every worker process shares it), without asking the model."""

    def __init__(self, policy: ChatModelPolicy) -> None:
        self.policy = policy

    def __call__(self, transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn:
        text = json.dumps(transcript.to_dict(), sort_keys=True, default=str)
        key = "drill-gateway:" + hashlib.sha256(text.encode()).hexdigest()
        with redis_client(os.environ["SAGA_REDIS_URL"], decode_responses=True) as client:
            cached = client.get(key)
            if cached is not None:
                return ModelTurn.from_dict(json.loads(cached))
            answer = self.policy(transcript, tools)
            client.set(key, json.dumps(answer.to_dict()), ex=600)
        return answer


saga.agent("approving", _model(), tools=TOOLS, approval=["send_reply"])
saga.agent("cached", CachingGateway(_model()), tools=TOOLS, approval=["send_reply"])
