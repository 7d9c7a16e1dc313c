"""The demo's hosted agent: the seed's credit scenario, played by a scripted model that asks to
send the reply in the same answer as the credit, is told to wait, and sends it next turn.
"""

from __future__ import annotations

from typing import Any

from saga import Saga
from saga.agents import Limits, ScriptedPolicy

ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"

GET_ORDER = ("get_order", {"order_id": ORDER})
CREDIT = ("issue_credit", {"order_id": ORDER, "amount_cents": 250_000, "memo": "late delivery"})
TICKET_STATUS = ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"})
REPLY = (
    "send_reply",
    {"to": EMAIL, "subject": "Your credit", "body": "We credited $2,500 to order 4921."},
)

#: Turn by turn: read the order; reply, credit and ticket at once (the reply is refused: it is
#: irreversible and the writes have not settled); the reply again; the final answer.
REFUND_SCRIPT: list[Any] = [
    [GET_ORDER],
    [REPLY, CREDIT, TICKET_STATUS],
    [REPLY],
    "I credited $2,500 to order 4921, set ticket 9104 to pending_refund and told Ada.",
]


def declare(saga: Saga) -> None:
    """The agents of the demo app."""
    saga.agent(
        "refund",
        ScriptedPolicy(REFUND_SCRIPT),
        tools=["get_order", "issue_credit", "set_ticket_status", "send_reply"],
        limits=Limits(max_turns=8, max_tool_calls=10),
    )
