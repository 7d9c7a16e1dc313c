"""The deploy that ``test_stale_shapes`` checks old stacks and messages against: the credit's
undo now takes a reason, and ``void_credit`` (an older deploy's undo) is gone."""

from __future__ import annotations

from typing import Any

from celery import Celery

from saga import Saga, StepContext, ToolClass, ToolRegistry, Undo

tools = ToolRegistry()


def reverse_it(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo("reverse_credit", {"credit_id": result["credit_id"], "reason": "unwound"})


@tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=reverse_it)
def issue_credit(ctx: StepContext, order_id: int, amount_cents: int) -> dict[str, Any]:
    return {"credit_id": f"cr-{ctx.idempotency_key}"}


@tools.compensation()
def reverse_credit(credit_id: str, reason: str) -> None:
    pass


app = Celery("stale-shapes")
app.config_from_object("saga.celery_defaults")
saga = Saga(app, tools)
