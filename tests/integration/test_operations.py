"""A person's side of an escalation, end to end: real Redis, real Celery workers, the demo's
three systems. Requeue (with corrections, two at once, after the run's keys expired) and
resolve (then requeue refused), each failure injected in the systems themselves.

The expiry tests run on a worker of their own with a retention of 2 s, on a Redis database of
their own, sharing the demo's systems and records database with the session's worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.exc import OperationalError

from saga import (
    EscalationResolvedError,
    InvalidCorrectionError,
    NothingToRequeueError,
    OperationRefusedError,
    RunState,
    Saga,
    Settings,
    StepFailedError,
    UnknownEscalationError,
    UnknownRunError,
)
from saga.constants import run_keys
from saga.redis_urls import kombu_url, redis_client, sentinel_transport_options
from saga.testing import WorkerProcess
from tasks import systems
from tasks.tools import tools
from tests.conftest import MACHINE_REDIS, ROOT, TEST_DB, TEST_STORE, redis_url_with_db
from tests.integration.engine_harness import Harness, harness
from tests.integration.helpers import CREDIT, EMAIL, ORDER, TICKET, demo_steps, wait_until

pytestmark = pytest.mark.timeout(240)

#: The ticket's number after the helpdesk migration that breaks its captured undo.
MOVED = 9105
#: The Redis database the expiry tests' worker and client own (flushed before and after).
EXPIRY_DB = int(os.environ.get("SAGA_TEST_EXPIRY_REDIS_DB", str(TEST_DB + 1)))
RETENTION = 2


def credits_and_reversals() -> tuple[list[int], list[int]]:
    entries = systems.ledger(ORDER)
    return (
        [e["amount_cents"] for e in entries if e["kind"] == "credit"],
        [e["amount_cents"] for e in entries if e["kind"] == "reversal"],
    )


def reversal_keys() -> list[str]:
    return [e["idempotency_key"] for e in systems.ledger(ORDER) if e["kind"] == "reversal"]


def settled(saga: Saga, run_id: str, state: RunState, generation: int = 0) -> Any:
    """Wait until the run ended in ``state`` at ``generation`` and its record is written."""
    record = wait_until(
        lambda: (
            (r := saga.records.run(run_id)) is not None
            and r.state == state.value
            and r.generation == generation
            and r
        ),
        timeout=60,
        what=f"run {run_id} recorded {state.value} at generation {generation}",
    )
    return record


def escalate_with_the_reversal_down(saga: Saga) -> str:
    """A credit issued, the run aborted, its reversal failing for good: escalated."""
    run = saga.start_run()
    demo_steps(run, upto=2)
    systems.set_down("reversal")
    run.abort("the customer cancelled")
    settled(saga, run.run_id, RunState.ESCALATED)
    return run.run_id


def at_once(count: int, call: Callable[[], Any]) -> list[Any]:
    """What each of ``count`` threads got from ``call``, started together: a value or the error."""
    start = threading.Barrier(count)
    outcomes: list[Any] = []

    def one() -> None:
        start.wait(timeout=30)
        try:
            outcomes.append(call())
        except Exception as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


# -- requeue ------------------------------------------------------------------------------


def test_an_undo_that_fails_until_corrected_is_requeued_with_the_correction(saga: Saga) -> None:
    """The ticket moved to a new number, so restoring its status fails: a plain requeue fails
    again (the second escalation supersedes the first), bad corrections are refused before
    anything runs, and the corrected one restores the moved ticket under the same key."""
    # Given three steps done, then the ticket renumbered and the mail down
    run = saga.start_run()
    demo_steps(run, upto=3)
    systems.renumber_ticket(TICKET, MOVED)
    systems.set_down("mail")
    with pytest.raises(StepFailedError):
        run.call("send_reply", to=EMAIL, subject="s", body="b").result(timeout=30)
    settled(saga, run.run_id, RunState.ESCALATED)
    [failed] = saga.records.escalations(run.run_id)[0].failed_compensations
    assert failed["step"] == 3 and f"ticket {TICKET} not found" in failed["error"]["message"]
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])  # the older undo still ran

    # When it is requeued as it is, it fails again: one open escalation, the newer
    assert saga.requeue_failed_compensations(run.run_id, by="alice") == 1
    settled(saga, run.run_id, RunState.ESCALATED, generation=1)
    rows = {e.escalation_id: (e.resolved, e.resolution) for e in saga.records.escalations()}
    assert {k: v for k, v in rows.items() if k.startswith(run.run_id)} == {
        f"{run.run_id}:0": (True, f"superseded by {run.run_id}:1"),
        f"{run.run_id}:1": (False, ""),
    }

    # When corrections its tool refuses, or for an undo that is not failed, are given
    before = run.picture()
    refused = [
        ({3: {"ticket_id": str(MOVED)}}, "alice", "ticket_id"),  # strict: a string is no int
        ({3: {"queue": "vip"}}, "alice", "queue"),  # no such argument
        ({2: {"credit_id": "cr_1"}}, "alice", "step 2 .*its undo is done"),
        ({7: {"ticket_id": MOVED}}, "alice", "step 7 .*no undo"),
        ({3: {"ticket_id": MOVED}}, "", "who corrects"),
    ]
    for corrections, by, why in refused:
        with pytest.raises(InvalidCorrectionError, match=why):
            saga.requeue_failed_compensations(run.run_id, corrections=corrections, by=by)
    # Then nothing ran and nothing changed
    assert run.picture().version == before.version
    assert systems.get_ticket(MOVED)["status"] == "pending_refund"

    # When the right correction is made
    count = saga.requeue_failed_compensations(
        run.run_id, corrections={3: {"ticket_id": MOVED}}, by="alice"
    )

    # Then the moved ticket is restored, under the undo's original idempotency key
    assert count == 1
    settled(saga, run.run_id, RunState.COMPENSATED, generation=2)
    assert systems.get_ticket(MOVED)["status"] == "open"
    restore = systems.ticket_history(MOVED)[-1]
    assert (restore["to_status"], restore["idempotency_key"]) == ("open", f"{run.run_id}:3:undo")
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    # and the record says who changed what, and closed the escalation with the reason
    requeues = saga.records.actions(run.run_id)
    assert [(a.kind, a.by, a.escalation_id) for a in requeues] == [
        ("requeue", "alice", f"{run.run_id}:0"),
        ("requeue", "alice", f"{run.run_id}:1"),
    ]
    assert requeues[0].corrections == {}
    assert requeues[1].corrections == {
        "3": {
            "before": {"ticket_id": TICKET, "status": "open"},
            "after": {"ticket_id": MOVED, "status": "open"},
        }
    }
    latest = saga.records.escalation(f"{run.run_id}:1")
    assert latest is not None
    assert (latest.resolved, latest.resolution) == (True, "compensated after requeue by alice")
    undo = {c.step: c for c in saga.records.compensations(run.run_id)}[3]
    assert (undo.state, undo.entry["args"]["ticket_id"], len(undo.history)) == ("done", MOVED, 2)
    assert undo.entry["idempotency_key"] == f"{run.run_id}:3:undo"


def test_two_requeues_at_once_run_the_undo_once(saga: Saga) -> None:
    """Both operators press requeue: one sends the undo, the other is told there is nothing
    to requeue; the credit is reversed once, under its original key, with a fresh budget."""
    run_id = escalate_with_the_reversal_down(saga)
    systems.set_down("reversal", False)

    outcomes = at_once(2, lambda: saga.requeue_failed_compensations(run_id, by="ops"))

    assert sorted(type(o).__name__ for o in outcomes) == ["NothingToRequeueError", "int"]
    assert 1 in outcomes
    settled(saga, run_id, RunState.COMPENSATED, generation=1)
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    assert reversal_keys() == [f"{run_id}:2:undo"]
    [undo] = saga.picture(run_id).compensations
    assert (undo.attempts - undo.round_start, len(undo.history)) == (1, 1)


# -- resolve ------------------------------------------------------------------------------


def test_a_resolved_escalation_refuses_a_requeue(saga: Saga) -> None:
    """ "Refunded by phone": recorded with who and when; the run then takes no requeue and the
    escalation no second resolve."""
    # Given a run escalated because its reversal kept failing
    run_id = escalate_with_the_reversal_down(saga)
    systems.set_down("reversal", False)

    # When a person resolves it
    record = saga.resolve_escalation(f"{run_id}:0", note="refunded by phone", by="dana")

    # Then it is closed with the note, who and when, and the action is recorded
    assert (record.resolved, record.resolution, record.resolved_by) == (
        True,
        "refunded by phone",
        "dana",
    )
    assert record.resolved_at is not None
    [action] = saga.records.actions(run_id)
    assert (action.kind, action.by, action.note) == ("resolve", "dana", "refunded by phone")
    assert saga.records.escalations(run_id, open_only=True) == []
    # and a requeue is refused, as is a second resolve; nothing was reversed
    with pytest.raises(EscalationResolvedError, match="refunded by phone"):
        saga.requeue_failed_compensations(run_id, by="erin")
    with pytest.raises(EscalationResolvedError, match="dana"):
        saga.resolve_escalation(f"{run_id}:0", note="again", by="erin")
    assert credits_and_reversals() == ([CREDIT], [])
    assert saga.picture(run_id).state is RunState.ESCALATED


def test_resolving_what_is_not_an_open_escalation_is_refused(saga: Saga) -> None:
    """An unknown id, a run that never escalated, a resolve without a note or a name."""
    run = saga.start_run()
    demo_steps(run, upto=1)
    run.finish(timeout=30)

    with pytest.raises(UnknownEscalationError):
        saga.resolve_escalation("no-such-run:0", note="n", by="b")
    with pytest.raises(UnknownEscalationError):
        saga.resolve_escalation(f"{run.run_id}:0", note="n", by="b")
    with pytest.raises(OperationRefusedError, match="note"):
        saga.resolve_escalation(f"{run.run_id}:0", note=" ", by="b")
    with pytest.raises(UnknownRunError):
        saga.requeue_failed_compensations("no-such-run", by="b")
    with pytest.raises(NothingToRequeueError, match="completed"):
        saga.requeue_failed_compensations(run.run_id, by="b")


def test_a_resolve_while_a_requeue_unwinds_waits_for_it(saga: Saga) -> None:
    """While the requeued undo runs, a resolve is refused as retryable; once the run is
    compensated the escalation is closed already."""
    run_id = escalate_with_the_reversal_down(saga)
    systems.set_down("reversal", False)
    systems.set_delay("reversal", 3.0)
    assert saga.requeue_failed_compensations(run_id, by="ops") == 1

    with pytest.raises(OperationRefusedError, match="unwinding") as refused:
        saga.resolve_escalation(f"{run_id}:0", note="refunded by phone", by="dana")
    assert refused.value.retryable

    settled(saga, run_id, RunState.COMPENSATED, generation=1)
    with pytest.raises(EscalationResolvedError, match="compensated after requeue by ops"):
        saga.resolve_escalation(f"{run_id}:0", note="refunded by phone", by="dana")
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])


# -- after the keys expired ---------------------------------------------------------------


@pytest.fixture(scope="module")
def expiring(saga_env: dict[str, str], worker: Any) -> Iterator[Saga]:
    """A Saga whose runs' keys expire 2 s after they are recorded, with a worker of its own."""
    url = redis_url_with_db(saga_env["SAGA_REDIS_URL"], EXPIRY_DB)
    # The broker and results on the same database (kombu's spelling on a Sentinel store); on
    # a cluster (one database, shared with the session: not flushed) a database of the
    # machine's Redis of their own.
    broker = kombu_url(url)
    if TEST_STORE == "cluster":
        broker = redis_url_with_db(MACHINE_REDIS, EXPIRY_DB)
        client = redis_client(broker)
    else:
        client = redis_client(url)
    client.flushdb()
    overrides = {"SAGA_BROKER_URL": broker, "SAGA_RESULT_BACKEND": broker, "SAGA_REDIS_URL": url}
    env = {**saga_env, **overrides, "SAGA_RETENTION_SECONDS": str(RETENTION)}
    process = WorkerProcess("tasks.app", env=env, concurrency=1, cwd=ROOT).start(timeout=120)
    app = Celery("expiring", set_as_current=False)
    transport = sentinel_transport_options(url, broker)
    app.conf.update(
        broker_url=broker,
        result_backend=broker,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
    )
    settings = Settings(
        redis_url=url, database_url=saga_env["SAGA_DATABASE_URL"], retention_seconds=RETENTION
    )
    made = Saga(app, tools, settings=settings)
    try:
        yield made
    finally:
        process.stop()
        made.store.client.close()
        made.records.dispose()
        client.flushdb()
        client.close()


def expired(saga: Saga, run_id: str) -> None:
    wait_until(
        lambda: saga.store.client.exists(*run_keys(run_id)) == 0,
        timeout=60,
        what=f"run {run_id}'s keys to expire",
    )


def test_a_requeue_after_the_keys_expired_rebuilds_the_run_from_its_record(
    saga: Saga, expiring: Saga
) -> None:
    """Past the retention period only SQL knows the run: two requeues at once rebuild it once
    and run its undo once, under the original key; the record ends compensated."""
    # Given an escalated run whose keys have expired
    run_id = escalate_with_the_reversal_down(expiring)
    expired(expiring, run_id)
    systems.set_down("reversal", False)

    # When two operators requeue it at once
    outcomes = at_once(2, lambda: expiring.requeue_failed_compensations(run_id, by="erin"))

    # Then one requeued it, the other was told there was nothing to requeue
    assert sorted(type(o).__name__ for o in outcomes) == ["NothingToRequeueError", "int"]
    assert 1 in outcomes
    settled(expiring, run_id, RunState.COMPENSATED, generation=1)
    assert credits_and_reversals() == ([CREDIT], [-CREDIT])
    assert reversal_keys() == [f"{run_id}:2:undo"]
    [escalation] = expiring.records.escalations(run_id)
    assert (escalation.resolved, escalation.resolution) == (
        True,
        "compensated after requeue by erin",
    )
    assert [(a.kind, a.by) for a in expiring.records.actions(run_id)] == [("requeue", "erin")]
    expired(expiring, run_id)  # recorded, so the rebuilt keys expire again
    with pytest.raises(NothingToRequeueError, match="compensated"):
        expiring.requeue_failed_compensations(run_id, by="erin")


def test_a_resolve_after_the_keys_expired_refuses_every_later_requeue(
    saga: Saga, expiring: Saga
) -> None:
    """Resolved from the record alone, then requeued: refused while the rebuilt keys last, and
    from SQL once they have expired again."""
    run_id = escalate_with_the_reversal_down(expiring)
    expired(expiring, run_id)
    systems.set_down("reversal", False)

    record = expiring.resolve_escalation(f"{run_id}:0", note="refunded by phone", by="frank")

    assert (record.resolved, record.resolved_by, record.resolution) == (
        True,
        "frank",
        "refunded by phone",
    )
    with pytest.raises(EscalationResolvedError, match="refunded by phone"):
        expiring.requeue_failed_compensations(run_id, by="gus")
    expired(expiring, run_id)
    with pytest.raises(EscalationResolvedError, match="frank"):
        expiring.requeue_failed_compensations(run_id, by="gus")
    assert credits_and_reversals() == ([CREDIT], [])
    assert [(a.kind, a.by) for a in expiring.records.actions(run_id)] == [("resolve", "frank")]


# -- interleavings, on the engine driven by hand ------------------------------------------


@pytest.fixture
def h(redis_url: str, tmp_path: Path) -> Iterator[Harness]:
    yield from harness(redis_url, tmp_path)


def escalated_credit(h: Harness) -> str:
    """A credit issued, the run aborted, its reversal failing for good: escalated."""
    run_id = h.start()
    step = h.saga.dispatch(run_id, "issue_credit", {"amount": 100}).step
    h.deliver(h.take("tools.issue_credit", run_id=run_id, step=step))
    h.world.failing_reversals = 100
    h.saga.abort(run_id, "cancelled")
    h.drain()
    assert h.saga.picture(run_id).state is RunState.ESCALATED
    h.world.failing_reversals = 0
    return run_id


def test_a_run_that_moves_under_a_correction_is_read_again(h: Harness) -> None:
    """The corrections were made from a version the run has left: read again, then applied."""
    run_id = escalated_credit(h)
    store, real = h.saga.store, h.saga.store.requeue
    moved = {"left": 1}

    def moving(*args: Any) -> Any:
        if moved["left"]:
            moved["left"] -= 1
            store.client.hincrby(run_keys(run_id)[0], "version", 1)  # e.g. a late effect
        return real(*args)

    store.requeue = moving  # type: ignore[method-assign]
    fix = {1: {"credit_id": "cr-rebooked"}}
    assert h.saga.requeue_failed_compensations(run_id, corrections=fix, by="ops") == 1
    h.drain()
    assert moved["left"] == 0
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    [undo] = h.saga.picture(run_id).compensations
    assert undo.entry["args"] == {"credit_id": "cr-rebooked"}


def test_a_resolve_whose_record_cannot_be_written_is_recorded_by_the_reaper(h: Harness) -> None:
    """The database is away as the person resolves: the resolve holds (requeue refused), the
    caller is told, and the reaper writes the record once the database answers."""
    run_id = escalated_credit(h)
    records, real = h.saga.records, h.saga.records.record_outcome

    def down(*_: Any) -> None:
        raise OperationalError("INSERT", {}, Exception("database is down"))

    records.record_outcome = down  # type: ignore[method-assign]
    with pytest.raises(OperationalError):
        h.saga.resolve_escalation(f"{run_id}:0", note="refunded by phone", by="dana")
    with pytest.raises(EscalationResolvedError):
        h.saga.requeue_failed_compensations(run_id, by="erin")
    assert records.escalations(run_id, open_only=True) != []

    records.record_outcome = real  # type: ignore[method-assign]
    report = h.saga.reap(now=h.saga.store.now() + 3600)
    assert report.recorded == [run_id]
    [escalation] = records.escalations(run_id)
    assert (escalation.resolved, escalation.resolved_by) == (True, "dana")
    assert [a.kind for a in records.actions(run_id)] == ["resolve"]
