"""A store that went back in time is never believed over what SQL recorded.

A failover to a replica that had not received the last writes, or an old master that resynced,
leaves a run's keys older than its SQL record: a run SQL recorded ``completed`` is ``running``
in Redis again, a step of it in flight. Here the keys are put back as they were earlier in the
run (``DUMP`` then ``RESTORE`` of every key of the run: what a lost tail of writes leaves) on
a private Redis, after a real worker ran the run to its recorded end. The reaper, which would
otherwise abandon the run and reverse its $2,500 credit, escalates it once and does nothing
else: no undo runs, SQL keeps its end, and the next passes stay quiet. A step failing there,
and an operator's requeue there, undo nothing either; a requeue between a record's write and
its mark is no divergence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from saga import OperationRefusedError, RunState, StepFailedError
from saga.constants import agent_key, run_keys
from saga.rules import REASON_STORE_BEHIND
from tasks import systems
from tests.integration.helpers import ORDER, TICKET, demo_steps, wait_until
from tests.reliability.conftest import Private
from tests.reliability.test_crashes import credits_and_reversals, hand_reserve

pytestmark = pytest.mark.timeout(120)

#: The result backend's keys (on the same Redis here, so they go back in time too).
RESULTS = "celery-task-meta-*"
CREDIT_CALL = ("issue_credit", {"order_id": ORDER, "amount_cents": 100, "memo": "goodwill"})
TICKET_CALL = ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"})


def snapshot(env: Private, run_id: str) -> dict[str, bytes]:
    """Every key of the run and every task result as they are now, dumped (what ``RESTORE``
    puts back)."""
    raw = env.saga.store.client
    keys = [*run_keys(run_id), agent_key(run_id), *raw.scan_iter(match=RESULTS)]
    return {key: dumped for key in keys if (dumped := raw.dump(key)) is not None}


def go_back(env: Private, run_id: str, dumped: dict[str, bytes]) -> None:
    """Put the run's keys and the task results back as ``snapshot`` found them, dropping
    those written since, and make the run due for the reaper (its index entry went back with
    them)."""
    raw = env.saga.store.client
    for key in [*run_keys(run_id), agent_key(run_id), *raw.scan_iter(match=RESULTS)]:
        raw.delete(key)
    for key, value in dumped.items():
        raw.restore(key, 0, value, replace=True)
    env.saga.store.schedule(run_id, 0)


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "step-in-flight"])
def test_a_recorded_run_whose_keys_went_back_in_time_is_escalated_never_reversed(
    private: Callable[..., Private], in_flight: bool
) -> None:
    # Given a run that credited $2,500, changed the ticket and completed, recorded in SQL
    env = private(run_deadline=1)
    env.worker(concurrency=1)
    run = env.saga.start_run()
    demo_steps(run, upto=2)
    earlier = snapshot(env, run.run_id)
    run.call(TICKET_CALL[0], **TICKET_CALL[1]).result(timeout=20)
    done = run.finish(timeout=20)
    assert done.state is RunState.COMPLETED
    recorded = env.saga.records.run(run.run_id)
    assert recorded is not None and recorded.state == "completed"

    # When Redis goes back to just after the credit (and, in flight: a step dispatched there
    # that no worker will ever take), and the reaper passes once the run looks abandoned
    go_back(env, run.run_id, earlier)
    if in_flight:
        hand_reserve(env, run.run_id, *TICKET_CALL)
    behind = env.saga.picture(run.run_id)
    assert behind.state is RunState.RUNNING
    time.sleep(1.5)
    report = env.saga.reap()

    # Then the run is escalated once, naming both versions, and nothing is undone
    assert report.abandoned == [] and report.never_started == [] and report.in_doubt == []
    assert [run_id for run_id, _ in report.behind] == [run.run_id]
    problem = report.behind[0][1]
    assert f"completed at version {recorded.version}" in problem
    assert f"running at version {behind.version}" in problem
    escalation = env.saga.records.escalation(f"{run.run_id}:reaper")
    assert escalation is not None and not escalation.resolved
    assert escalation.reason == REASON_STORE_BEHIND and escalation.cause == problem
    time.sleep(1.0)  # a reversal sent by mistake would have landed by now
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"
    after = env.saga.records.run(run.run_id)
    assert after is not None and (after.state, after.version) == ("completed", recorded.version)
    assert env.saga.picture(run.run_id).state is RunState.RUNNING  # left as it is, for a person

    # And a person who closed it is not told again while nothing changed; later passes,
    # even far past every deadline and lease, act on nothing
    closed = env.saga.resolve_escalation(f"{run.run_id}:reaper", note="seen", by="ops")
    assert closed.resolved
    for ahead in (0.0, 3_600.0):
        env.saga.store.schedule(run.run_id, 0)
        again = env.saga.reap(now=env.saga.store.now() + ahead)
        assert [run_id for run_id, _ in again.behind] == [run.run_id]
        assert again.abandoned == [] and again.in_doubt == [] and again.never_started == []
    reread = env.saga.records.escalation(f"{run.run_id}:reaper")
    assert reread is not None and reread.resolved
    assert credits_and_reversals(run.run_id) == (1, 0)


def test_a_step_failing_on_keys_gone_back_in_time_undoes_nothing(
    private: Callable[..., Private],
) -> None:
    # Given a completed run, recorded in SQL, whose keys went back to just after its credit
    env = private()
    env.worker(concurrency=1)
    run = env.saga.start_run()
    demo_steps(run, upto=2)
    earlier = snapshot(env, run.run_id)
    run.call(TICKET_CALL[0], **TICKET_CALL[1]).result(timeout=20)
    assert run.finish(timeout=20).state is RunState.COMPLETED
    go_back(env, run.run_id, earlier)

    # When the agent, told nothing, calls a second credit there that fails for good (its
    # failure and retries bump the keys' version past the record's: the version alone would
    # believe them)
    env.faults.fail(CREDIT_CALL[0], times=50)
    with pytest.raises(StepFailedError):
        run.call(CREDIT_CALL[0], **CREDIT_CALL[1]).result(timeout=30)

    # Then the unwind the failure owns is never sent: a person is told, nothing is undone
    escalation = wait_until(
        lambda: env.saga.records.escalation(f"{run.run_id}:reaper"), what="the escalation"
    )
    assert escalation.reason == REASON_STORE_BEHIND
    picture = env.saga.picture(run.run_id)
    recorded = env.saga.records.run(run.run_id)
    assert recorded is not None and recorded.state == "completed"
    assert picture.state is RunState.UNWINDING and picture.extra["sent"] == "0"
    assert "having reached no end" in escalation.cause
    time.sleep(1.0)  # a reversal sent by mistake would have landed by now
    assert credits_and_reversals(run.run_id) == (1, 0)

    # And the reaper, which takes over an unwind nobody sent at the run's deadline, leaves it
    report = env.saga.reap(now=env.saga.store.now() + 3_600)
    assert [run_id for run_id, _ in report.behind] == [run.run_id] and report.resumed == []
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert env.saga.records.run(run.run_id).state == "completed"  # type: ignore[union-attr]


def credited_with_its_reversal_down(private: Callable[..., Private]) -> tuple[Private, Any]:
    """A private deployment's run that credited $2,500 and changed the ticket, with the
    ledger's reversals down: its unwind escalates."""
    env = private()
    env.worker(concurrency=1)
    run = env.saga.start_run()
    demo_steps(run, upto=2)
    systems.set_down("reversal")
    return env, run


def test_a_requeue_between_the_records_write_and_its_mark_is_believed(
    private: Callable[..., Private],
) -> None:
    # Given a run escalated with its reversal down, whose worker pauses between writing the
    # escalation's record and marking the keys recorded
    env, run = credited_with_its_reversal_down(private)
    env.faults.delay("", 3.0, point="after_escalation_recorded")
    run.abort("the customer cancelled")
    wait_until(
        lambda: getattr(env.saga.records.run(run.run_id), "state", "") == "escalated",
        what="the escalation's record",
    )
    assert not env.saga.picture(run.run_id).recorded

    # When an operator requeues it right then
    systems.set_down("reversal", False)
    assert env.saga.requeue_failed_compensations(run.run_id, by="ops") == 1

    # Then the keys are not taken for keys gone back in time: the reversal runs
    picture = run.wait(timeout=30)
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert env.saga.records.escalation(f"{run.run_id}:reaper") is None


def test_a_requeue_of_keys_gone_back_in_time_is_refused_and_undoes_nothing(
    private: Callable[..., Private],
) -> None:
    # Given a run escalated with its reversal down, requeued and escalated again (recorded),
    # whose keys then go back to its first escalation
    env, run = credited_with_its_reversal_down(private)
    run.abort("the customer cancelled")
    first = run.wait(timeout=30)
    assert first.state is RunState.ESCALATED
    earlier = snapshot(env, run.run_id)
    env.saga.requeue_failed_compensations(run.run_id, by="ops")
    wait_until(
        lambda: (
            getattr(env.saga.records.run(run.run_id), "generation", 0) == 1
            and env.saga.picture(run.run_id).recorded
        ),
        what="the second escalation's record",
    )
    go_back(env, run.run_id, earlier)
    systems.set_down("reversal", False)

    # When an operator requeues it from there
    with pytest.raises(OperationRefusedError, match="nothing was undone") as refused:
        env.saga.requeue_failed_compensations(run.run_id, by="ops")

    # Then nothing is undone, and a person is told why
    assert f"{run.run_id}:reaper" in str(refused.value)
    escalation = env.saga.records.escalation(f"{run.run_id}:reaper")
    assert escalation is not None and escalation.reason == REASON_STORE_BEHIND
    time.sleep(1.0)  # a reversal sent by mistake would have landed by now
    assert credits_and_reversals(run.run_id) == (1, 0)


def test_a_step_the_store_forgot_beginning_is_reconciled_by_its_lookup_never_judged_unstarted(
    private: Callable[..., Private],
) -> None:
    """A failover can lose a step's begin and its outcome while its message is acked (a time
    limit cut the delivery's wait for an unconfirmed write short): the store says the step was
    never begun, its credit is real. The reaper asks the tool's lookup before judging it never
    started, finds the credit, and the unwind reverses it."""
    from saga.constants import tool_task_name

    # Given a credit reserved, its keys as they were then, and the step run by a real worker
    env = private()
    env.worker(concurrency=1)
    run = env.saga.start_run(deadline=1.0)
    tool, args = CREDIT_CALL
    step = hand_reserve(env, run.run_id, tool, args)
    before = snapshot(env, run.run_id)
    env.saga.app.send_task(
        tool_task_name(tool),
        kwargs={"run_id": run.run_id, "step": step, "args": args},
        task_id=f"{run.run_id}:{step}",
    )
    wait_until(lambda: run.picture().step(step).state.value == "succeeded", what="the credit")

    # When the store goes back to the reservation (the step "dispatched", nothing on the stack)
    go_back(env, run.run_id, before)
    assert run.picture().step(step).state.value == "dispatched"
    assert credits_and_reversals(run.run_id) == (1, 0)
    time.sleep(1.5)

    # Then the reaper finds the credit by its key instead of calling the step never started,
    # and the unwind reverses it once
    report = env.saga.reap()
    assert report.never_started == []
    assert report.in_doubt == [(run.run_id, step, "happened")]
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
