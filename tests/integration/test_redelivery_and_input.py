"""Redelivery changes nothing; bad input is refused with a clear error and changes nothing;
runs are isolated from each other. Real Redis, real worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from saga import (
    InvalidArgumentsError,
    PayloadError,
    RunEndedError,
    RunState,
    UnknownRunError,
    UnknownToolError,
)
from saga.constants import tool_task_name
from tasks import systems
from tests.integration.helpers import CREDIT, ORDER, TICKET, demo_steps, wait_until

pytestmark = pytest.mark.timeout(90)


def redeliver(saga: Any, worker: Any, run_id: str, step: int) -> None:
    """Send the step's message again, as a broker redelivery would, and wait for the worker."""
    record = saga.picture(run_id).step(step)
    task_id = f"redelivered-{uuid.uuid4().hex}"
    saga.app.send_task(
        tool_task_name(record.tool),
        kwargs={"run_id": run_id, "step": step, "args": record.args},
        task_id=task_id,
    )
    wait_until(
        lambda: any(
            task_id in line and ("succeeded" in line or "raised" in line)
            for line in worker.log().splitlines()
        ),
        what=f"the worker to process {task_id}",
    )


def test_duplicated_success_and_duplicated_errback_change_nothing(saga: Any, worker: Any) -> None:
    # Given a run that failed at the mail and was compensated
    systems.set_down("mail")
    run = saga.start_run()
    demo_steps(run)
    before = run.wait(timeout=30)
    assert before.state is RunState.COMPENSATED
    ledger, ticket = systems.ledger(), systems.get_ticket(TICKET)

    # When the credit's success and the mail's failure are delivered again
    redeliver(saga, worker, run.run_id, 2)
    redeliver(saga, worker, run.run_id, 4)

    # Then no effect, push, compensation or unwind happened twice
    after = run.picture()
    assert after == before
    assert systems.ledger() == ledger
    assert systems.get_ticket(TICKET) == ticket


def test_a_redelivered_success_in_a_running_run_replays_the_result(saga: Any, worker: Any) -> None:
    # Given a credit issued in a run that is still going
    run = saga.start_run()
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT).result(timeout=10)

    # When its message is delivered again
    redeliver(saga, worker, run.run_id, 1)

    # Then there is one credit and one undo on the stack
    picture = run.picture()
    assert [e["args"] for e in picture.stack] == [{"credit_id": credit["credit_id"]}]
    assert [e["amount_cents"] for e in systems.ledger()] == [CREDIT]
    assert run.finish(timeout=10).state is RunState.COMPLETED


def test_two_runs_at_once_keep_their_own_stacks(saga: Any) -> None:
    # Given two runs interleaving credits on the same order
    first, second = saga.start_run(), saga.start_run()
    a = first.call("issue_credit", order_id=ORDER, amount_cents=100)
    b = second.call("issue_credit", order_id=ORDER, amount_cents=200)
    credit_a, credit_b = a.result(timeout=10), b.result(timeout=10)

    # When the first is aborted and the second finishes
    first.abort("customer changed their mind")
    assert first.wait(timeout=20).state is RunState.COMPENSATED
    assert second.finish(timeout=10).state is RunState.COMPLETED

    # Then only the first run's credit was reversed
    reversed_credits = [e["reverses_entry_id"] for e in systems.ledger() if e["kind"] == "reversal"]
    assert reversed_credits == [credit_a["entry_id"]]
    assert [e["args"]["credit_id"] for e in second.picture().stack] == [credit_b["credit_id"]]


def test_unknown_tools_and_bad_arguments_are_refused_and_nothing_is_dispatched(
    saga: Any, redis_client: Any
) -> None:
    run = saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=10)
    queued = redis_client.llen("celery")
    before = run.picture()

    with pytest.raises(UnknownToolError, match="refund_everything"):
        run.call("refund_everything", order_id=ORDER)
    with pytest.raises(UnknownToolError, match="reverse_credit"):  # a compensation, not offered
        run.call("reverse_credit", credit_id="cr_4921_1")
    with pytest.raises(InvalidArgumentsError, match="amount_cents"):
        run.call("issue_credit", order_id=ORDER, amount_cents="a lot")
    with pytest.raises(InvalidArgumentsError, match="amount_cents"):
        run.call("issue_credit", order_id=ORDER)
    with pytest.raises(InvalidArgumentsError, match="currency"):
        run.call("issue_credit", order_id=ORDER, amount_cents=1, currency="EUR")
    with pytest.raises(InvalidArgumentsError, match="event"):
        run.call("notify_webhook", url="https://x", event={1, 2})
    with pytest.raises(PayloadError, match="over the limit"):
        run.call("send_reply", to="a@b.c", subject="s", body="x" * 300_000)

    # Nothing was dispatched and the run goes on unharmed
    after = run.picture()
    assert (after.steps, after.stack) == (before.steps, before.stack)
    assert redis_client.llen("celery") == queued
    assert run.finish(timeout=10).state is RunState.COMPLETED


def test_calls_after_a_run_ended_are_refused(saga: Any) -> None:
    run = saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=10)
    done = run.finish(timeout=10)

    with pytest.raises(RunEndedError, match="completed"):
        run.call("get_order", order_id=ORDER)
    with pytest.raises(RunEndedError, match="completed"):
        run.finish(timeout=1)
    with pytest.raises(RunEndedError, match="completed"):
        run.abort("too late")
    with pytest.raises(UnknownRunError):
        saga.run("no-such-run")
    assert run.picture() == done


def test_abort_unwinds_what_was_done(saga: Any) -> None:
    run = saga.start_run()
    demo_steps(run, upto=3)

    run.abort("the agent found a better resolution")
    picture = run.wait(timeout=30)

    assert picture.state is RunState.COMPENSATED
    assert picture.reason == "aborted: the agent found a better resolution"
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert sum(e["amount_cents"] for e in systems.ledger()) == 0
    with pytest.raises(RunEndedError, match="compensated"):
        run.abort("again")


def test_a_step_that_is_still_running_when_the_run_fails_is_compensated_too(saga: Any) -> None:
    # Given a slow credit in flight when another step fails
    systems.set_delay("billing", 1.0)
    systems.set_down("orders")
    run = saga.start_run(on_failure={"get_order": "unwind"})  # a failed read unwinds
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT)
    order = run.call("get_order", order_id=ORDER)

    # When the read fails while the credit is still running
    picture = run.wait(timeout=30)

    # Then the unwind waited for the credit to settle and reversed it
    assert order.state().value == "failed"
    assert credit.state().value == "succeeded"
    assert picture.state is RunState.COMPENSATED
    assert credits_sum() == 0


def credits_sum() -> int:
    return sum(e["amount_cents"] for e in systems.ledger())


def test_abort_during_unwinding_and_calls_on_an_unknown_run_are_refused(saga: Any) -> None:
    # Given a run that is unwinding (a read failed) while a slow credit is still in flight
    systems.set_delay("billing", 1.0)
    systems.set_down("orders")
    run = saga.start_run(on_failure={"get_order": "unwind"})  # a failed read unwinds
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT)
    read = run.call("get_order", order_id=ORDER)
    wait_until(lambda: run.state() is RunState.UNWINDING, what="the run to start unwinding")

    # When the agent aborts it or calls another tool
    with pytest.raises(RunEndedError, match="unwinding"):
        run.abort("changed my mind")
    with pytest.raises(RunEndedError, match="unwinding"):
        run.call("get_order", order_id=ORDER)

    # Then nothing was lost: the credit in flight is still undone
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert (credit.state().value, read.state().value) == ("succeeded", "failed")
    assert sum(e["amount_cents"] for e in systems.ledger()) == 0

    # and a run nobody started is refused by name
    from saga.runs import Run

    with pytest.raises(UnknownRunError, match="no-such-run"):
        Run(saga.core, "no-such-run").call("get_order", order_id=ORDER)
