"""The saga end to end: real Redis, a real Celery worker, the demo's three systems.

Every failure path is reached by injecting the failure (a system switched "down" or made to
fail N times), and every effect is checked in the systems themselves, not only in saga's
own records.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from saga import (
    CallRefusedError,
    CompensationState,
    RunState,
    StepFailedError,
)
from tasks import systems
from tests.integration.helpers import (
    CREDIT,
    EMAIL,
    ORDER,
    TICKET,
    compensated_steps,
    demo_steps,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)


def credits_and_reversals() -> tuple[list[int], list[int]]:
    entries = systems.ledger(ORDER)
    return (
        [e["amount_cents"] for e in entries if e["kind"] == "credit"],
        [e["amount_cents"] for e in entries if e["kind"] == "reversal"],
    )


def test_happy_path_completes_with_every_effect_kept(saga: Any) -> None:
    # Given all systems up / When the agent runs the four steps and finishes
    run = saga.start_run()
    results = demo_steps(run)
    picture = run.finish(timeout=20)

    # Then the run is completed, the mail step is the pivot, the stack holds both undos
    assert picture.state is RunState.COMPLETED
    assert len(results) == 4
    assert picture.pivot_step == 4
    assert [e["tool"] for e in picture.stack] == ["reverse_credit", "set_ticket_status"]
    assert picture.stack[0]["args"] == {"credit_id": results[1]["credit_id"]}
    assert picture.stack[1]["args"] == {"ticket_id": TICKET, "status": "open"}
    # and the world has every effect, once
    assert credits_and_reversals() == ([CREDIT], [])
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
    assert [m["recipient"] for m in systems.outbox()] == [EMAIL]
    assert saga.records.run(run.run_id).state == "completed"


#: A failed read is fed back to a driven run's caller by default; these tests unwind on it.
READS_UNWIND = {"get_order": "unwind"}

# (successful steps before the failure, service to break, compensations expected, newest first)
FAILURE_POSITIONS = [
    (0, "orders", []),
    (1, "billing", []),
    (2, "tickets", [2]),
    (3, "mail", [3, 2]),
]


@pytest.mark.parametrize(("done", "service", "expected"), FAILURE_POSITIONS)
def test_failure_at_each_position_unwinds_exactly_what_was_done_in_reverse(
    saga: Any, done: int, service: str, expected: list[int]
) -> None:
    # Given the service behind step done+1 is down
    systems.set_down(service)
    run = saga.start_run(on_failure=READS_UNWIND)

    # When the agent runs the sequence
    results = demo_steps(run)
    picture = run.wait(timeout=30)

    # Then exactly the steps that succeeded are compensated, most recent first
    assert len(results) == done
    assert picture.state is RunState.COMPENSATED, picture.reason
    assert compensated_steps(picture) == expected
    assert picture.stack == []
    credits, reversals = credits_and_reversals()
    assert credits == ([CREDIT] if done >= 2 else [])
    assert reversals == ([-CREDIT] if done >= 2 else [])  # a new line; the credit line stays
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert systems.outbox() == []
    if done == 3:  # the ticket was restored before the credit was reversed, in the systems too
        restored_at = systems.ticket_history(TICKET)[-1]["at"]
        reversed_at = systems.ledger(ORDER)[-1]["created_at"]
        assert restored_at < reversed_at


def test_irreversible_call_is_refused_while_a_reversible_step_is_in_flight(saga: Any) -> None:
    # Given a credit that takes a while to settle
    systems.set_delay("billing", 1.5)
    run = saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=10)
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT)
    steps_before = len(run.picture().steps)

    # When the agent asks for the mail before the credit settled
    with pytest.raises(CallRefusedError) as refused:
        run.call("send_reply", to=EMAIL, subject="s", body="b")

    # Then it is refused, naming the unsettled step, and nothing was dispatched
    assert refused.value.unsettled_steps == (credit.step,)
    assert f"step(s) {credit.step}" in str(refused.value)
    assert len(run.picture().steps) == steps_before
    # and once the credit settled, the same call goes through
    credit.result(timeout=10)
    run.call("send_reply", to=EMAIL, subject="s", body="b").result(timeout=10)
    assert run.finish(timeout=10).state is RunState.COMPLETED
    assert len(systems.outbox()) == 1


def _failure_logged(log: str, task_id: str) -> str:
    """The traceback Celery logged for a task that failed, '' until it is in the log."""
    head = log.find(f"[{task_id}] raised unexpected")
    if head < 0:
        return ""
    record = log[head:]
    following = re.search(r"\n\[\d{4}-", record)
    return record[: following.start()] if following else ""


def test_a_tools_failure_is_logged_from_the_tools_own_code(saga: Any, worker: Any) -> None:
    # Given the mail service down for good
    systems.set_down("mail")
    run = saga.start_run()

    # When the fourth step's tool fails after its retries and the run unwinds
    demo_steps(run)
    assert run.wait(timeout=30).state is RunState.COMPENSATED

    # Then the worker logged the step's failure with the tool's frames, from the task's own
    logged = wait_until(
        lambda: _failure_logged(worker.log(), f"{run.run_id}:4"),
        what="the failed step's traceback in the worker's log",
    )
    assert "ServiceUnavailableError: mail is down" in logged
    assert "saga/worker.py" in logged and logged.index("saga/worker.py") < logged.index(
        "in send_reply"
    )
    assert "in send_mail" in logged and "in check_service" in logged
    # and not saga's delivery between the task and the tool
    for delivery in ("in run_step", "in call_tool", "saga/forward.py", "saga/delivery.py"):
        assert delivery not in logged


def test_reversible_call_is_refused_after_the_pivot(saga: Any) -> None:
    # Given a run past its pivot (the reply went out)
    run = saga.start_run()
    demo_steps(run)
    before = run.picture()

    # When the agent asks for another credit
    with pytest.raises(CallRefusedError, match="past its pivot"):
        run.call("issue_credit", order_id=ORDER, amount_cents=100)
    with pytest.raises(CallRefusedError, match="past its pivot"):
        run.call("set_ticket_status", ticket_id=TICKET, status="closed")

    # Then nothing changed and the run still completes
    after = run.picture()
    assert (after.steps, after.stack) == (before.steps, before.stack)
    assert credits_and_reversals() == ([CREDIT], [])
    assert run.finish(timeout=10).state is RunState.COMPLETED


def test_failure_after_the_pivot_escalates_without_unwinding(saga: Any) -> None:
    # Given the partner webhook is down
    systems.set_down("webhook")
    run = saga.start_run()
    demo_steps(run)

    # When a step after the pivot fails
    with pytest.raises(StepFailedError):
        run.call("notify_webhook", url="https://partner.example/hook", event={"credit": 1}).result(
            timeout=20
        )
    picture = run.wait(timeout=20)

    # Then nothing is unwound: the run escalates with the whole picture
    assert picture.state is RunState.ESCALATED
    assert picture.reason == "failed after an irreversible step"
    assert credits_and_reversals() == ([CREDIT], [])
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
    (escalation,) = saga.records.escalations(run.run_id)
    assert escalation.reason == "failed after an irreversible step"
    assert [s["tool"] for s in escalation.steps_done] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert [e["tool"] for e in escalation.stack] == ["reverse_credit", "set_ticket_status"]
    assert {(e["tool"], e["why"]) for e in escalation.not_undone} == {
        ("issue_credit", "not unwound: the run was past its pivot"),
        ("set_ticket_status", "not unwound: the run was past its pivot"),
        ("send_reply", "irreversible: cannot be undone"),
    }


def test_a_compensation_that_fails_twice_then_succeeds_ends_compensated(saga: Any) -> None:
    # Given the reversal service fails twice, and the mail is down
    systems.fail_next("reversal", 2)
    systems.set_down("mail")
    run = saga.start_run()

    demo_steps(run)
    picture = run.wait(timeout=30)

    # Then the reversal was retried to success, once in the ledger
    assert picture.state is RunState.COMPENSATED
    reversal = next(c for c in picture.compensations if c.step == 2)
    assert (reversal.state, reversal.attempts) == (CompensationState.DONE, 3)
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    assert saga.records.escalations(run.run_id) == []


def test_a_compensation_that_always_fails_escalates_and_the_older_ones_still_run(
    saga: Any,
) -> None:
    # Given three steps done, then the ticket system goes down and the mail too
    run = saga.start_run()
    demo_steps(run, upto=3)
    systems.set_down("tickets")
    systems.set_down("mail")

    # When the reply fails, the ticket restore (newest) fails for good
    demo_run_reply = run.call("send_reply", to=EMAIL, subject="s", body="b")
    with pytest.raises(StepFailedError):
        demo_run_reply.result(timeout=20)
    picture = run.wait(timeout=30)

    # Then the older compensation (the credit reversal) still ran, and the run escalated
    assert picture.state is RunState.ESCALATED
    assert picture.reason == "compensation failed"
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
    (escalation,) = saga.records.escalations(run.run_id)
    (failed,) = escalation.failed_compensations
    assert failed["step"] == 3 and failed["attempts"] == 3
    assert "tickets is down" in failed["error"]["message"]
    assert [e["step"] for e in escalation.stack] == [3]
    assert [(e["tool"], e["why"]) for e in escalation.not_undone] == [
        ("set_ticket_status", "its compensation failed")
    ]

    # When someone fixes the ticket system and requeues the failed compensation
    systems.set_down("tickets", False)
    assert saga.requeue_failed_compensations(run.run_id) == 1
    picture = wait_until(
        lambda: (p := run.picture()).state is RunState.COMPENSATED and p.recorded and p,
        what="the requeued compensation",
    )

    # Then the ticket is restored, the credit is not reversed twice, the escalation resolved
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    assert saga.records.escalations(run.run_id, open_only=True) == []
    assert saga.records.run(run.run_id).state == "compensated"
