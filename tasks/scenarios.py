"""The demo's credit scenario as a driven run, for ``saga drill``
(``saga drill --app tasks.app:saga --scenario tasks.scenarios:credit_refund``): look the order
up, credit it, mark the ticket, mail the customer (the pivot). Each run starts from a fresh
world, so every case of the drill meets the same one (a run replayed with ``--from-run`` gets
it from ``--setup tasks.systems:reset``)."""

from __future__ import annotations

from typing import Any

from tasks import systems

ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"


def credit_refund(run: Any) -> None:
    systems.reset()
    run.call("get_order", order_id=ORDER).result(timeout=30)
    run.call("issue_credit", order_id=ORDER, amount_cents=250_000, memo="late").result(timeout=30)
    run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=30)
    body = "We credited $2,500."
    run.call("send_reply", to=EMAIL, subject="Your credit", body=body).result(timeout=30)
    run.finish(timeout=30)
