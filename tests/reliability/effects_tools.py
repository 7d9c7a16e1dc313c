"""Tools whose effect happens but cannot be recorded as it is: a compensation function with a
typo in the key it reads, a result that is no JSON, a read whose answer is over the limit.

Workers run them as ``celery -A tests.reliability.effects_app worker``; the tests dispatch with
this registry, imported without the app (whose Celery settings are read at import, from the
environment of the moment). Every effect lands in the demo's billing system, so the tests
count credits and reversals there, not in the saga's own records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from saga import RetryPolicy, StepContext, ToolClass, ToolRegistry, Undo
from tasks import systems

tools = ToolRegistry()
QUICK = RetryPolicy(attempts=2, backoff=0.1, backoff_max=0.2)


@dataclass(frozen=True)
class Credit:
    """What a client library might hand back: a credit, as an object rather than JSON."""

    credit_id: str
    amount_cents: int


@tools.compensation(retry=QUICK)
def reverse_credit(ctx: StepContext, credit_id: str) -> dict[str, Any]:
    return systems.reverse_credit(credit_id, ctx.idempotency_key)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=lambda args, result: Undo("reverse_credit", {"credit_id": result["credit_id"]}),
    retry=QUICK,
)
def issue_credit(ctx: StepContext, order_id: int, amount_cents: int) -> dict[str, Any]:
    """A credit with a correct undo: what an unwind can take back."""
    return systems.issue_credit(order_id, amount_cents, ctx.idempotency_key)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    # The typo a new user makes: the result's key is "credit_id".
    compensation=lambda args, result: Undo("reverse_credit", {"credit_id": result["creditid"]}),
    retry=QUICK,
)
def credit_with_typo(ctx: StepContext, order_id: int, amount_cents: int) -> dict[str, Any]:
    return systems.issue_credit(order_id, amount_cents, ctx.idempotency_key)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=lambda args, result: Undo("reverse_credit", {"credit_id": result.credit_id}),
    retry=QUICK,
)
def credit_as_object(ctx: StepContext, order_id: int, amount_cents: int) -> Credit:
    record = systems.issue_credit(order_id, amount_cents, ctx.idempotency_key)
    return Credit(record["credit_id"], record["amount_cents"])


@tools.tool(ToolClass.READ, retry=QUICK)
def order_history(order_id: int, lines: int) -> dict[str, Any]:
    """A read whose answer grows with ``lines``: past the payload limit, it cannot be recorded."""
    order = systems.get_order(order_id)
    return {"order": order, "lines": ["shipped late"] * lines}
