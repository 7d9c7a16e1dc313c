"""The demo's tools: the seed's credit scenario over three separate systems.

Each tool passes its step's idempotency key down to the system it touches, so a redelivered
step gets the first result back instead of a second credit or a second mail.
"""

from __future__ import annotations

from typing import Any

from saga import RetryPolicy, StepContext, ToolClass, ToolRegistry, ToolRejected, Undo
from tasks import systems

tools = ToolRegistry()

#: Quick retries keep the demo and the tests snappy; production tools would wait longer.
QUICK = RetryPolicy(attempts=3, backoff=0.2, backoff_max=2.0)
PATIENT_UNDO = RetryPolicy(attempts=4, backoff=0.2, backoff_max=2.0)


@tools.tool(ToolClass.READ, retry=QUICK)
def get_order(order_id: int) -> dict[str, Any]:
    """Look an order up (class 1: a read needs no undo)."""
    return systems.get_order(order_id)


def _reverse_the_credit(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    # The credit id is captured from the result, never looked up again at unwind time.
    amount = result["amount_cents"] / 100
    return Undo(
        "reverse_credit",
        {"credit_id": result["credit_id"]},
        f"reverse credit {result['credit_id']} (${amount:,.2f} on order {args['order_id']})",
    )


def _find(lookup: Any) -> Any:
    """Adapt a system's lookup-by-key to the saga's ``lookup(idempotency_key, args)``."""
    return lambda idempotency_key, _args: lookup(idempotency_key)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=_reverse_the_credit,
    retry=QUICK,
    lookup=_find(systems.credit_by_key),
    verify=_find(systems.credit_live),
)
def issue_credit(ctx: StepContext, order_id: int, amount_cents: int, memo: str = "") -> Any:
    """Credit a customer (class 4: undone by a new, visible reversing entry)."""
    try:
        return systems.issue_credit(order_id, amount_cents, ctx.idempotency_key, memo)
    except systems.CreditRefusedError as exc:  # billing said no: the agent may ask for less
        raise ToolRejected(str(exc)) from exc


@tools.compensation(retry=PATIENT_UNDO)
def reverse_credit(ctx: StepContext, credit_id: str) -> dict[str, Any]:
    """Append a reversing ledger entry; the original credit line stays."""
    return systems.reverse_credit(credit_id, ctx.idempotency_key)


def _restore_status(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo(
        "set_ticket_status",
        {"ticket_id": result["ticket_id"], "status": result["previous"]},
        f"set ticket {result['ticket_id']} back to {result['previous']!r}",
    )


@tools.tool(
    ToolClass.REVERSIBLE_WRITE,
    compensation=_restore_status,
    retry=QUICK,
    lookup=_find(systems.status_change_by_key),
    verify=_find(systems.status_change_live),
)
def set_ticket_status(ctx: StepContext, ticket_id: int, status: str) -> dict[str, Any]:
    """Change a ticket's status (class 3: undone by restoring the captured previous status)."""
    return systems.set_ticket_status(ticket_id, status, ctx.idempotency_key)


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=QUICK, lookup=_find(systems.outgoing_by_key))
def send_reply(ctx: StepContext, to: str, subject: str, body: str) -> dict[str, Any]:
    """Mail the customer (class 5: once sent, it is gone; this is the pivot)."""
    return systems.send_mail(to, subject, body, ctx.idempotency_key)


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=QUICK, lookup=_find(systems.outgoing_by_key))
def notify_webhook(ctx: StepContext, url: str, event: dict[str, Any]) -> dict[str, Any]:
    """Tell a partner system (class 5: a posted webhook cannot be recalled)."""
    return systems.post_webhook(url, event, ctx.idempotency_key)
