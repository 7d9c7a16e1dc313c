"""The checkout drilled: played once per fault on the session's worker (the plugin's
``saga_drill``), each case judged by the ledger (the tools' ``verify``), not by saga's word."""

from __future__ import annotations

from typing import Any

from saga import Run

#: The faults that need no worker killed (a full drill, ``saga drill``, plays every kind).
KINDS = [
    "fail_before_effect",
    "fail_after_effect",
    "undo_fails_once",
    "undo_fails_always",
    "aborted_after",
]


def checkout(run: Run) -> None:
    """What the agent does: reserve, charge, then the receipt (the pivot) last."""
    run.call("reserve_stock", sku="mug", quantity=2).result(timeout=30)
    run.call("charge_card", order_id="o-2", amount_cents=1_200).result(timeout=30)
    run.call("send_receipt", order_id="o-2", email="ada@example.com").result(timeout=30)


def test_the_checkout_survives_every_fault_the_drill_injects(saga_drill: Any) -> None:
    # When the checkout is played once per fault, and then by the world's account
    report = saga_drill(checkout, kinds=KINDS)

    # Then every case was played and none left an effect nobody reported or undid twice
    assert len(report.cases) > len(KINDS)
    assert report.ok
