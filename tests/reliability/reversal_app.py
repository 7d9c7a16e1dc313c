"""The demo's credit and ticket tools, with a reversal policy on the credit: a credit over
$1,000 asks a person before it is reversed (``reversal=``), as a team that answers to finance
for every reversed credit would declare it. The reversal tests' workers run this app."""

from __future__ import annotations

from typing import Any

from celery import Celery

from saga import Saga, StepContext, ToolClass, ToolRegistry
from tasks import systems
from tasks.tools import PATIENT_UNDO, QUICK, _find, _restore_status, _reverse_the_credit

#: Cents: a credit above this asks a person before it is reversed.
COSTLY = 100_000

tools = ToolRegistry()


def costly(args: dict[str, Any], result: Any) -> bool:
    return int(args["amount_cents"]) > COSTLY


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=_reverse_the_credit,
    retry=QUICK,
    lookup=_find(systems.credit_by_key),
    reversal=costly,
)
def issue_credit(ctx: StepContext, order_id: int, amount_cents: int, memo: str = "") -> Any:
    """Credit a customer; a person decides before a large one is reversed."""
    return systems.issue_credit(order_id, amount_cents, ctx.idempotency_key, memo)


@tools.compensation(retry=PATIENT_UNDO)
def reverse_credit(ctx: StepContext, credit_id: str) -> dict[str, Any]:
    return systems.reverse_credit(credit_id, ctx.idempotency_key)


@tools.tool(ToolClass.REVERSIBLE_WRITE, compensation=_restore_status, retry=QUICK)
def set_ticket_status(ctx: StepContext, ticket_id: int, status: str) -> dict[str, Any]:
    return systems.set_ticket_status(ticket_id, status, ctx.idempotency_key)


app = Celery("reversal")
app.config_from_object("celeryconfig")
saga = Saga(app, tools)
