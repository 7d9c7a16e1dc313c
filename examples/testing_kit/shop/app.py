"""The shop's Celery app (``celery -A shop.app worker``): the checkout's tools, each write with
the compensation that takes it back, and an agent that runs the checkout on the workers."""

from __future__ import annotations

from typing import Any

from celery import Celery
from openai import OpenAI

from saga import RetryPolicy, Saga, StepContext, ToolClass, ToolRegistry, Undo
from saga.agents import ChatModelPolicy
from shop import ledger

tools = ToolRegistry()
#: Short delays: the stock and payment systems answer fast or not at all.
QUICK = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)


def release_it(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo("release_stock", {"reservation_id": result["reservation_id"]}, "release stock")


def refund_it(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo("refund_charge", {"charge_id": result["charge_id"]}, "refund the charge")


def _by_key(live: Any) -> Any:
    """``verify(idempotency_key, args)`` (``saga drill``) from the ledger's check by key."""
    return lambda key, _args: live(key)


# The lookups: an effect that happened and then failed (a timeout after the write) is found
# by its key, not taken for nothing; the drill's fail_after_effect cases play exactly that.
def look_for_reservation(key: str, args: dict[str, Any]) -> dict[str, Any] | None:
    reservation_id = ledger.find_reservation(key)
    return None if reservation_id is None else {"reservation_id": reservation_id}


def look_for_charge(key: str, args: dict[str, Any]) -> dict[str, Any] | None:
    charge_id = ledger.find_charge(key)
    return None if charge_id is None else {"charge_id": charge_id}


def look_for_receipt(key: str, args: dict[str, Any]) -> dict[str, Any] | None:
    receipt_id = ledger.find_receipt(key)
    return None if receipt_id is None else {"receipt_id": receipt_id}


@tools.tool(
    ToolClass.REVERSIBLE_WRITE,
    compensation=release_it,
    retry=QUICK,
    lookup=look_for_reservation,
    verify=_by_key(ledger.reservation_live),
)
def reserve_stock(ctx: StepContext, sku: str, quantity: int) -> dict[str, Any]:
    """Hold ``quantity`` of ``sku`` for this order."""
    return {"reservation_id": ledger.reserve(sku, quantity, ctx.idempotency_key)}


@tools.compensation(retry=QUICK)
def release_stock(reservation_id: str) -> None:
    ledger.release(reservation_id)


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=refund_it,
    retry=QUICK,
    lookup=look_for_charge,
    verify=_by_key(ledger.charge_live),
)
def charge_card(ctx: StepContext, order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge the customer's card for the order."""
    return {"charge_id": ledger.charge(order_id, amount_cents, ctx.idempotency_key)}


@tools.compensation(retry=QUICK)
def refund_charge(charge_id: str) -> None:
    ledger.refund(charge_id)


@tools.tool(
    ToolClass.IRREVERSIBLE_WRITE,
    retry=QUICK,
    lookup=look_for_receipt,
    verify=_by_key(ledger.receipt_sent),
)
def send_receipt(ctx: StepContext, order_id: str, email: str) -> dict[str, Any]:
    """Email the receipt: it cannot be taken back, so it comes last."""
    return {"receipt_id": ledger.send_receipt(order_id, email, ctx.idempotency_key)}


app = Celery("shop")
app.config_from_object("saga.celery_defaults")
saga = Saga(app, tools)
saga.agent(
    "checkout",
    # Made by the turn worker on its first model call: importing this module needs no key.
    ChatModelPolicy.lazy(lambda: OpenAI(max_retries=0), "gpt-4o-mini", "openai_chat"),
    tools=["reserve_stock", "charge_card", "send_receipt"],
)
