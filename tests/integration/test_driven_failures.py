"""A driven run's choice for a step that fails for good: fed back to the caller (the run goes
on) or unwound, per tool, with the hosted runs' default (reads fed back, writes unwind).
Failures are injected by taking the demo's systems down; effects are checked in them."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from saga import (
    InvalidRunOptionError,
    OnFailure,
    RunState,
    StepFailedError,
    StepRejectedError,
    StepState,
)
from tasks import systems
from tests.integration.helpers import CREDIT, ORDER, TICKET, demo_steps

pytestmark = pytest.mark.timeout(90)


def ledger() -> list[int]:
    return [e["amount_cents"] for e in systems.ledger(ORDER)]


def test_a_read_that_fails_for_good_is_fed_back_and_the_run_completes(saga: Any) -> None:
    # Given the orders service down
    systems.set_down("orders")
    run = saga.start_run()

    # When the caller reads the order
    with pytest.raises(StepRejectedError) as caught:
        run.call("get_order", order_id=ORDER).result(timeout=20)

    # Then it gets the tool's error to hand to its model, and the run is still open
    assert "orders" in caught.value.error and caught.value.run_goes_on
    assert run.state() is RunState.RUNNING
    # and once the service is back, the run goes on with its other calls and completes
    systems.clear_switches()
    assert len(demo_steps(run)) == 4
    picture = run.finish(timeout=20)
    assert picture.state is RunState.COMPLETED
    assert picture.step(1).state is StepState.REJECTED
    assert ledger() == [CREDIT]


def test_a_compensatable_write_that_fails_for_good_unwinds_by_default(saga: Any) -> None:
    # Given a run with a ticket changed, and billing down
    run = saga.start_run()
    run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=20)
    systems.set_down("billing")

    # When the credit fails for good
    with pytest.raises(StepFailedError) as caught:
        run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT).result(timeout=20)

    # Then the run unwinds: the ticket is set back, nothing is credited
    assert not isinstance(caught.value, StepRejectedError) and not caught.value.run_goes_on
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert ledger() == []


def test_an_override_makes_a_failed_read_unwind(saga: Any) -> None:
    # Given a run whose caller wants a failed read to end it, a ticket changed, orders down
    run = saga.start_run(on_failure={"get_order": "unwind"})
    run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=20)
    systems.set_down("orders")

    # When the read fails for good
    with pytest.raises(StepFailedError) as caught:
        run.call("get_order", order_id=ORDER).result(timeout=20)

    # Then it is no feed-back: the run unwinds
    assert not isinstance(caught.value, StepRejectedError)
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert systems.get_ticket(TICKET)["status"] == "open"


def test_an_override_feeds_a_failed_write_back_and_keeps_what_was_done(saga: Any) -> None:
    # Given a run that feeds the credit's failures back, with a ticket changed, billing down
    run = saga.start_run(on_failure={"issue_credit": OnFailure.FEED_BACK})
    run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=20)
    systems.set_down("billing")

    # When the credit fails for good
    with pytest.raises(StepRejectedError) as caught:
        run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT).result(timeout=20)

    # Then the run goes on: billing back, the credit asked again lands, the run completes
    assert "billing" in caught.value.error
    systems.clear_switches()
    run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT).result(timeout=20)
    assert run.finish(timeout=20).state is RunState.COMPLETED
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
    assert ledger() == [CREDIT]


def test_attaching_takes_its_own_choice(saga: Any) -> None:
    # Given a run started elsewhere, attached to with reads unwinding
    run = saga.run(saga.start_run().run_id, on_failure={"get_order": "unwind"})
    systems.set_down("orders")

    # When the read fails for good / Then the attached run unwinds (nothing to undo)
    with pytest.raises(StepFailedError) as caught:
        run.call("get_order", order_id=ORDER).result(timeout=20)
    assert not caught.value.run_goes_on
    assert run.wait(timeout=30).state is RunState.COMPENSATED


@pytest.mark.parametrize(
    ("on_failure", "message"),
    [
        ({"get_ordr": "unwind"}, "names 'get_ordr', which it may not call"),
        ({"reverse_credit": "unwind"}, "names 'reverse_credit', which it may not call"),
        ({"get_order": "retry"}, "on_failure 'retry': use one of feed_back, unwind"),
        (["get_order"], "maps tool names to modes, it is no list"),
    ],
)
def test_a_bad_choice_is_refused_before_the_run_exists(
    saga: Any, on_failure: Any, message: str
) -> None:
    # When a run is started with a choice naming no tool it may call, or no known mode
    run_id = f"refused-{uuid.uuid4().hex}"
    with pytest.raises(InvalidRunOptionError, match=message):
        saga.start_run(run_id, on_failure=on_failure)
    # Then nothing was written: the same id starts a run afterwards
    assert saga.start_run(run_id).run_id == run_id
