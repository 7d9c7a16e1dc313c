"""Effects that happened but cannot be recorded as they are: the caller is told at once, the
undo built from what was captured is pushed, and the run unwinds, goes on or escalates as the
case says (``saga.effects``). Real workers on a private Redis; every effect is counted in the
demo's billing system, not in the saga's own records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from saga import (
    CompensationNotBuiltError,
    RunState,
    StepState,
    ToolResultError,
)
from saga.escalations import escalation_package, to_rich
from tasks import systems
from tests.integration.helpers import ORDER
from tests.reliability.conftest import Private

pytestmark = pytest.mark.timeout(120)
APP = "tests.reliability.effects_app"
LIMIT = 2000
NOT_BUILT = "the compensation could not be built: KeyError 'creditid'"


def effects_env(private: Callable[..., Private]) -> Private:
    """A private saga over the effects app's tools, with a worker whose payload limit is small."""
    from tests.reliability.effects_tools import tools

    env = private(registry=tools, extra_env={"SAGA_MAX_PAYLOAD_BYTES": str(LIMIT)})
    env.worker(APP)
    return env


def ledger() -> tuple[list[int], list[int]]:
    """(credits, reversals) on the order, in cents, as billing has them."""
    entries = systems.ledger(ORDER)
    return (
        [e["amount_cents"] for e in entries if e["kind"] == "credit"],
        [e["amount_cents"] for e in entries if e["kind"] == "reversal"],
    )


def card_text(doc: Any) -> str:
    console = Console(record=True, width=200)
    console.print(to_rich(doc))
    return console.export_text()


def test_a_compensation_that_raises_is_an_error_at_once_and_the_run_escalates(
    private: Callable[..., Private],
) -> None:
    # Given a run with a credit its undo can take back
    env = effects_env(private)
    run = env.saga.start_run()
    run.call("issue_credit", order_id=ORDER, amount_cents=1000).result(timeout=20)

    # When a second credit lands but its compensation function reads a key that is not there
    with pytest.raises(CompensationNotBuiltError) as caught:
        run.call("credit_with_typo", order_id=ORDER, amount_cents=2500).result(timeout=20)

    # Then the caller is told exactly that, at once, and the run does not go on
    assert caught.value.error == NOT_BUILT
    assert (caught.value.step, caught.value.run_goes_on) == (2, False)
    picture = run.wait(timeout=30)
    # and the run escalates once the first credit is undone; the second is live, never lost
    assert picture.state is RunState.ESCALATED
    assert picture.reason == "a compensation could not be built"
    assert picture.cause == f"step 2 (credit_with_typo): {NOT_BUILT}"
    assert picture.step(2).state is StepState.SUCCEEDED
    assert picture.step(2).result["credit_id"]  # the result is recorded as it came
    assert ledger() == ([1000, 2500], [-1000])
    # and the card says what happened, not that an undo gave up after its retries
    [escalation] = env.saga.records.escalations(run.run_id)
    doc = escalation_package(escalation, picture)
    assert doc["why"]["kind"] == "compensation_not_built"
    assert [(i["step"], i["why"]) for i in doc["live"]] == [(2, f"not undoable: {NOT_BUILT}")]
    assert doc["requeueable"] is False  # nothing a requeue could run
    text = card_text(doc)
    assert NOT_BUILT in text
    assert "gave up after its retries" not in text


def test_a_result_that_is_not_json_is_an_error_and_the_write_unwinds_from_what_it_captured(
    private: Callable[..., Private],
) -> None:
    # Given a credit whose tool returns an object, not JSON (its undo reads the object)
    env = effects_env(private)
    run = env.saga.start_run()

    # When it runs
    with pytest.raises(ToolResultError) as caught:
        run.call("credit_as_object", order_id=ORDER, amount_cents=2500).result(timeout=20)

    # Then the caller is told the result broke the tool's contract, and a write unwinds
    assert caught.value.error.startswith("result of credit_as_object is not JSON")
    assert caught.value.run_goes_on is False
    picture = run.wait(timeout=30)
    assert picture.state is RunState.COMPENSATED
    assert picture.reason.startswith("step 1 (credit_as_object): result of credit_as_object")
    # with the step recorded as what it is (it happened) and its undo run from the object
    assert picture.step(1).state is StepState.SUCCEEDED
    assert ledger() == ([2500], [-2500])


def test_a_write_whose_failures_are_fed_back_keeps_its_undo_and_the_run_goes_on(
    private: Callable[..., Private],
) -> None:
    # Given a run that feeds the credit's failures back to its caller
    env = effects_env(private)
    run = env.saga.start_run(on_failure={"credit_as_object": "feed_back"})

    # When the credit lands with a result that is not JSON
    with pytest.raises(ToolResultError) as caught:
        run.call("credit_as_object", order_id=ORDER, amount_cents=2500).result(timeout=20)

    # Then the caller may go on: the run still takes calls, the undo is on its stack
    assert caught.value.run_goes_on is True
    assert run.state() is RunState.RUNNING
    [entry] = run.picture().stack
    assert entry["tool"] == "reverse_credit" and entry["args"]["credit_id"]
    run.call("issue_credit", order_id=ORDER, amount_cents=1000).result(timeout=20)
    # and an abort later takes both credits back
    run.abort("the customer cancelled")
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert ledger() == ([2500, 1000], [-1000, -2500])


def test_a_read_over_the_limit_is_fed_back_and_the_run_completes(
    private: Callable[..., Private],
) -> None:
    # Given a read whose answer is over the worker's payload limit
    env = effects_env(private)
    run = env.saga.start_run()

    # When the caller reads too much
    with pytest.raises(ToolResultError) as caught:
        run.call("order_history", order_id=ORDER, lines=500).result(timeout=20)

    # Then it is told so, and by default (a read) the run goes on to complete
    assert caught.value.run_goes_on is True
    assert f"over the limit of {LIMIT} bytes" in caught.value.error
    assert run.call("order_history", order_id=ORDER, lines=2).result(timeout=20)["lines"]
    run.call("issue_credit", order_id=ORDER, amount_cents=1000).result(timeout=20)
    picture = run.finish(timeout=20)
    assert picture.state is RunState.COMPLETED
    assert picture.step(1).state is StepState.SUCCEEDED
    assert picture.step(1).error == {
        "type": "ToolResultError",
        "message": caught.value.error,
        "run_goes_on": True,
    }
    assert ledger() == ([1000], [])
