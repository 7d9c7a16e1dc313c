"""The checkout's tools against a real worker, with failures injected where they hurt: only the
testing kit's fixtures (``saga_app``, ``saga_worker``, ``saga_faults``, ``saga_model``)."""

from __future__ import annotations

from typing import Any

import pytest
from shop import ledger

from saga import RunState, StepFailedError

ORDER = {"order_id": "o-1", "amount_cents": 1_200}
RECEIPT = {"order_id": "o-1", "email": "ada@example.com"}


def checkout(saga_app: Any) -> Any:
    """Reserve and charge; the receipt is left to each test."""
    run = saga_app.start_run()
    run.call("reserve_stock", sku="mug", quantity=2).result(timeout=30)
    run.call("charge_card", **ORDER).result(timeout=30)
    return run


def test_a_checkout_completes_with_one_of_each_effect(saga_app: Any, saga_worker: Any) -> None:
    run = checkout(saga_app)
    run.call("send_receipt", **RECEIPT).result(timeout=30)

    assert run.finish(timeout=30).state is RunState.COMPLETED
    for kind in ("reservation", "charge", "receipt"):
        assert list(ledger.effects(kind, run.run_id).values()) == [1], kind


def test_a_receipt_that_cannot_be_sent_refunds_and_releases(
    saga_app: Any, saga_worker: Any, saga_faults: Any
) -> None:
    # Given the mail system failing every attempt, before anything is sent
    saga_faults.tool("send_receipt").fail_before_effect(times=3)
    run = checkout(saga_app)

    # When the receipt is sent
    with pytest.raises(StepFailedError):
        run.call("send_receipt", **RECEIPT).result(timeout=30)

    # Then the run unwinds: the charge refunded, the stock released, no receipt
    assert run.wait(timeout=60).state is RunState.COMPENSATED
    [charge] = ledger.effects("charge", run.run_id)
    [reservation] = ledger.effects("reservation", run.run_id)
    assert ledger.refunded(charge) and ledger.released(reservation)
    assert ledger.effects("receipt", run.run_id) == {}


def test_a_charge_that_failed_after_going_through_is_charged_once(
    saga_app: Any, saga_worker: Any, saga_faults: Any
) -> None:
    # Given the payment system charging, then failing to answer, on every attempt
    rule = saga_faults.tool("charge_card").fail_after_effect(times=3)

    # When the card is charged
    run = checkout(saga_app)

    # Then the retries met the same charge, and the lookup found it after the last one
    assert saga_faults.hits(rule) == 3
    assert list(ledger.effects("charge", run.run_id).values()) == [1]
    assert run.finish(timeout=30).state is RunState.COMPLETED


def test_a_worker_killed_after_reserving_reserves_once(
    saga_app: Any, saga_worker: Any, saga_faults: Any
) -> None:
    # Given the worker's process dying right after the stock system reserved
    rule = saga_faults.tool("reserve_stock").kill_worker(at="after_effect")

    # When the stock is reserved
    run = checkout(saga_app)

    # Then the message came back, the tool ran again with the same key, one reservation
    assert saga_faults.hits(rule) == 2
    assert list(ledger.effects("reservation", run.run_id).values()) == [1]
    run.call("send_receipt", **RECEIPT).result(timeout=30)
    assert run.finish(timeout=30).state is RunState.COMPLETED


@pytest.mark.parametrize(("failures", "ending"), [(2, "compensated"), (3, "escalated")])
def test_a_refund_failing_k_times_is_retried_until_its_attempts_run_out(
    saga_app: Any, saga_worker: Any, saga_faults: Any, failures: int, ending: str
) -> None:
    # Given the refund failing ``failures`` times (it has 3 attempts)
    saga_faults.tool("refund_charge").fail_compensation(times=failures)
    run = checkout(saga_app)

    # When the run is aborted
    run.abort("the customer cancelled")

    # Then two failures are retried away; a third is a failed compensation, escalated
    picture = run.wait(timeout=60)
    assert picture.state.value == ending
    [charge] = ledger.effects("charge", run.run_id)
    assert ledger.refunded(charge) is (ending == "compensated")


def test_the_checkout_agent_runs_on_the_worker_against_a_fake_model(
    saga_app: Any, saga_worker: Any, saga_model: Any
) -> None:
    # Given a model that reserves and charges, then sends the receipt, then answers
    saga_model.play(
        [
            [("reserve_stock", {"sku": "mug", "quantity": 2}), ("charge_card", ORDER)],
            [("send_receipt", RECEIPT)],
            "Two mugs are on their way; the receipt went to ada@example.com.",
        ]
    )

    # When the agent is run on the workers
    run_id = saga_app.enqueue_run("checkout", "Two mugs for order o-1, please.")

    # Then it completes, every effect once, and the model was asked three times
    assert saga_app.run(run_id).wait(timeout=60).state is RunState.COMPLETED
    for kind in ("reservation", "charge", "receipt"):
        assert list(ledger.effects(kind, run_id).values()) == [1], kind
    assert len(saga_model.requests) == 3
