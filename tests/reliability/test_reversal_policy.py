"""A person decides before a costly reversal: a tool's ``reversal`` policy stops the unwind at
its undo (the newer undos run, the older wait their turn, no worker is held) until a person
answers, bound to that very undo: reverse it now, keep the effect with a note (the run ends
escalated and resolved by that decision, the effect on its books), or decide later; nobody
answering in time is an escalation, never a silent keep."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from saga import Saga
from saga.errors import OperationRefusedError
from saga.model import CompensationState, RunState
from saga.rules import REASON_COMPENSATION_FAILED, REASON_KEPT
from saga.runs import Run
from tasks import systems
from tests.conftest import ROOT
from tests.integration.helpers import CREDIT, ORDER, TICKET, wait_until
from tests.reliability.conftest import Private
from tests.reliability.reversal_app import COSTLY, tools

APP = "tests.reliability.reversal_app"


@pytest.fixture
def env(private: Callable[..., Private]) -> Private:
    made = private(registry=tools, run_deadline=5)
    made.worker(APP, concurrency=2)
    return made


def _ledger(run: Run) -> list[str]:
    return [
        r["kind"] for r in systems.ledger() if r["idempotency_key"].startswith(f"{run.run_id}:")
    ]


def _asked(env: Private, amount: int = CREDIT) -> Run:
    """A run that set the ticket pending, credited ``amount``, then solved the ticket, and was
    aborted: its unwind restores the ticket (the newest undo) and reaches the credit."""
    run = env.saga.start_run()
    run.call("set_ticket_status", ticket_id=TICKET, status="pending").result(timeout=20)
    run.call("issue_credit", order_id=ORDER, amount_cents=amount, memo="x").result(timeout=20)
    run.call("set_ticket_status", ticket_id=TICKET, status="solved").result(timeout=20)
    run.abort("the customer cancelled")
    return run


def _undo(saga: Saga, run: Run, step: int) -> Any:
    return next(c for c in saga.picture(run.run_id).compensations if c.step == step)


def _waits_for_a_person(env: Private, run: Run) -> Any:
    wait_until(lambda: _undo(env.saga, run, 2).state is CompensationState.ASKED, 30, "the ask")
    return _undo(env.saga, run, 2)


def test_the_unwind_stops_at_a_costly_credit_and_reverses_it_once_a_person_says_so(
    env: Private,
) -> None:
    run = _asked(env)
    asked = _waits_for_a_person(env, run)
    # The newer undo ran, the older waits, the credit stands, the run waits (holds no worker)
    wait_until(lambda: _undo(env.saga, run, 3).state is CompensationState.DONE, 30, "undo 3")
    assert _undo(env.saga, run, 1).state is CompensationState.PENDING
    assert _ledger(run) == ["credit"] and run.state() is RunState.UNWINDING
    assert systems.get_ticket(TICKET)["status"] == "pending"  # step 3 undone, step 1 not yet
    assert env.saga.reap(now=env.saga.store.now() + 60).resumed == []  # not stalled: waiting

    # An answer bound to another undo, or without the hash shown, is refused and changes nothing
    for wrong in ("", "0" * 40):
        with pytest.raises(OperationRefusedError, match="not the one asked about"):
            env.saga.decide_reversal(run.run_id, 2, "reverse", args_hash=wrong, by="ada")
    with pytest.raises(OperationRefusedError, match="needs a note"):
        env.saga.decide_reversal(run.run_id, 2, "keep", args_hash=asked.ask_hash, by="ada")

    env.saga.decide_reversal(
        run.run_id, 2, "reverse", args_hash=asked.ask_hash, by="ada", note="customer left"
    )
    ended = run.wait(timeout=30)
    assert ended.state is RunState.COMPENSATED
    assert _ledger(run) == ["credit", "reversal"]
    assert systems.get_ticket(TICKET)["status"] == "open"
    with pytest.raises(OperationRefusedError, match="done already: reverse by ada"):
        env.saga.decide_reversal(
            run.run_id, 2, "keep", args_hash=asked.ask_hash, by="bob", note="x"
        )
    rows = {c.step: c for c in env.saga.records.compensations(run.run_id)}
    assert [(d["decision"], d["by"], d["note"]) for d in rows[2].decisions] == [
        ("reverse", "ada", "customer left")
    ]


def test_a_kept_credit_ends_the_run_escalated_and_resolved_with_the_effect_on_the_books(
    env: Private,
) -> None:
    run = _asked(env)
    asked = _waits_for_a_person(env, run)
    env.saga.decide_reversal(
        run.run_id, 2, "keep", args_hash=asked.ask_hash, by="grace", note="goodwill, approved"
    )
    ended = run.wait(timeout=30)
    assert ended.state is RunState.ESCALATED and ended.reason == REASON_KEPT
    assert _ledger(run) == ["credit"]  # never reversed
    assert systems.get_ticket(TICKET)["status"] == "open"  # the older undo ran
    escalation = env.saga.records.escalation(f"{run.run_id}:0")
    assert escalation is not None and escalation.resolved and escalation.resolved_by == "grace"
    assert "goodwill, approved" in escalation.resolution
    live = {item["step"]: item["why"] for item in escalation.not_undone}
    assert live[2] == "kept on purpose: grace: goodwill, approved"


def test_later_puts_the_question_off_and_the_same_question_is_answered_after(
    env: Private,
) -> None:
    run = _asked(env)
    asked = _waits_for_a_person(env, run)
    env.saga.decide_reversal(run.run_id, 2, "later", args_hash=asked.ask_hash, by="ada")
    later = _undo(env.saga, run, 2)
    assert later.state is CompensationState.ASKED and later.ask_expires > asked.ask_expires
    assert [d["decision"] for d in later.decisions] == ["later"]
    shown = _saga_cli(env, "reversal", run.run_id)  # the question, with its earlier answer
    assert shown.returncode == 0, shown.stderr
    assert "why a person is asked:" in shown.stdout
    assert "earlier answer: later by ada" in shown.stdout
    assert f"--reverse --hash {later.ask_hash}" in shown.stdout
    env.saga.decide_reversal(run.run_id, 2, "reverse", args_hash=later.ask_hash, by="bob")
    assert run.wait(timeout=30).state is RunState.COMPENSATED
    assert [d["decision"] for d in _undo(env.saga, run, 2).decisions] == ["later", "reverse"]


def test_nobody_answering_in_time_escalates_never_keeps(private: Callable[..., Private]) -> None:
    env = private(registry=tools, run_deadline=5, extra_env={"SAGA_REVERSAL_ASK_SECONDS": "2"})
    env.worker(APP, concurrency=2)
    run = _asked(env)
    asked = _waits_for_a_person(env, run)
    assert env.saga.reap().unanswered == []  # asked, not expired: left alone
    time.sleep(max(0.0, asked.ask_expires - env.saga.store.now()) + 0.2)

    # The reaper at the question's end: the undo failed, not answered; the older one runs
    report = env.saga.reap()
    assert report.unanswered == [(run.run_id, 2)]
    ended = run.wait(timeout=30)
    assert ended.state is RunState.ESCALATED and ended.reason == REASON_COMPENSATION_FAILED
    undo = _undo(env.saga, run, 2)
    assert undo.state is CompensationState.FAILED and undo.error["type"] == "NotAnswered"
    assert _ledger(run) == ["credit"] and systems.get_ticket(TICKET)["status"] == "open"
    escalation = env.saga.records.escalation(f"{run.run_id}:0")
    assert escalation is not None and not escalation.resolved  # a person must look


def test_a_credit_under_the_threshold_is_reversed_without_asking(env: Private) -> None:
    run = _asked(env, amount=COSTLY // 2)
    ended = run.wait(timeout=30)
    assert ended.state is RunState.COMPENSATED
    assert _ledger(run) == ["credit", "reversal"]
    assert all(c.decisions == [] for c in ended.compensations)


def test_the_http_api_and_the_cli_show_the_question_and_take_the_answer(env: Private) -> None:
    from fastapi.testclient import TestClient

    from saga.client import Client
    from saga.web import create_app, tokens
    from saga.web.settings import WebSettings

    run = _asked(env)
    asked = _waits_for_a_person(env, run)
    app = create_app(
        client=Client(settings=env.saga.settings),
        records=env.saga.records,
        settings=WebSettings(app=f"{APP}:saga"),
        saga=env.saga,
    )
    operate, _ = tokens.create(env.saga.records, "carol", "operate")
    read, _ = tokens.create(env.saga.records, "dave", "read")

    def client(token: str) -> TestClient:
        headers = {"Authorization": f"Bearer {token}"}
        return TestClient(app, base_url="https://testserver", headers=headers)

    # The question as a web app sees it, and as `saga reversal RUN` prints it
    [shown] = client(read).get(f"/api/runs/{run.run_id}/reversals").json()["reversals"]
    assert (shown["step"], shown["tool"], shown["args_hash"]) == (
        2,
        "reverse_credit",
        asked.ask_hash,
    )
    cli = _saga_cli(env, "reversal", run.run_id)
    assert cli.returncode == 0 and f"--hash {asked.ask_hash}" in cli.stdout
    assert _saga_cli(env, "reversal", run.run_id, "2", "--reverse").returncode == 2  # no hash

    # A reader may not answer; a keep needs a note; the operator's keep is taken, once
    url = f"/api/runs/{run.run_id}/reversals/2"
    body = {"decision": "keep", "args_hash": asked.ask_hash, "note": "a goodwill gesture"}
    assert client(read).post(url, json=body).status_code == 403
    assert client(operate).post(url, json={**body, "note": ""}).status_code == 409
    answer = client(operate).post(url, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["by"] == "carol"
    assert client(operate).post(url, json=body).status_code == 409  # answered already
    assert run.wait(timeout=30).reason == REASON_KEPT
    again = _saga_cli(env, "reversal", run.run_id, "2", "--reverse", "--hash", asked.ask_hash)
    assert again.returncode == 1 and "kept already: keep by carol" in again.stderr


def _saga_cli(env: Private, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("saga")), *args, "--app", f"{APP}:saga"],
        env={**os.environ, **env.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_timeline_says_a_person_is_asked_then_that_the_effect_was_kept(env: Private) -> None:
    from saga.escalations.document import run_document
    from saga.escalations.timeline import timeline

    run = _asked(env)
    asked = _waits_for_a_person(env, run)

    def drawn() -> str:
        lines = timeline(run_document(env.saga.picture(run.run_id)))
        return "\n".join("".join(text for text, _ in line) for line in lines)

    assert "a person is asked: reverse, keep or later" in drawn()
    env.saga.decide_reversal(
        run.run_id, 2, "keep", args_hash=asked.ask_hash, by="grace", note="goodwill"
    )
    run.wait(timeout=30)
    assert "= " in drawn() and "kept on purpose" in drawn()
