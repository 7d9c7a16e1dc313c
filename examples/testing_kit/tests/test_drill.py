"""The checkout drilled: played once per fault on the session's worker (the plugin's
``saga_drill``), each case judged by the ledger (the tools' ``verify``), not by saga's word;
and the checkout agent drilled too, its model (the session's ``saga_model``) answering a turn
differently when it is asked again."""

from __future__ import annotations

from typing import Any

from saga import Run
from saga.testing import HostedScenario

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


ORDER = {"order_id": "o-3", "amount_cents": 1_200}
#: The checkout agent, its model's answers turn by turn; asked again, turn 2 sends the receipt
#: to the address the customer gave later (turns 1 and 3 get the drill's own variants: the
#: reservation and the charge in the other order, the final answer reworded).
AGENT = HostedScenario(
    agent="checkout",
    input="Two mugs for order o-3, please.",
    script=[
        [("reserve_stock", {"sku": "mug", "quantity": 2}), ("charge_card", ORDER)],
        [("send_receipt", {"order_id": "o-3", "email": "ada@example.com"})],
        "Two mugs are on their way.",
    ],
    variants={2: [("send_receipt", {"order_id": "o-3", "email": "ada@example.org"})]},
)


def test_the_checkout_agent_acts_on_the_answer_it_recorded(saga_drill: Any) -> None:
    # When a turn's answer is lost once the model gave it, and the model, asked again, answers
    # differently (one turn of the three, sampled: each case waits out the dead delivery's
    # lease, about 15 s; seed 0 draws turn 2, the receipt)
    report = saga_drill(AGENT, kinds=["model_differs_on_replay"], max_cases=1, seed=0)

    # Then the run acted on the second answer alone, each effect once
    assert [c.fault.turn for c in report.cases[1:]] == [2] and report.skipped == 2
    assert report.ok
