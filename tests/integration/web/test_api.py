"""The HTTP API through its test client, against the package's private deployment (real
Redis, PostgreSQL records, a tool worker and a turn worker): tokens and scopes, bodies refused
naming the field with nothing changed, idempotent run creation, two requeues at once, paging
while runs are created, approvals, health.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from saga import RunState
from saga.cli.main import cli
from saga.constants import run_keys
from saga.records import ActionRecord
from saga.web import tokens
from tasks import systems
from tests.integration.helpers import wait_until
from tests.integration.test_operations import at_once
from tests.integration.web.conftest import Web

pytestmark = pytest.mark.timeout(180)


def state_of(web: Web, run_id: str) -> str:
    head = web.saga.store.head(run_id)
    assert head is not None
    return head.state.value


# -- who may do what -------------------------------------------------------------------------


def test_no_token_bad_token_wrong_scope_and_a_revoked_token(web: Web) -> None:
    """401 without a token or with an unknown one, 403 for a read token on an action (the
    run goes on), and a revoked token is refused on its very next request."""
    run = web.saga.start_run()
    anonymous, reader = web.client(), web.client(web.read_token)
    assert anonymous.get("/api/runs").status_code == 401
    assert anonymous.get("/api/runs").headers["www-authenticate"] == "Bearer"
    assert web.client("saga_000000000000_" + "x" * 43).get("/api/runs").status_code == 401
    assert reader.get(f"/api/runs/{run.run_id}").status_code == 200
    refused = reader.post(f"/api/runs/{run.run_id}/abort", json={"reason": "no"})
    assert refused.status_code == 403
    assert refused.json()["error"] == "forbidden"
    assert state_of(web, run.run_id) == "running"
    # A token revoked: refused at once
    temporary, _ = tokens.create(web.saga.records, "carol", "operate")
    assert web.client(temporary).get("/api/runs").status_code == 200
    tokens.revoke(web.saga.records, "carol")
    assert web.client(temporary).get("/api/runs").status_code == 401
    run.abort("test over")


def test_health_needs_no_token_and_says_nothing_else(web: Web) -> None:
    """Liveness and readiness answer without a token, with statuses only: no URL, no
    password, no version."""
    client = web.client()
    assert client.get("/health/live").json() == {"status": "ok"}
    ready = client.get("/health/ready")
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "ready"
    assert body["checks"] == {"redis": "ok", "broker": "ok", "database": "ok", "schema": "ok"}
    assert "127.0.0.1" not in ready.text and "postgres" not in ready.text
    assert "/health/ready" in client.get("/openapi.json").json()["paths"]


# -- bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/runs", {"agent": "refund", "input": "x", "run_id": "bad id"}, "body.run_id"),
        ("/api/runs", {"agent": "refund", "input": "x", "colour": 1}, "body.colour"),
        ("/api/runs", {"agent": "refund"}, "body.input"),
        ("/api/runs", {"agent": "no spaces", "input": "x"}, "body.agent"),
        ("/abort", {"reason": "x" * 2001}, "body.reason"),
        ("/abort", {"reason": "   "}, "body.reason"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field_and_nothing_changes(
    web: Web, path: str, body: dict[str, Any], field: str
) -> None:
    run = web.saga.start_run()
    created = web.saga.store.layout.created_of(run.run_id)
    before = web.saga.store.client.zcard(created)
    url = f"/api/runs/{run.run_id}/abort" if path == "/abort" else path
    answer = web.client(web.operate_token).post(url, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field
    assert state_of(web, run.run_id) == "running"
    assert web.saga.store.client.zcard(created) == before
    run.abort("test over")


def test_not_json_too_large_and_a_bad_path_are_refused(web: Web) -> None:
    """415 for a form body, 413 above the size limit, 422 naming ``path.run_id``."""
    client = web.client(web.operate_token)
    form = client.post("/api/runs", content="agent=refund&input=x")
    assert form.status_code == 415
    huge = client.post(
        "/api/runs",
        content=b'{"agent": "refund", "input": "' + b"x" * 300_000 + b'"}',
        headers={"Content-Type": "application/json"},
    )
    assert huge.status_code == 413
    path = client.get("/api/runs/a{b}")
    assert (path.status_code, path.json()["field"]) == (422, "path.run_id")
    cursor = client.get("/api/runs", params={"cursor": "nope"})
    assert (cursor.status_code, cursor.json()["field"]) == (422, "query.cursor")


# -- runs ------------------------------------------------------------------------------------


def test_creating_a_run_is_idempotent_by_its_id(web: Web) -> None:
    """201 then 200 with the same run for the same body; another body under that id is a
    409 that changes nothing; the run ends (the agent answers) and reads back the same."""
    client = web.client(web.operate_token)
    body = {"agent": "failed_read", "input": "Order 1 please", "run_id": "api-idem-1"}
    first = client.post("/api/runs", json=body)
    assert first.status_code == 201, first.text
    assert first.json()["kind"] == "saga.run"
    again = client.post("/api/runs", json=body)
    assert (again.status_code, again.json()["run_id"]) == (200, "api-idem-1")
    other = client.post("/api/runs", json={**body, "input": "something else"})
    assert other.status_code == 409
    web.recorded("api-idem-1", RunState.COMPLETED)
    shown = CliRunner().invoke(cli, ["show", "api-idem-1", "--json"])
    assert client.get("/api/runs/api-idem-1").json() == json.loads(shown.stdout)
    agent = client.get("/api/runs/api-idem-1/agent").json()
    assert agent["input"] == "Order 1 please"
    assert client.post("/api/runs", json=body).status_code == 200
    assert client.post("/api/runs", json={**body, "agent": "parallel"}).status_code == 409


def test_pages_across_a_boundary_while_runs_are_created(web: Web) -> None:
    """Runs only in SQL (their keys gone) and runs live in Redis, paged by 2 with a run
    created before each next page: each older run once, newest first."""
    client = web.client(web.read_token)
    ended = []
    for _ in range(3):
        run = web.saga.start_run()
        run.finish()
        web.recorded(run.run_id, RunState.COMPLETED)
        web.saga.store.client.delete(*run_keys(run.run_id))  # as if its retention ran out
        web.saga.store.forget(run.run_id)
        ended.append(run.run_id)
    live = [web.saga.start_run().run_id for _ in range(3)]
    expected = list(reversed(ended + live))
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/runs", params=params).json()
        seen += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
        web.saga.start_run()  # newer than every page: never shows up below
    older = [run_id for run_id in seen if run_id in expected]
    assert older == expected
    assert len(seen) == len(set(seen))
    sources = {r["run_id"]: r["source"] for r in client.get("/api/runs?limit=200").json()["runs"]}
    assert {sources[r] for r in ended} == {"database"}
    for run_id in live:
        web.saga.run(run_id).abort("test over")


def test_since_takes_a_duration_as_the_cli_does(web: Web) -> None:
    """One parser for both surfaces (``saga.listing.parse_since``): ``2h`` and ISO alike."""
    client = web.client(web.read_token)
    run = web.saga.start_run()
    try:
        recent = client.get("/api/runs", params={"since": "2h", "limit": 200})
        assert recent.status_code == 200, recent.text
        assert run.run_id in [r["run_id"] for r in recent.json()["runs"]]
        future = client.get("/api/runs", params={"since": "2999-01-01T00:00:00"})
        assert future.status_code == 200 and future.json()["runs"] == []
        escalations = client.get("/api/escalations", params={"since": "7d"})
        assert escalations.status_code == 200, escalations.text
        bad = client.get("/api/runs", params={"since": "yesterday"})
        assert bad.status_code == 422 and "neither a duration" in bad.text, bad.text
    finally:
        run.abort("test over")


# -- approvals -------------------------------------------------------------------------------


def test_a_call_awaiting_approval_is_listed_then_approved_once(web: Web, fresh_world: None) -> None:
    """The reply waits for a person: listed with its hash; a wrong hash is a 409, a read
    token a 403; approved with the hash, it goes out and the run completes, decided by
    the token's name; the same decision again changes nothing (200, repeated), another is a
    409."""
    client = web.client(web.operate_token)
    run_id = client.post("/api/runs", json={"agent": "approver", "input": "reply"}).json()["run_id"]
    pending = wait_until(
        lambda: client.get(f"/api/runs/{run_id}/approvals").json()["approvals"],
        timeout=30,
        what="the reply awaiting approval",
    )
    [call] = pending
    assert call["tool"] == "send_reply"
    assert any(a["run_id"] == run_id for a in client.get("/api/approvals").json()["approvals"])
    url = f"/api/runs/{run_id}/approvals/{call['id']}"
    assert client.post(f"{url}/approve", json={"args_hash": "0" * 64}).status_code == 409
    reader = web.client(web.read_token)
    assert reader.post(f"{url}/approve", json={"args_hash": call["args_hash"]}).status_code == 403
    approved = client.post(f"{url}/approve", json={"args_hash": call["args_hash"]})
    assert approved.json() == {
        "run_id": run_id,
        "approval_id": call["id"],
        "verdict": "approved",
        "by": "alice",
        "repeated": False,
    }
    web.recorded(run_id, RunState.COMPLETED)
    assert len(systems.outbox()) == 1
    again = client.post(f"{url}/approve", json={"args_hash": call["args_hash"]})
    assert (again.status_code, again.json()["repeated"]) == (200, True)  # the same decision
    other = client.post(f"{url}/deny", json={"args_hash": call["args_hash"], "reason": "no"})
    assert other.status_code == 409
    assert len(systems.outbox()) == 1


# -- escalations -----------------------------------------------------------------------------


def test_two_requeues_at_once_one_wins_the_other_is_a_409(web: Web, fresh_world: None) -> None:
    """The escalation is listed and read; once billing is back, two requeues sent together:
    one runs the reversal (recorded by alice), the other is refused; the run compensates and
    a requeue after that is a 409 too."""
    run_id = web.escalated_run()
    client = web.client(web.operate_token)
    [row] = [
        e for e in client.get("/api/escalations").json()["escalations"] if e["run_id"] == run_id
    ]
    escalation = row["escalation_id"]
    package = client.get(f"/api/escalations/{escalation}").json()
    assert package["why"]["kind"] == "compensation_failed"
    assert [c["step"] for c in package["failed_compensations"]] == [2]
    systems.set_down("reversal", False)
    answers = at_once(
        2,
        lambda: web.client(web.operate_token).post(
            f"/api/escalations/{escalation}/requeue", json={}
        ),
    )
    assert sorted(a.status_code for a in answers) == [200, 409], [a.text for a in answers]
    web.recorded(run_id, RunState.COMPENSATED)
    with Session(web.saga.records.engine) as session:
        actions = session.scalars(select(ActionRecord).where(ActionRecord.run_id == run_id))
        assert [(a.kind, a.by) for a in actions] == [("requeue", "alice")]
    late = client.post(f"/api/escalations/{escalation}/requeue", json={})
    assert late.status_code == 409


def test_a_bad_correction_is_refused_then_resolve_closes_it(web: Web, fresh_world: None) -> None:
    """A correction naming no failed undo is a 422 and runs nothing; a resolve records the
    note and alice; a requeue after it is a 409."""
    run_id = web.escalated_run()
    escalation = f"{run_id}:0"
    client = web.client(web.operate_token)
    wrong = client.post(
        f"/api/escalations/{escalation}/requeue", json={"corrections": {"1": {"x": 1}}}
    )
    assert (wrong.status_code, wrong.json()["field"]) == (422, "body.corrections")
    bad_key = client.post(
        f"/api/escalations/{escalation}/requeue", json={"corrections": {"two": {"x": 1}}}
    )
    assert bad_key.status_code == 422
    assert bad_key.json()["field"].startswith("body.corrections")
    assert state_of(web, run_id) == "escalated"
    no_note = client.post(f"/api/escalations/{escalation}/resolve", json={"note": " "})
    assert (no_note.status_code, no_note.json()["field"]) == (422, "body.note")
    done = client.post(f"/api/escalations/{escalation}/resolve", json={"note": "refunded by hand"})
    assert done.status_code == 200, done.text
    assert done.json()["resolved_by"] == "alice"
    assert client.post(f"/api/escalations/{escalation}/requeue", json={}).status_code == 409


def test_saga_tokens_create_list_revoke(web: Web, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command makes a token that works at once, lists it without the secret, refuses a
    bad name (exit 2) and revokes it (the next request is a 401)."""
    monkeypatch.setenv("SAGA_DATABASE_URL", web.database_url)
    runner = CliRunner()
    made = runner.invoke(cli, ["tokens", "create", "--name", "dave ops", "--scope", "read"])
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[0]
    assert token.startswith("saga_")
    assert web.client(token).get("/api/runs").status_code == 200
    listed = runner.invoke(cli, ["tokens", "list", "--json"])
    assert "dave ops" in listed.stdout and token not in listed.stdout
    bad = runner.invoke(cli, ["tokens", "create", "--name", "<script>", "--scope", "read"])
    assert bad.exit_code == 2
    twice = runner.invoke(cli, ["tokens", "create", "--name", "dave ops", "--scope", "read"])
    assert twice.exit_code == 2
    assert runner.invoke(cli, ["tokens", "revoke", "--name", "dave ops"]).exit_code == 0
    assert web.client(token).get("/api/runs").status_code == 401
    assert runner.invoke(cli, ["tokens", "revoke", "--name", "dave ops"]).exit_code == 3


def test_the_app_mounts_in_another_asgi_app(web: Web) -> None:
    """Sidekiq-Web style: mounted under /saga, its routes, its login redirect and its
    cookies' path all follow the mount."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    outer = FastAPI()
    outer.mount("/saga", web.app)
    client = TestClient(outer, base_url="https://testserver")
    headers = {"Authorization": f"Bearer {web.read_token}"}
    assert client.get("/saga/api/runs", headers=headers).status_code == 200
    assert client.get("/saga/health/live").json() == {"status": "ok"}
    away = client.get("/saga/console/runs", follow_redirects=False)
    location = "/saga/console/login?next=%2Fconsole%2Fruns"  # back here after logging in
    assert (away.status_code, away.headers["location"]) == (303, location)
    form = client.get("/saga/console/login")
    assert 'action="/saga/console/login"' in form.text
    assert "Path=/saga/console" in form.headers["set-cookie"]


def test_without_an_app_requeue_and_resolve_say_so_and_reads_work(
    web: Web, fresh_world: None
) -> None:
    """A server with no SAGA_APP serves the reads and refuses requeue and resolve with a 503
    that says what to set."""
    from fastapi.testclient import TestClient

    from saga.client import Client
    from saga.settings import Settings
    from saga.web import create_app
    from saga.web.settings import WebSettings

    escalation = f"{web.escalated_run()}:0"
    client = Client(settings=Settings.from_env())
    bare = create_app(client=client, records=web.saga.records, settings=WebSettings())
    try:
        http = TestClient(bare, base_url="https://testserver")
        headers = {"Authorization": f"Bearer {web.operate_token}"}
        assert http.get("/api/escalations", headers=headers).status_code == 200
        for action, body in (("requeue", {}), ("resolve", {"note": "done"})):
            refused = http.post(
                f"/api/escalations/{escalation}/{action}", json=body, headers=headers
            )
            assert refused.status_code == 503, refused.text
            assert "SAGA_APP" in refused.json()["message"]
        assert http.get(f"/api/escalations/{escalation}", headers=headers).json()["open"]
    finally:
        client.store.client.close()
