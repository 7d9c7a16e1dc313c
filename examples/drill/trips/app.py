"""A trip's booking as a saga: hold a seat, charge a deposit and the balance, send the ticket.

Two of its undos are broken on purpose, the way real ones break, for ``saga drill`` to catch:

- ``refund_latest_charge`` re-derives what to refund (the order's latest charge) at unwind
  time instead of using the charge id the step captured: unwinding both charges refunds the
  balance twice and leaves the deposit charged;
- ``release_seat`` is not idempotent: delivered again (its effect happened, then it failed and
  was retried), it gives the seat back twice.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from saga import RetryPolicy, Saga, StepContext, ToolClass, ToolRegistry, Undo
from trips import systems

tools = ToolRegistry()
QUICK = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)


def _key_only(check: Any) -> Any:
    """``verify(idempotency_key, args)`` from a system's check by key."""
    return lambda key, _args: check(key)


def release_it(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo("release_seat", {"hold_id": result["hold_id"]}, "release the seat")


def refund_it(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    # BROKEN: the order id, not the charge id the step returned; the refund looks it up later.
    return Undo("refund_latest_charge", {"order_id": args["order_id"]}, "refund the charge")


@tools.tool(
    ToolClass.REVERSIBLE_WRITE,
    compensation=release_it,
    retry=QUICK,
    verify=_key_only(systems.hold_live),
)
def hold_seat(ctx: StepContext, flight: str) -> dict[str, Any]:
    """Hold a seat on ``flight``."""
    return {"hold_id": systems.hold_seat(flight, ctx.idempotency_key)}


@tools.compensation(retry=QUICK, verify=_key_only(systems.releases))
def release_seat(ctx: StepContext, hold_id: str) -> None:
    systems.release_seat(hold_id, ctx.idempotency_key)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=refund_it,
    retry=QUICK,
    verify=_key_only(systems.charge_live),
)
def charge_card(ctx: StepContext, order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge the customer's card."""
    return {"charge_id": systems.charge(order_id, amount_cents, ctx.idempotency_key)}


@tools.compensation(retry=QUICK)
def refund_latest_charge(order_id: str) -> None:
    charge_id = systems.latest_charge(order_id)  # BROKEN: re-derived at unwind time
    if charge_id is not None:
        systems.refund(charge_id)


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=QUICK, verify=_key_only(systems.ticket_sent))
def send_ticket(ctx: StepContext, order_id: str, email: str) -> dict[str, Any]:
    """Email the ticket: it cannot be taken back, so it comes last."""
    return {"ticket_id": systems.send_ticket(order_id, email, ctx.idempotency_key)}


app = Celery("trips")
app.config_from_object("saga.celery_defaults")
saga = Saga(app, tools)
