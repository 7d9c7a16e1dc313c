"""A request applied whose message the broker refused: the answer says what stands (202
``not_sent``, the run id in a field; ``MessageNotSentError`` in Python), and the same request
again converges on it: one run, one credit, one decision, one unwind.

The broker that refuses is a second ``redis-server`` of the test's own: for a create it is
down when the request comes, then started with workers of its own, as a broker that comes
back; for the actions on a run already going (approve, deny, abort, requeue) the server that
refuses is one whose broker is down, and the retry goes through the deployment's, which is up.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient

from saga import RunState, Saga, Settings
from saga.client import Client
from saga.errors import MessageNotSentError
from saga.testing import RedisServer, WorkerProcess
from saga.web import create_app
from saga.web.settings import WebSettings
from tasks import agents, systems
from tasks.tools import tools
from tests.conftest import ROOT
from tests.integration.helpers import wait_until
from tests.integration.test_operations import at_once
from tests.integration.web.conftest import Web, login_value

INPUT = "Order 4921 arrived late."


@dataclass
class Refusing:
    """The web app, ``saga.client`` and a ``Saga``, all over the deployment's Redis and
    records but a broker of their own (``broker``, not started: down)."""

    broker: RedisServer
    client: Client
    saga: Saga
    http: TestClient


@pytest.fixture
def refusing(web: Web, tmp_path: Path) -> Iterator[Refusing]:
    broker = RedisServer(directory=tmp_path / "broker")
    url = broker.url + "/0"
    client = Client(broker_url=url, redis_url=web.env["SAGA_REDIS_URL"])
    app = Celery("refusing-broker", set_as_current=False)
    app.config_from_object("celeryconfig")
    app.conf.update(broker_url=url)
    settings = Settings(redis_url=web.env["SAGA_REDIS_URL"], database_url=web.database_url)
    saga = Saga(app, tools, settings)
    agents.declare(saga)
    served = create_app(client=client, records=web.saga.records, saga=saga, settings=WebSettings())
    http = TestClient(
        served,
        base_url="https://testserver",
        headers={"Authorization": f"Bearer {web.operate_token}"},
    )
    try:
        yield Refusing(broker, client, saga, http)
    finally:
        broker.stop()
        client.store.client.close()
        saga.store.client.close()
        if saga.core._records is not None:
            saga.records.dispose()


def workers_of(web: Web, broker: RedisServer, logs: Path) -> ExitStack:
    """A tool worker and a turn worker taking their tasks from ``broker`` (the deployment's
    Redis and records): the broker's consumers once it is back."""
    env = {**web.env, "SAGA_BROKER_URL": broker.url + "/0"}
    stack = ExitStack()
    for name, app, extra in (
        ("tools", "tasks.app", ["-Q", "celery"]),
        ("turns", "tests.integration.hosted_app", ["-Q", "saga.turns", "-P", "threads"]),
    ):
        process = WorkerProcess(
            app, env=env, concurrency=2, extra_args=extra, logfile=logs / f"{name}.log", cwd=ROOT
        )
        stack.enter_context(process)
    return stack


def not_sent(answer: Any, applied: str, pending: str) -> str:
    """The answer says the request is applied and which message waits; the run's id."""
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert (body["error"], body["applied"], body["pending"]) == ("not_sent", applied, pending)
    assert answer.headers["Retry-After"].isdigit()
    assert "Error 111" not in body["message"] and "127.0.0.1" not in body["message"]
    return str(body["run_id"])


def credit_keys() -> list[str]:
    return sorted(e["idempotency_key"] for e in systems.ledger(4921) if e["kind"] == "credit")


# -- create ----------------------------------------------------------------------------------


def test_a_create_the_broker_refused_converges_on_one_run_and_one_credit(
    web: Web, refusing: Refusing, fresh_world: None, tmp_path: Path
) -> None:
    """The broker is down: the API answers 202 with the run id, saga.client and
    Saga.enqueue_run raise MessageNotSentError carrying it. The broker comes back with its
    workers; each caller retries with its run id: three runs, each completed once, one credit
    each, and the reaper's pass plays none of them again."""
    # Given the broker down, three creates: over HTTP, through saga.client, through the Saga
    first = refusing.http.post("/api/runs", json={"agent": "refund", "input": INPUT})
    over_http = not_sent(first, "created", "turn 1")
    with pytest.raises(MessageNotSentError) as by_client:
        refusing.client.enqueue_run("refund", INPUT)
    with pytest.raises(MessageNotSentError) as by_saga:
        refusing.saga.enqueue_run("refund", INPUT)
    made = [over_http, by_client.value.run_id, by_saga.value.run_id]
    for error in (by_client.value, by_saga.value):
        assert (error.applied, error.pending) == ("created", "turn 1")
    assert all(refusing.client.get_run(r).state == "running" for r in made)

    # When the broker is back and each caller retries with the run id it was told
    refusing.broker.start()
    with workers_of(web, refusing.broker, tmp_path):
        again = refusing.http.post(
            "/api/runs", json={"agent": "refund", "input": INPUT, "run_id": over_http}
        )
        assert (again.status_code, again.json()["run_id"]) == (200, over_http), again.text
        assert refusing.client.enqueue_run("refund", INPUT, run_id=made[1]) == made[1]
        assert refusing.saga.enqueue_run("refund", INPUT, run_id=made[2]) == made[2]
        for run_id in made:
            web.recorded(run_id, RunState.COMPLETED)
        refusing.saga.reap(now=refusing.saga.store.now() + 3600)

    # Then one credit per run, and no other run of the agent
    assert credit_keys() == sorted(f"{r}:2" for r in made)
    assert len(systems.outbox()) == 3


def test_two_identical_creates_at_once_answer_one_201(web: Web) -> None:
    """Of two identical creates with one run id sent together, the create script decides:
    exactly one is told 201 (created), the other 200 (the run existed), every time."""
    client = web.client(web.operate_token)
    for pair in range(12):
        body = {"agent": "failed_read", "input": "Order 1 please", "run_id": f"twin-{pair}"}
        answers = at_once(2, lambda body=body: client.post("/api/runs", json=body))
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 201], (pair, [a.text for a in answers])


# -- approve, deny ---------------------------------------------------------------------------


def awaiting(web: Web) -> tuple[str, dict[str, Any]]:
    """A run of the approver agent, its reply waiting for a person (the deployment's
    workers): the run id and the call awaiting approval."""
    client = web.client(web.operate_token)
    run_id = client.post("/api/runs", json={"agent": "approver", "input": "reply"}).json()["run_id"]
    [call] = wait_until(
        lambda: client.get(f"/api/runs/{run_id}/approvals").json()["approvals"],
        timeout=30,
        what="the reply awaiting approval",
    )
    return run_id, call


@pytest.mark.parametrize("verdict", ["approve", "deny"])
def test_a_decision_whose_turn_was_refused_is_applied_and_the_same_again_sends_it(
    web: Web, refusing: Refusing, fresh_world: None, verdict: str
) -> None:
    """The decision is recorded, the broker refuses the turn that acts on it: 202 saying so.
    The same decision again (broker up) is a 200 "repeated", not a 409, and sends the turn:
    the run completes, the reply sent once if approved, never if denied."""
    run_id, call = awaiting(web)
    url = f"/api/runs/{run_id}/approvals/{call['id']}/{verdict}"
    body = {"args_hash": call["args_hash"], **({"reason": "wrong"} if verdict == "deny" else {})}

    # Given the decision taken while the broker refuses the turn
    refused = refusing.http.post(url, json=body)
    decided = "approved" if verdict == "approve" else "denied"
    assert not_sent(refused, f"call {call['id']} {decided}", "turn") == run_id

    # When the same decision is sent again, the broker up
    again = web.client(web.operate_token).post(url, json=body)

    # Then it converges on the first: the turn goes on, once
    assert again.status_code == 200, again.text
    assert again.json()["repeated"] is True and again.json()["verdict"] == decided
    web.recorded(run_id, RunState.COMPLETED)
    assert len(systems.outbox()) == (1 if verdict == "approve" else 0)
    other, extra = ("deny", {"reason": "no"}) if verdict == "approve" else ("approve", {})
    changed = web.client(web.operate_token).post(
        url.replace(verdict, other), json={"args_hash": call["args_hash"], **extra}
    )
    assert changed.status_code == 409  # another decision is still refused


def test_the_same_decision_through_saga_client_converges(
    web: Web, refusing: Refusing, fresh_world: None
) -> None:
    """saga.client: approve raises MessageNotSentError (run id, what is applied); approve
    again on a client whose broker is up answers False (applied already) and the run goes on."""
    run_id, call = awaiting(web)
    with pytest.raises(MessageNotSentError) as refused:
        refusing.client.approve(run_id, call["id"], args_hash=call["args_hash"], by="carol")
    assert (refused.value.run_id, refused.value.pending) == (run_id, "turn")
    assert web.deployment.saga is not None
    up = Client(broker_url=web.env["SAGA_BROKER_URL"], redis_url=web.env["SAGA_REDIS_URL"])
    try:
        assert up.approve(run_id, call["id"], args_hash=call["args_hash"], by="carol") is False
    finally:
        up.store.client.close()
    web.recorded(run_id, RunState.COMPLETED)
    assert len(systems.outbox()) == 1


# -- abort -----------------------------------------------------------------------------------


def test_an_abort_whose_unwind_was_refused_is_applied_and_the_same_again_sends_it(
    web: Web, refusing: Refusing, fresh_world: None
) -> None:
    """The run is aborted, the broker refuses its unwind: 202 saying so. The same abort again
    (broker up) is a 200 with the run, and its unwind runs: the run ends, aborted once; the
    same abort after that is still a 200, another one a 409."""
    run_id, _ = awaiting(web)
    url = f"/api/runs/{run_id}/abort"

    refused = refusing.http.post(url, json={"reason": "customer called back"})
    assert not_sent(refused, "aborted", "unwind") == run_id

    again = web.client(web.operate_token).post(url, json={"reason": "customer called back"})

    assert again.status_code == 200, again.text
    web.recorded(run_id, RunState.COMPENSATED)
    record = web.saga.records.run(run_id)
    assert record is not None and record.reason == "aborted: customer called back (by alice)"
    assert systems.outbox() == []
    late = web.client(web.operate_token).post(url, json={"reason": "customer called back"})
    assert (late.status_code, late.json()["state"]) == (200, "compensated")  # applied already
    other = web.client(web.operate_token).post(url, json={"reason": "another reason"})
    assert other.status_code == 409


# -- requeue ---------------------------------------------------------------------------------


@pytest.mark.parametrize("corrected", [False, True])
def test_a_requeue_whose_unwind_was_refused_is_applied_and_the_same_again_sends_it(
    web: Web, refusing: Refusing, fresh_world: None, corrected: bool
) -> None:
    """The failed reversal is requeued (its undo corrected, or not), the broker refuses its
    unwind: 202 saying so. The same requeue again (broker up) is a 200 with the same count,
    not a 409; the reversal runs once and the run compensates; another requeue after that is
    refused."""
    run_id = web.escalated_run()
    escalation = f"{run_id}:0"
    systems.set_down("reversal", False)
    url = f"/api/escalations/{escalation}/requeue"
    [undo] = [c for c in web.saga.picture(run_id).compensations if c.step == 2]
    fix = {"2": {"credit_id": undo.entry["args"]["credit_id"]}}  # as it is: the path is tried
    body = {"corrections": fix} if corrected else {}

    refused = refusing.http.post(url, json=body)
    assert not_sent(refused, "requeued", "unwind") == run_id

    again = web.client(web.operate_token).post(url, json=body)

    assert again.status_code == 200, again.text
    assert again.json()["requeued"] == 1
    web.recorded(run_id, RunState.COMPENSATED)
    reversals = [e for e in systems.ledger(4921) if e["kind"] == "reversal"]
    assert len(reversals) == 1
    assert web.client(web.operate_token).post(url, json={}).status_code == 409


def test_the_consoles_abort_the_broker_refused_says_applied_not_refused(
    web: Web, refusing: Refusing, fresh_world: None
) -> None:
    """The console's abort form, its unwind refused by the broker: the page says the abort
    is applied and its message pending (202, titled so, with the run's link), never
    "Refused"; the same form again, broker up, sends the unwind and the run compensates."""
    run_id, _ = awaiting(web)
    console = TestClient(refusing.http.app, base_url="https://testserver")
    login = console.get("/console/login").text
    answer = console.post(
        "/console/login",
        data={"csrf": login_value(login), "token": web.operate_token},
        follow_redirects=False,
    )
    assert answer.status_code == 303, answer.text
    page = console.get(f"/console/runs/{run_id}").text
    form = {"csrf": csrf_value(page), "reason": "customer called back"}

    refused = console.post(f"/console/runs/{run_id}/abort", data=form, follow_redirects=False)

    assert refused.status_code == 202, refused.text
    assert "<title>Applied" in refused.text and "Refused" not in refused.text
    assert "not sent yet" in refused.text and f"/console/runs/{run_id}" in refused.text
    again = web.console(web.operate_token)
    page = again.get(f"/console/runs/{run_id}").text
    form["csrf"] = csrf_value(page)
    sent = again.post(f"/console/runs/{run_id}/abort", data=form, follow_redirects=False)
    assert sent.status_code == 303, sent.text
    web.recorded(run_id, RunState.COMPENSATED)


def csrf_value(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF value on the page"
    return found.group(1)
