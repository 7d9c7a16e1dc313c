"""Workers killed at the worst moments: the stack survives and nothing is applied twice.

Each test owns its Redis and workers (see conftest). Effects are counted in the demo
systems, keyed by idempotency key, not in the saga's own records.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from saga import (
    CompensationState,
    Run,
    RunState,
    StepFailedError,
    StepHandle,
    StepState,
    payload,
)
from saga.constants import compensation_idempotency_key, step_idempotency_key
from saga.errors import StepInDoubtError
from saga.rules import REASON_COMPENSATION_FAILED
from saga.stack import RunPicture
from saga.testing import WorkerProcess
from tasks import systems
from tests.integration.helpers import CREDIT, EMAIL, ORDER, TICKET, demo_steps, wait_until
from tests.reliability.conftest import VISIBILITY_TIMEOUT, Private

pytestmark = pytest.mark.timeout(120)

GET_ORDER = ("get_order", {"order_id": ORDER})
CREDIT_CALL = ("issue_credit", {"order_id": ORDER, "amount_cents": CREDIT, "memo": "late"})
TICKET_CALL = ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"})
REPLY_CALL = ("send_reply", {"to": EMAIL, "subject": "Your credit", "body": "Credited."})


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def private(private: Callable[..., Private]) -> Iterator[Callable[..., Private]]:
    """The conftest's factory, whose workers are SIGKILLed at teardown (by PID group, before
    the conftest stops them): a warm shutdown costs ~1.5 s a test and proves nothing here."""
    made: list[Private] = []

    def make(**kwargs: Any) -> Private:
        env = private(**kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        for worker in env.workers:
            worker.kill()


def effects() -> dict[str, list[str]]:
    """Every effect in the three demo systems, keyed by idempotency key: its timestamps."""
    found: dict[str, list[str]] = {}
    for row in systems.ledger():
        found.setdefault(row["idempotency_key"], []).append(row["created_at"])
    for row in systems.ticket_history(TICKET):
        found.setdefault(row["idempotency_key"], []).append(row["at"])
    for row in systems.outbox():
        found.setdefault(row["idempotency_key"], []).append(row["at"])
    return found


def credits_and_reversals(run_id: str) -> tuple[int, int]:
    lines = [r for r in systems.ledger() if r["idempotency_key"].startswith(f"{run_id}:")]
    return (
        sum(1 for r in lines if r["kind"] == "credit"),
        sum(1 for r in lines if r["kind"] == "reversal"),
    )


def check_invariants(env: Private, picture: RunPicture) -> None:
    """The invariants every test ends on, read from the saga and from the systems."""
    run_id = picture.run_id
    # The run ended in exactly one of the three end states, and the records agree.
    assert picture.state in (RunState.COMPLETED, RunState.COMPENSATED, RunState.ESCALATED)
    record = env.saga.records.run(run_id)
    assert record is not None and record.state == picture.state.value
    escalations = env.saga.records.escalations(run_id)
    if picture.state is RunState.ESCALATED:
        assert len(escalations) == 1, escalations
    else:
        assert escalations == []
    live = {e["step"] for e in escalations[0].not_undone} if escalations else set()

    world = effects()
    comps = {c.step: c for c in picture.compensations}
    for step in picture.steps:
        key = step_idempotency_key(run_id, step.step)
        undo_key = compensation_idempotency_key(run_id, step.step)
        # No effect applied twice, no undo applied twice.
        assert len(world.get(key, [])) <= 1, (step, world.get(key))
        assert len(world.get(undo_key, [])) <= 1, (step, world.get(undo_key))
        if step.tool_class.is_write and step.state is StepState.SUCCEEDED:
            assert len(world.get(key, [])) == 1, f"step {step.step} succeeded without effect"
        if step.state in (StepState.FAILED, StepState.SKIPPED, StepState.NOT_DISPATCHED):
            assert key not in world, f"step {step.step} is {step.state} but its effect exists"
        if step.state is not StepState.SUCCEEDED or not step.tool_class.needs_compensation:
            continue
        comp = comps[step.step]
        if picture.state is RunState.COMPLETED:
            assert comp.state is CompensationState.PENDING and undo_key not in world
        elif comp.state is CompensationState.DONE:
            assert len(world.get(undo_key, [])) == 1, f"step {step.step} undone but no undo"
        else:
            assert picture.state is RunState.ESCALATED and step.step in live, step

    # Compensations ran in reverse order: by the saga's clock and by the systems' clocks.
    settled = sorted(
        (c for c in picture.compensations if c.settled_at is not None),
        key=lambda c: c.settled_at or 0.0,
    )
    assert [c.step for c in settled] == sorted((c.step for c in settled), reverse=True)
    done = [c.step for c in settled if c.state is CompensationState.DONE]
    stamps = [world[compensation_idempotency_key(run_id, n)][0] for n in done]
    assert stamps == sorted(stamps), stamps

    # Every failed compensation is in the escalation record.
    failed = {c.step for c in picture.compensations if c.state is CompensationState.FAILED}
    if failed:
        assert {f["step"] for f in escalations[0].failed_compensations} == failed


def pool_children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as fh:
            children += [int(c) for c in fh.read().split()]
    return children


def step_state(env: Private, run_id: str, step: int) -> str:
    return env.saga.picture(run_id).step(step).state.value


def processed(worker: WorkerProcess, task_id: str, times: int = 1) -> bool:
    """The worker's log shows ``task_id`` finished (succeeded or raised) ``times`` times."""
    lines = worker.log().splitlines()
    done = [ln for ln in lines if f"[{task_id}]" in ln and ("succeeded" in ln or "raised" in ln)]
    return len(done) >= times


def settle(run: Run, timeout: float) -> RunPicture:
    """The run's picture once it has ended and its record is written (the conclusion writes it
    just after the fenced state change), or as it stands after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        picture = run.picture()
        if (picture.state.ended and picture.recorded) or time.monotonic() > deadline:
            return picture
        time.sleep(0.05)


def call(run: Run, spec: tuple[str, dict[str, Any]]) -> StepHandle:
    return run.call(spec[0], **spec[1])


def hand_reserve(env: Private, run_id: str, tool: str, args: dict[str, Any]) -> int:
    """Reserve a step as the dispatcher does (its pivot rules included), sending no message."""
    tool_class = env.saga.registry.get(tool).tool_class
    assert tool_class is not None
    args_json = payload.dumps(args, what="args", limit=1 << 20)
    return env.saga.core._reserve(run_id, tool, tool_class, args_json, "", "")[0]


# -- tests -----------------------------------------------------------------------------------


def test_kill_after_the_effect_but_before_the_push_applies_it_once(
    private: Callable[..., Private],
) -> None:
    # Given a worker that dies right after the credit is issued, before the undo is pushed
    env = private()
    env.worker(concurrency=1)
    rule = env.faults.kill("after_effect", "issue_credit")

    # When the agent runs the sequence (the message is redelivered to a fresh pool process)
    run = env.saga.start_run()
    results = demo_steps(env.saga.run(run.run_id))
    picture = run.finish(timeout=30)

    # Then the credit exists once and its undo is on the stack once
    assert env.faults.hits(rule) >= 1
    assert len(results) == 4 and picture.state is RunState.COMPLETED
    assert [e["amount_cents"] for e in systems.ledger(ORDER)] == [CREDIT]
    assert [e["tool"] for e in picture.stack] == ["reverse_credit", "set_ticket_status"]
    assert picture.step(2).attempts == 2
    assert systems.get_ticket(TICKET)["status"] == "pending_refund"


def test_sigkill_of_the_pool_child_mid_step_redelivers_and_credits_once(
    private: Callable[..., Private],
) -> None:
    # Given a credit step that is running (held in a 2 s delay) in the only pool child
    env = private()
    worker = env.worker(concurrency=1)
    rule = env.faults.delay("issue_credit", 2)
    run = env.saga.start_run()
    call(run, GET_ORDER).result(timeout=10)
    credit = call(run, CREDIT_CALL)
    # (in the delay itself: "running" is written a moment before the child reaches it, and a
    # kill in that moment would leave one hit for two attempts)
    wait_until(lambda: env.faults.hits(rule) == 1, 10, "the credit to reach its delay")
    assert step_state(env, run.run_id, 2) == "running"
    children = pool_children(worker.pid)
    assert len(children) == 1

    # When that child is SIGKILLed while the step runs
    os.kill(children[0], signal.SIGKILL)

    # Then the step is redelivered to a fresh child and completes, with one credit
    result = credit.result(timeout=20)
    picture = run.finish(timeout=10)
    assert picture.state is RunState.COMPLETED
    assert picture.step(2).attempts == 2 and env.faults.hits(rule) == 2
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert [e["args"] for e in picture.stack] == [{"credit_id": result["credit_id"]}]
    assert children[0] not in pool_children(worker.pid)
    check_invariants(env, picture)


def test_sigkill_of_the_whole_worker_mid_step_is_taken_over_by_a_new_worker(
    private: Callable[..., Private],
) -> None:
    # Given a credit step running (in a 2 s delay) on a worker that is then SIGKILLed whole
    env = private()
    first = env.worker(concurrency=1)
    env.faults.delay("issue_credit", 2)
    run = env.saga.start_run()
    credit = call(run, CREDIT_CALL)
    wait_until(lambda: step_state(env, run.run_id, 1) == "running", 10, "the credit to start")
    delivered = time.monotonic()
    first.kill()

    # When a second worker starts once the visibility timeout has passed
    time.sleep(max(0.0, delivered + VISIBILITY_TIMEOUT + 0.5 - time.monotonic()))
    env.worker(concurrency=1)

    # Then it restores the unacked message, runs the step again, and credits once
    result = credit.result(timeout=20)
    picture = run.finish(timeout=10)
    assert picture.state is RunState.COMPLETED and picture.step(1).attempts == 2
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert [e["args"] for e in picture.stack] == [{"credit_id": result["credit_id"]}]
    check_invariants(env, picture)


def test_a_standby_worker_takes_over_a_dead_workers_step_soon_after_the_visibility_timeout(
    private: Callable[..., Private],
) -> None:
    # Given two workers, and a credit step running on one of them (in a 2 s delay)
    env = private()
    workers = [env.worker(concurrency=1), env.worker(concurrency=1)]
    env.faults.delay("issue_credit", 2)
    run = env.saga.start_run()
    credit = call(run, CREDIT_CALL)
    task_id = f"{run.run_id}:1"
    holder = wait_until(
        lambda: next((w for w in workers if f"[{task_id}] received" in w.log()), None),
        10,
        "a worker to receive the credit",
    )
    wait_until(lambda: step_state(env, run.run_id, 1) == "running", 10, "the credit to start")

    # When the worker holding it is SIGKILLed whole
    holder.kill()

    # Then the standby worker runs it once the visibility timeout (6 s) has passed, give or
    # take one restore sweep: within 20 s, not the ~100 s of kombu's default sweep
    credit.result(timeout=20)
    picture = run.finish(timeout=10)
    assert picture.state is RunState.COMPLETED
    assert credits_and_reversals(run.run_id) == (1, 0)


def test_kill_after_the_reversal_but_before_it_is_recorded_reverses_once(
    private: Callable[..., Private],
) -> None:
    # Given a run that unwinds because the mail is down, and a worker that dies right after
    # the reversal is applied, before the compensation is recorded done
    env = private()
    env.worker(concurrency=1)
    systems.set_down("mail")
    rule = env.faults.kill("after_compensation", "reverse_credit")

    # When the agent runs the sequence
    run = env.saga.start_run()
    demo_steps(run)
    picture = run.wait(timeout=40)

    # Then the redelivered compensation finds the reversal by its key: one reversal line
    assert env.faults.hits(rule) == 2
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
    comps = {c.step: c for c in picture.compensations}
    assert comps[2].state is CompensationState.DONE and comps[2].attempts == 2
    assert comps[3].state is CompensationState.DONE and comps[3].attempts == 1
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert systems.outbox() == []
    check_invariants(env, picture)


@pytest.mark.parametrize("failure", ["orders-down", "no-such-order"])
def test_two_failures_at_once_start_exactly_one_unwind(
    private: Callable[..., Private], failure: str
) -> None:
    # Given a run with a credit, and two reads in flight together on two pool processes,
    # both failing (after retries with the orders service down, or together: no such order)
    env = private()
    worker = env.worker(concurrency=2)
    run = env.saga.start_run(on_failure={"get_order": "unwind"})  # a failed read unwinds
    call(run, CREDIT_CALL).result(timeout=10)
    if failure == "orders-down":
        systems.set_down("orders")
        reads = [call(run, GET_ORDER), call(run, GET_ORDER)]
    else:  # both start, wait 0.5 s in the service, then fail together, without retries
        systems.set_delay("orders", 0.5)
        reads = [run.call("get_order", order_id=1), run.call("get_order", order_id=1)]

    # When both fail for good
    for read in reads:
        with pytest.raises(StepFailedError):
            read.result(timeout=20)
    picture = run.wait(timeout=20)

    # Then one unwind ran: one chain, one reversal, the compensation started once
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert [(c.step, c.attempts) for c in picture.compensations] == [(1, 1)]
    time.sleep(1)  # a second chain, had one been sent, would have run by now
    # (The reversal concludes the run itself; a conclusion message goes only if it cannot.)
    concludes = [
        ln for ln in worker.log().splitlines() if "saga.conclude_unwind[" in ln and "received" in ln
    ]
    reversals = [
        ln for ln in worker.log().splitlines() if "tools.reverse_credit[" in ln and "received" in ln
    ]
    assert len(concludes) <= 1 and len(reversals) == 1
    check_invariants(env, picture)


def test_the_same_step_message_delivered_twice_credits_once(
    private: Callable[..., Private],
) -> None:
    # Given a credit step running (in a 1.5 s delay) on a worker with two pool processes
    env = private()
    worker = env.worker(concurrency=2)
    env.faults.delay("issue_credit", 1.5)
    run = env.saga.start_run()
    credit = call(run, CREDIT_CALL)
    task_id = f"{run.run_id}:1"
    wait_until(lambda: step_state(env, run.run_id, 1) == "running", 10, "the credit to start")
    message = {"run_id": run.run_id, "step": 1, "args": CREDIT_CALL[1]}

    # When the very same message is delivered again while it runs, and once more after
    env.saga.app.send_task("tools.issue_credit", kwargs=message, task_id=task_id)
    result = credit.result(timeout=20)
    wait_until(lambda: processed(worker, task_id, 2), 20, "both deliveries to finish")
    env.saga.app.send_task("tools.issue_credit", kwargs=message, task_id=task_id)
    wait_until(lambda: processed(worker, task_id, 3), 20, "the third delivery to finish")

    # Then there is one credit and one stack entry, and the run completes
    picture = run.finish(timeout=10)
    assert picture.state is RunState.COMPLETED
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert [e["args"] for e in picture.stack] == [{"credit_id": result["credit_id"]}]
    assert picture.step(1).result == result
    # The copy that came while the step ran found the first delivery's lease and was sent
    # back to wait; it and the late copy only replayed: the tool ran once.
    assert picture.step(1).attempts == 1
    check_invariants(env, picture)


def test_a_later_step_failing_before_the_earlier_push_lands_still_undoes_it(
    private: Callable[..., Private],
) -> None:
    # Given a slow credit (billing answers after 1.5 s) already running
    env = private()
    env.worker(concurrency=2)
    systems.set_delay("billing", 1.5)
    run = env.saga.start_run(on_failure={"get_order": "unwind"})  # a failed read unwinds
    credit = call(run, CREDIT_CALL)
    wait_until(lambda: step_state(env, run.run_id, 1) == "running", 10, "the credit to start")

    # When a read fails at once (no such order: not retryable) while the credit is in flight
    read = run.call("get_order", order_id=1)
    with pytest.raises(StepFailedError):
        read.result(timeout=10)
    assert env.saga.picture(run.run_id).state is RunState.UNWINDING
    assert credits_and_reversals(run.run_id) == (0, 0)  # the credit has not landed yet

    # Then the unwind waits for the credit's push and reverses it
    result = credit.result(timeout=20)
    picture = run.wait(timeout=20)
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert picture.compensations[0].entry["args"] == {"credit_id": result["credit_id"]}
    check_invariants(env, picture)


def test_a_crash_looping_step_before_its_effect_is_reconciled_as_not_happened(
    private: Callable[..., Private],
) -> None:
    # Given a ticket change done, then a credit whose every delivery dies before the effect
    env = private(max_redeliveries=0)  # a crash loop of 3 deaths, not 5: the same path
    env.worker(concurrency=1)
    run = env.saga.start_run()
    call(run, TICKET_CALL).result(timeout=10)
    cap = 3 + env.saga.settings.max_redeliveries  # QUICK.attempts + max_redeliveries
    rules = [env.faults.kill("before_effect", "issue_credit", nth=n) for n in range(1, cap + 1)]

    # When the credit is called
    credit = call(run, CREDIT_CALL)

    # Then after `cap` deaths the next delivery marks it in doubt, the lookup finds no credit,
    # and the run unwinds the ticket change and ends compensated
    with pytest.raises((StepFailedError, StepInDoubtError)):  # in doubt until reconciled
        credit.result(timeout=60)
    picture = run.wait(timeout=20)
    step = picture.step(2)
    assert step.state is StepState.FAILED and step.reconciled == "not_happened"
    assert step.attempts == cap + 1
    assert [env.faults.hits(r) for r in rules] == [cap] * cap  # every delivery reached the point
    assert picture.state is RunState.COMPENSATED and picture.doubt == ""
    assert credits_and_reversals(run.run_id) == (0, 0)
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


def test_a_crash_looping_step_after_its_effect_is_reconciled_as_happened_and_undone(
    private: Callable[..., Private],
) -> None:
    # Given a credit whose every delivery dies right after the effect
    env = private(max_redeliveries=0)  # a crash loop of 3 deaths, not 5: the same path
    env.worker(concurrency=1)
    run = env.saga.start_run()
    call(run, TICKET_CALL).result(timeout=10)
    cap = 3 + env.saga.settings.max_redeliveries
    for n in range(1, cap + 1):
        env.faults.kill("after_effect", "issue_credit", nth=n)

    # When the credit is called
    credit = call(run, CREDIT_CALL)

    # Then the lookup finds the credit (one, by its key): its undo is pushed and run
    picture = run.wait(timeout=60)
    step = picture.step(2)
    assert step.state is StepState.SUCCEEDED and step.reconciled == "happened"
    assert step.attempts == cap + 1
    assert credit.result(timeout=1)["amount_cents"] == CREDIT
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


def test_a_compensation_failing_three_times_then_succeeding_compensates(
    private: Callable[..., Private],
) -> None:
    # Given a reversal that fails 3 times (its policy allows 4 attempts), and the mail down
    env = private()
    env.worker(concurrency=1)
    env.faults.fail_compensation("reverse_credit", times=3)
    systems.set_down("mail")

    # When the run fails at the mail and unwinds
    run = env.saga.start_run()
    demo_steps(run)
    picture = run.wait(timeout=40)

    # Then the fourth attempt reverses the credit and the run ends compensated
    assert picture.state is RunState.COMPENSATED
    comps = {c.step: c for c in picture.compensations}
    assert comps[2].state is CompensationState.DONE and comps[2].attempts == 4
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


def test_a_compensation_that_always_fails_escalates_and_the_older_ones_still_run(
    private: Callable[..., Private],
) -> None:
    # Given a ticket change then a credit, a reversal that always fails, and the mail down
    env = private()
    env.worker(concurrency=1)
    env.faults.fail_compensation("reverse_credit", times=10)
    systems.set_down("mail")
    run = env.saga.start_run()
    for tool, args in (GET_ORDER, TICKET_CALL, CREDIT_CALL):
        run.call(tool, **args).result(timeout=10)

    # When the mail fails and the run unwinds
    with pytest.raises(StepFailedError):
        call(run, REPLY_CALL).result(timeout=20)
    picture = run.wait(timeout=40)

    # Then it escalates "compensation failed", the older ticket restore still ran, and the
    # escalation lists the failed reversal with its error and its 4 attempts
    assert picture.state is RunState.ESCALATED
    assert picture.reason == REASON_COMPENSATION_FAILED
    comps = {c.step: c for c in picture.compensations}
    assert comps[3].state is CompensationState.FAILED and comps[3].attempts == 4
    assert comps[2].state is CompensationState.DONE
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert credits_and_reversals(run.run_id) == (1, 0)
    [escalation] = env.saga.records.escalations(run.run_id)
    assert escalation.reason == REASON_COMPENSATION_FAILED
    [failed] = escalation.failed_compensations
    assert failed["step"] == 3 and failed["attempts"] == 4
    assert failed["error"]["type"] == "InjectedFaultError" and failed["error"]["attempt"] == 4
    assert [(e["step"], e["why"]) for e in escalation.not_undone] == [
        (3, "its compensation failed")
    ]
    check_invariants(env, picture)


def test_a_running_step_revoked_with_sigkill_ends_the_run_instead_of_hanging(
    private: Callable[..., Private],
) -> None:
    # Given a ticket change done, then a credit running (held in a 3 s delay)
    env = private()
    worker = env.worker(concurrency=1)
    env.faults.delay("issue_credit", 3)
    run = env.saga.start_run()
    call(run, TICKET_CALL).result(timeout=10)
    credit = call(run, CREDIT_CALL)
    wait_until(lambda: step_state(env, run.run_id, 2) == "running", 10, "the credit to start")

    # When the operator revokes it, terminating it with SIGKILL
    env.saga.app.control.revoke(f"{run.run_id}:2", terminate=True, signal="SIGKILL")

    # Then the step is in doubt, and its lookup waits for the delivery's lease to run out
    # (the request may already be on its way to billing)
    wait_until(lambda: step_state(env, run.run_id, 2) == "in_doubt", 10, "the revoke")
    assert env.saga.picture(run.run_id).step(2).reconciled == ""
    lease = env.saga.picture(run.run_id).step(2).lease
    assert lease is not None
    time.sleep(max(0.0, lease - env.saga.store.now()) + 0.2)
    # and the reaper's next pass finds no credit, so the run unwinds and ends
    assert [verdict for *_, verdict in env.saga.reap().in_doubt] == ["not_happened"]
    with pytest.raises((StepFailedError, StepInDoubtError)):
        credit.result(timeout=20)
    picture = run.wait(timeout=20)
    step = picture.step(2)
    assert step.state is StepState.FAILED and step.reconciled == "not_happened"
    assert "Revoked" in (step.error or {}).get("type", "")
    assert picture.state is RunState.COMPENSATED
    assert systems.get_ticket(TICKET)["status"] == "open"
    time.sleep(3.5)  # past the delay: the killed step must not come back and credit
    assert credits_and_reversals(run.run_id) == (0, 0)
    assert "Terminating" in worker.log() or "terminated" in worker.log().lower()
    check_invariants(env, picture)


def test_the_reaper_unwinds_a_run_the_agent_abandoned(private: Callable[..., Private]) -> None:
    # Given a run whose steps are done and that the agent never finishes (deadline 1 s)
    env = private(run_deadline=1)
    env.worker(concurrency=1)
    run = env.saga.start_run()
    demo_steps(run, upto=3)

    # When the reaper passes after the deadline
    time.sleep(1.5)
    report = env.saga.reap()

    # Then it aborts the run, which unwinds and ends compensated
    assert report.abandoned == [run.run_id]
    picture = run.wait(timeout=20)
    assert picture.state is RunState.COMPENSATED
    assert picture.reason.startswith("aborted: abandoned")
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


@pytest.mark.parametrize("effect_applied", [False, True], ids=["no-effect", "effect-applied"])
def test_the_reaper_reconciles_a_step_whose_outcome_was_lost(
    private: Callable[..., Private], effect_applied: bool
) -> None:
    # Given a run with a ticket change, and a credit step marked running with no worker
    # holding it (its outcome lost), its credit applied or not
    env = private(run_deadline=1)
    env.worker(concurrency=1)
    run = env.saga.start_run()
    call(run, TICKET_CALL).result(timeout=10)
    step = hand_reserve(env, run.run_id, *CREDIT_CALL)
    args_json = payload.dumps(CREDIT_CALL[1], what="args", limit=1 << 20)
    began = env.saga.store.begin_step(run.run_id, step, CREDIT_CALL[0], args_json, "gone", 2.5)
    assert began.status == "run"
    if effect_applied:
        key = step_idempotency_key(run.run_id, step)
        systems.issue_credit(ORDER, CREDIT, key, "late")

    # When the reaper passes after the deadline, and again once the delivery's lease ran out
    # (until then the step might still be running and its effect still land)
    time.sleep(1.5)
    assert env.saga.reap().in_doubt == []
    time.sleep(1.5)
    report = env.saga.reap(now=env.saga.store.now() + 2)

    # Then the step is reconciled by the lookup and the run unwinds what exists
    verdict = "happened" if effect_applied else "not_happened"
    assert report.in_doubt == [(run.run_id, step, verdict)]
    picture = run.wait(timeout=20)
    assert picture.step(step).reconciled == verdict
    assert picture.state is RunState.COMPENSATED
    assert credits_and_reversals(run.run_id) == ((1, 1) if effect_applied else (0, 0))
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


def test_the_reaper_takes_over_an_unwind_whose_owner_never_sent_it(
    private: Callable[..., Private],
) -> None:
    # Given a run with a credit, and a failure recorded whose owner died before sending the
    # unwind (state unwinding, owner set, sent=0)
    env = private(run_deadline=1)
    env.worker(concurrency=1)
    run = env.saga.start_run()
    call(run, CREDIT_CALL).result(timeout=10)
    step = hand_reserve(env, run.run_id, *GET_ORDER)
    args_json = payload.dumps(GET_ORDER[1], what="args", limit=1 << 20)
    env.saga.store.begin_step(run.run_id, step, GET_ORDER[0], args_json, "gone", 30.0)
    error = {"type": "ServiceUnavailableError", "message": "orders is down"}
    assert env.saga.store.record_failure(run.run_id, step, error).owns_unwind
    stalled = env.saga.picture(run.run_id)
    assert stalled.state is RunState.UNWINDING
    assert stalled.extra["owner"] == f"step:{step}" and stalled.extra["sent"] == "0"

    # When the reaper passes after the deadline
    time.sleep(1.5)
    report = env.saga.reap()

    # Then it takes the unwind over and the run ends compensated
    assert report.resumed == [run.run_id]
    picture = run.wait(timeout=20)
    assert picture.state is RunState.COMPENSATED
    assert picture.extra["owner"].startswith("reaper:") and picture.extra["sent"] == "1"
    assert credits_and_reversals(run.run_id) == (1, 1)
    check_invariants(env, picture)


def test_the_reaper_does_not_lose_the_effect_of_a_step_still_running(
    private: Callable[..., Private],
) -> None:
    # Given a credit step that runs longer than the run's deadline (1 s) on a live worker
    env = private(run_deadline=1)
    worker = env.worker(concurrency=1)
    env.faults.delay("issue_credit", 3)
    run = env.saga.start_run()
    call(run, CREDIT_CALL)
    wait_until(lambda: step_state(env, run.run_id, 1) == "running", 10, "the credit to start")

    # When the reaper passes while the step still runs: it leaves the step alone
    time.sleep(1.5)
    assert env.saga.reap().in_doubt == []
    wait_until(lambda: processed(worker, f"{run.run_id}:1"), 20, "the step to finish")

    # and when it passes again, the abandoned run is unwound with the credit that landed
    time.sleep(1.2)
    assert env.saga.reap().abandoned == [run.run_id]
    picture = run.wait(timeout=20)

    # Then its credit is either undone or the run is escalated with the credit listed live
    credits, reversals = credits_and_reversals(run.run_id)
    assert credits == 1
    escalated = picture.state is RunState.ESCALATED and any(
        e["step"] == 1 for e in env.saga.records.escalations(run.run_id)[0].not_undone
    )
    assert reversals == 1 or escalated


def revoke_the_running_reversal(env: Private) -> Run:
    """Ticket change, credit, the mail down: revoke (SIGKILL) the slow reversal mid-unwind."""
    env.worker(concurrency=2)
    systems.set_down("mail")
    systems.set_delay("reversal", 2)
    run = env.saga.start_run()
    for spec in (GET_ORDER, TICKET_CALL, CREDIT_CALL):
        call(run, spec).result(timeout=10)
    with pytest.raises(StepFailedError):
        call(run, REPLY_CALL).result(timeout=20)
    reversal = wait_until(
        lambda: next(
            (c for c in run.picture().compensations if c.step == 3 and c.state.value == "running"),
            None,
        ),
        10,
        "the reversal to start",
    )
    env.saga.app.control.revoke(reversal.task_id, terminate=True, signal="SIGKILL")
    return run


def test_a_revoked_running_compensation_still_lets_the_unwind_finish(
    private: Callable[..., Private],
) -> None:
    # Given an unwind whose running reversal (its first compensation) is revoked with SIGKILL
    env = private()
    run = revoke_the_running_reversal(env)

    # Then the older compensation still runs and the run ends escalated, listing the reversal
    picture = settle(run, 5)
    assert picture.state is RunState.ESCALATED, picture.state
    comps = {c.step: c for c in picture.compensations}
    assert comps[3].state is CompensationState.FAILED
    assert comps[2].state is CompensationState.DONE
    assert systems.get_ticket(TICKET)["status"] == "open"
    check_invariants(env, picture)


def test_a_revoked_compensation_can_be_run_again_by_the_reaper_or_a_requeue(
    private: Callable[..., Private],
) -> None:
    # Given an unwinding run whose running reversal was revoked with SIGKILL (deadline 1 s)
    env = private(run_deadline=1)
    run = revoke_the_running_reversal(env)
    systems.set_delay("reversal", 0)

    # When the reaper passes, and an operator requeues the failed compensations if it escalated
    time.sleep(1.5)
    env.saga.reap()
    picture = settle(run, 5)
    if picture.state is RunState.ESCALATED:
        env.saga.requeue_failed_compensations(run.run_id)
        picture = settle(run, 5)

    # Then the reversal runs after all and the run ends compensated
    assert picture.state is RunState.COMPENSATED, picture.state
    assert credits_and_reversals(run.run_id) == (1, 1)
    assert systems.get_ticket(TICKET)["status"] == "open"
