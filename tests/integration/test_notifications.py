"""Escalation notices end to end: a real worker configured with both sinks, a real HTTP
receiver in this process that checks every signature, and the notices' rows in SQL.

The module owns its Redis and worker (``deployment.py``): the worker's settings are the point.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from saga import RunState, StepFailedError
from saga.notifications import SCHEMA_VERSION, NoticeRecord, NoticeState, NotifySettings
from saga.notifications.notifier import SWEEP_GRACE
from saga.redis_urls import redis_client as client_of
from saga.testing import Faults
from tasks import systems
from tests.integration.deployment import Deployment, deployment
from tests.integration.helpers import CREDIT, EMAIL, ORDER, TICKET, wait_until
from tests.integration.notify_receiver import CALLABLE, SECRET, Receiver, called

pytestmark = pytest.mark.timeout(180)

ATTEMPTS = 3


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Deployment]:
    env = {
        "SAGA_NOTIFY_WEBHOOK_URL": receiver.url,
        "SAGA_NOTIFY_WEBHOOK_SECRET": SECRET,
        "SAGA_NOTIFY_CALLABLE": CALLABLE,
        "SAGA_NOTIFY_ATTEMPTS": str(ATTEMPTS),
        "SAGA_NOTIFY_BACKOFF": "0.2",
        "SAGA_NOTIFY_BACKOFF_MAX": "0.5",
        "SAGA_NOTIFY_TIMEOUT": "3",
    }
    with deployment(tmp_path_factory.mktemp("notify"), env) as made:
        yield made


@pytest.fixture
def saga(private: Deployment) -> Iterator[Any]:
    systems.reset()
    yield private.saga
    systems.clear_switches()
    if private.saga.faults is not None:
        Faults(private.saga.store.client).clear()


@pytest.fixture
def redis_client(private: Deployment) -> Iterator[redis.Redis]:
    client = client_of(private.env["SAGA_REDIS_URL"])
    yield client
    client.close()


def escalate_on_the_worker(saga: Any, run_id: str, wait: bool = True) -> str:
    """Credit, then a ticket update that fails, whose unwind's reversal fails for good: the
    worker concludes the run escalated ("compensation failed"). Returns the escalation id."""
    run = saga.start_run(run_id)
    run.call("get_order", order_id=ORDER).result(timeout=30)
    run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT).result(timeout=30)
    systems.set_down("tickets")
    systems.set_down("reversal")
    with pytest.raises(StepFailedError):
        run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=30)
    if wait:
        assert run.wait(timeout=60).state is RunState.ESCALATED
    return f"{run_id}:0"


def escalate_here(saga: Any, run_id: str) -> str:
    """Past the pivot (the mail went out), the agent aborts: this process concludes the run
    escalated and records it, so the notices are written and sent from here."""
    run = saga.start_run(run_id)
    run.call("get_order", order_id=ORDER).result(timeout=30)
    run.call("send_reply", to=EMAIL, subject="Your order", body="On its way.").result(timeout=30)
    run.abort("the customer called")
    assert run.wait(timeout=30).state is RunState.ESCALATED
    return f"{run_id}:0"


def notices(saga: Any, escalation_id: str) -> dict[str, NoticeRecord]:
    return {n.sink: n for n in saga.notifier.store.notices(escalation_id)}


def settled(saga: Any, escalation_id: str) -> dict[str, NoticeRecord] | None:
    found = notices(saga, escalation_id)
    done = len(found) == 2 and all(n.state != NoticeState.PENDING for n in found.values())
    return found if done else None


def test_an_escalated_run_sends_one_signed_post_with_its_escalation_id(
    saga: Any, private: Deployment, receiver: Receiver
) -> None:
    # Given a run whose unwind fails on the worker
    escalation_id = escalate_on_the_worker(saga, f"notify-{uuid.uuid4().hex[:8]}")

    # When its notices are delivered
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")

    # Then the receiver got exactly one POST, signed, naming the escalation, with the picture
    assert rows["webhook"].state == NoticeState.SENT
    assert rows["webhook"].detail == "HTTP 200"
    [post] = receiver.of(escalation_id)
    assert post.verified
    assert post.attempt == "1"
    assert post.body["schema_version"] == SCHEMA_VERSION
    assert post.body["id"] == post.body["escalation_id"] == escalation_id
    assert post.body["why"]["reason"] == "compensation failed"  # the escalation package
    assert [c["undo"]["tool"] for c in post.body["failed_compensations"]] == ["reverse_credit"]
    assert post.body["run"]["steps"] and post.body["commands"]["requeue"]
    # and a second message of the same notice (a redelivery) sends nothing more
    saga.notifier.send(escalation_id, "webhook")
    wait_until(
        lambda: f"notice {escalation_id} to webhook not sent: sent" in private.worker_log(),
        30,
        "the repeated notice to be dropped",
    )
    assert len(receiver.of(escalation_id)) == 1


def test_the_callable_sink_is_called_with_the_same_document(
    saga: Any, redis_client: redis.Redis, receiver: Receiver
) -> None:
    # Given an escalation recorded in this process (an abort past the pivot)
    escalation_id = escalate_here(saga, f"call-{uuid.uuid4().hex[:8]}")

    # When its notices are delivered by the worker
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")

    # Then the configured function got the body once, the same one the webhook got
    assert rows["callable"].state == NoticeState.SENT
    [body] = called(redis_client, escalation_id)
    assert body["why"]["reason"] == "failed after an irreversible step"
    assert body == receiver.of(escalation_id)[0].body


def test_a_receiver_that_fails_twice_gets_the_notice_on_the_third_attempt(
    saga: Any, receiver: Receiver
) -> None:
    # Given a receiver that answers 500 twice before it works
    run_id = f"retry-{uuid.uuid4().hex[:8]}"
    receiver.script(run_id, [500, 503])

    # When a run escalates
    escalation_id = escalate_on_the_worker(saga, run_id)

    # Then the notice is delivered on the third attempt, each attempt signed, one notice id
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")
    assert rows["webhook"].state == NoticeState.SENT
    assert rows["webhook"].attempts == 3
    posts = receiver.of(escalation_id)
    assert [(p.attempt, p.answered) for p in posts] == [("1", 500), ("2", 503), ("3", 200)]
    assert all(p.verified for p in posts)


def test_a_receiver_always_down_has_the_failure_recorded(
    saga: Any, private: Deployment, receiver: Receiver, redis_client: redis.Redis
) -> None:
    # Given a receiver that always answers 503
    run_id = f"down-{uuid.uuid4().hex[:8]}"
    receiver.always(run_id, 503)

    # When a run escalates
    escalation_id = escalate_on_the_worker(saga, run_id)

    # Then after its attempts the webhook's notice is recorded failed, loudly
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")
    assert rows["webhook"].state == NoticeState.FAILED
    assert rows["webhook"].attempts == ATTEMPTS
    assert rows["webhook"].detail == "the webhook answered HTTP 503"
    assert len(receiver.of(escalation_id)) == ATTEMPTS
    failure = f"notice of escalation {escalation_id} to the webhook sink FAILED"
    assert failure in private.worker_log()
    failed = saga.notifier.store.notices(state=NoticeState.FAILED)
    assert (escalation_id, "webhook") in {(n.escalation_id, n.sink) for n in failed}
    # while the other sink still got it
    assert rows["callable"].state == NoticeState.SENT
    assert len(called(redis_client, escalation_id)) == 1


def test_a_notice_whose_publish_was_refused_is_sent_by_the_reaper(
    saga: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an escalation whose notices were written but never got onto the broker
    monkeypatch.setattr(saga.notifier, "send", lambda escalation_id, sink: False)
    escalation_id = escalate_here(saga, f"sweep-{uuid.uuid4().hex[:8]}")
    monkeypatch.undo()
    assert {n.state for n in notices(saga, escalation_id).values()} == {NoticeState.PENDING}

    # When the reaper passes once they are due
    report = saga.reap(now=saga.store.now() + SWEEP_GRACE + 1)

    # Then it sends them, and they are delivered once
    assert f"{escalation_id}:notify:webhook" in report.notices
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")
    assert {n.state for n in rows.values()} == {NoticeState.SENT}
    assert len(receiver.of(escalation_id)) == 1


def test_an_escalation_recorded_where_no_sink_was_set_is_announced_by_the_reaper(
    saga: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an escalation recorded by a process whose environment set no sink
    monkeypatch.setattr(saga, "settings", replace(saga.settings, notifications=NotifySettings()))
    escalation_id = escalate_here(saga, f"unset-{uuid.uuid4().hex[:8]}")
    monkeypatch.undo()
    assert notices(saga, escalation_id) == {}

    # When the reaper passes (where the sinks are set)
    report = saga.reap()

    # Then the escalation's notices are written and delivered
    assert f"{escalation_id}:notify:webhook" in report.notices
    rows = wait_until(lambda: settled(saga, escalation_id), 60, "the notices to settle")
    assert {n.state for n in rows.values()} == {NoticeState.SENT}
    assert len(receiver.of(escalation_id)) == 1


def test_a_worker_killed_after_recording_the_escalation_still_sends_the_notice(
    saga: Any, private: Deployment, receiver: Receiver
) -> None:
    # Given a worker that dies (the whole of it) right after writing an escalation's row
    assert saga.faults is not None
    Faults(saga.store.client).kill("after_escalation_recorded", whole_worker=True)
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    escalation_id = escalate_on_the_worker(saga, run_id, wait=False)
    first = private.worker
    wait_until(lambda: first.process is not None and first.process.poll() is not None, 60)
    first.kill()
    assert [e.escalation_id for e in saga.records.escalations(run_id)] == [escalation_id]
    assert notices(saga, escalation_id) == {}
    assert not saga.picture(run_id).recorded

    # When a worker runs again (the conclusion's message comes back to it)
    private.start_worker()

    # Then the run is recorded and the notice sent, once
    rows = wait_until(lambda: settled(saga, escalation_id), 90, "the notices to settle")
    assert {n.state for n in rows.values()} == {NoticeState.SENT}
    assert saga.picture(run_id).recorded
    [post] = receiver.of(escalation_id)
    assert post.verified
