"""The split topology: the store on a durable Redis, the broker on one without persistence.

A broker that restarts empty loses every queued message. The store remembers every step's
call and every unwind, so the reaper sends what was lost again: a step no delivery began (at
its run's deadline, once), an unwind's chain (by taking the unwind over). These tests kill the
broker's Redis with messages queued and see every run end as if nothing had happened, each
effect applied once (docs/deployment.md, "The broker on a Redis of its own").
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from saga import RunState, StepState
from tasks import systems
from tests.integration.helpers import CREDIT, ORDER, wait_until
from tests.reliability.conftest import Private

pytestmark = pytest.mark.timeout(120)


def ledger(kind: str) -> list[str]:
    return [e["idempotency_key"] for e in systems.ledger(ORDER) if e["kind"] == kind]


def broker_queue(env: Private) -> int:
    assert env.broker is not None
    client = redis.Redis.from_url(env.broker.url, decode_responses=True)
    try:
        return int(client.llen("celery")) + int(client.hlen("unacked"))
    finally:
        client.close()


def queued_ids(env: Private) -> list[str]:
    """The task ids of the messages queued on the broker."""
    assert env.broker is not None
    client = redis.Redis.from_url(env.broker.url, decode_responses=True)
    try:
        return [json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1)]
    finally:
        client.close()


def reap_until(env: Private, field: str, wanted: set[Any], timeout: float = 30) -> set[Any]:
    """Reaper passes until the report's ``field`` has named everything ``wanted``."""
    seen: set[Any] = set()

    def named() -> bool:
        seen.update(getattr(env.saga.reap(), field))
        return wanted <= seen

    wait_until(named, timeout=timeout, what=f"the reaper's {field}")
    return seen


def test_steps_whose_messages_the_broker_lost_are_sent_again_and_run_once(
    private: Any,
) -> None:
    """Steps queued when the broker restarted empty are sent again and run, each once."""
    env: Private = private(run_deadline=2, broker=True)
    # Given three runs whose credit is queued, no worker having taken it yet
    runs = [env.saga.start_run() for _ in range(3)]
    held = [
        run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo=f"lost {i}")
        for i, run in enumerate(runs)
    ]
    assert broker_queue(env) == 3
    # When the broker's Redis dies and comes back empty
    env.restart_broker()
    assert broker_queue(env) == 0
    assert all(handle.state() is StepState.DISPATCHED for handle in held)
    env.worker()
    # Then the reaper sends each step again from the store once the run's deadline passed
    resent = reap_until(env, "resent", {(h.run_id, h.step) for h in held})
    assert resent == {(h.run_id, h.step) for h in held}
    # And each credit is issued once, and every run completes
    for handle in held:
        assert handle.result(timeout=30)["credit_id"]
    for run in runs:
        assert run.finish(timeout=30).state is RunState.COMPLETED
    assert sorted(ledger("credit")) == sorted(h.idempotency_key for h in held)
    assert ledger("reversal") == []


def test_a_step_sent_again_whose_first_message_arrives_runs_once(private: Any) -> None:
    """The re-send of a step whose message was only slow: two copies, one effect."""
    env: Private = private(run_deadline=1, broker=True)
    # Given a credit queued past its run's deadline (no worker yet), sent again by the reaper
    run = env.saga.start_run()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="slow")
    assert reap_until(env, "resent", {(run.run_id, handle.step)})
    assert queued_ids(env) == [f"{run.run_id}:{handle.step}"] * 2
    # When a worker takes both copies
    env.worker()
    assert handle.result(timeout=30)["credit_id"]
    wait_until(lambda: broker_queue(env) == 0, timeout=30, what="both copies delivered")
    # Then the credit is issued once, and the run completes with it
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert ledger("credit") == [handle.idempotency_key]


def test_a_step_no_worker_takes_is_judged_never_started_a_deadline_after_its_resend(
    private: Any,
) -> None:
    """Sent again once, and still not begun: never started, and the run unwinds."""
    env: Private = private(run_deadline=1, broker=True)
    # Given a credit whose queue nobody consumes (no worker at all), sent again once
    run = env.saga.start_run()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="nobody")
    assert reap_until(env, "resent", {(run.run_id, handle.step)})
    # Then a deadline later it is judged never started (not sent a third time)
    assert reap_until(env, "never_started", {(run.run_id, handle.step)})
    assert queued_ids(env).count(f"{run.run_id}:{handle.step}") == 2
    # And once a worker comes, the run's unwind ends it and neither copy runs the step
    env.worker()
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    wait_until(lambda: broker_queue(env) == 0, timeout=30, what="both copies delivered")
    assert handle.state() is StepState.FAILED
    assert ledger("credit") == []


def test_an_unwind_whose_chain_the_broker_lost_is_taken_over_and_ends(private: Any) -> None:
    """An abort's chain of undos, lost with the broker, is sent again by the reaper."""
    env: Private = private(run_deadline=2, broker=True)
    worker = env.worker()
    # Given a run whose credit is issued
    run = env.saga.start_run()
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="undo me")
    assert credit.result(timeout=30)["credit_id"]
    # When it is aborted while no worker runs, and the broker loses the chain of undos
    worker.stop()
    run.abort("the agent gave up")
    assert broker_queue(env) > 0
    env.restart_broker()
    assert broker_queue(env) == 0
    env.worker()
    # Then the reaper takes the unwind over at the deadline, and the credit is reversed once
    assert reap_until(env, "resumed", {run.run_id}) == {run.run_id}
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert ledger("credit") == [credit.idempotency_key]
    assert ledger("reversal") == [f"{credit.idempotency_key}:undo"]


def test_a_resend_the_broker_refuses_does_not_count_and_is_tried_at_the_next_pass(
    private: Any,
) -> None:
    """The broker away at the reaper's send: the run waits (not escalated) and the next pass
    sends it; the refused try does not use the step's one resend up."""
    env: Private = private(run_deadline=1, broker=True)
    run = env.saga.start_run()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="refused")
    env.restart_broker()
    assert env.broker is not None
    # Given the broker away when the reaper sends the step again
    env.broker.kill()
    idle = lambda: env.saga.store.now() - run.picture().updated  # noqa: E731
    wait_until(lambda: idle() > 1.2, timeout=10, what="the run's deadline")
    report = env.saga.reap()
    # Then the pass names the run as waiting for the broker, and escalates nothing
    assert report.resent == [] and report.never_started == []
    assert [run_id for run_id, _ in report.broken] == [run.run_id]
    assert "OperationalError" in report.broken[0][1]
    assert env.saga.records.escalations(run.run_id, open_only=True) == []
    # When the broker is back, the next pass sends it, and a worker runs it once
    env.broker.start()
    assert reap_until(env, "resent", {(run.run_id, handle.step)})
    env.worker()
    assert handle.result(timeout=30)["credit_id"]
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert ledger("credit") == [handle.idempotency_key]


def test_a_retry_whose_message_was_lost_is_sent_again_and_runs(
    private: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose attempt failed and whose retry message the broker lost (waiting out its
    countdown when the broker restarted) is sent again, and its next attempt runs."""
    env: Private = private(run_deadline=1, broker=True)
    store = env.saga.store
    # Given a credit whose first attempt failed retryably, its retry's message lost
    run = env.saga.start_run()
    with monkeypatch.context() as patch:
        patch.setattr(env.saga.app, "send_task", lambda name, **kw: None)
        handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="retry")
    args = json.dumps(run.picture().step(handle.step).args, separators=(",", ":"))
    began = store.begin_step(run.run_id, handle.step, "issue_credit", args, "lost/1", 5.0)
    assert began.status == "run"
    error = {"type": "ConnectionError", "message": "the ledger timed out", "attempt": 1}
    assert store.record_retry(run.run_id, handle.step, error, 0.2).status == "ok"
    assert handle.state() is StepState.RUNNING
    # When the reaper finds it past the run's deadline, its lease run out and no delivery on it
    assert reap_until(env, "resent", {(run.run_id, handle.step)})
    env.worker()
    # Then its second attempt runs, and the credit is issued once
    assert handle.result(timeout=30)["credit_id"]
    assert run.picture().step(handle.step).attempts == 2
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert ledger("credit") == [handle.idempotency_key]


def test_a_worker_whose_broker_restarts_mid_task_stays_up_and_finishes_it(private: Any) -> None:
    """The broker restarted empty while a worker runs a step: the worker reconnects (it does
    not exit), the step's outcome is recorded, and the run completes with its effect once."""
    env: Private = private(broker=True)
    # (Two pool processes: while one runs the step, the worker waits on the queue (BRPOP) for
    # the other, which is when a broker connection lost tripped kombu's close path.)
    worker = env.worker(concurrency=2)
    env.faults.delay("issue_credit", 3.0)
    # Given a worker running a credit (its message delivered, not yet acknowledged)
    run = env.saga.start_run()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="mid-task")
    wait_until(lambda: handle.state() is StepState.RUNNING, timeout=15, what="the step began")
    # When the broker's Redis dies under it, stays away a moment, and comes back empty
    assert env.broker is not None
    env.broker.kill()
    time.sleep(1.5)
    env.broker.start()
    # Then the worker stays up, records the step, and takes the next one from the new broker
    assert handle.result(timeout=30)["credit_id"]
    then = run.call("get_order", order_id=ORDER)
    assert then.result(timeout=30)
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log()
    assert ledger("credit") == [handle.idempotency_key]
