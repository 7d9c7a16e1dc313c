"""What the web surface answers to what it cannot do, against the package's private deployment:
the reaper's escalations on every route, text saga's checks refuse, cursors and dates past the
calendar's ends, a header byte that is not UTF-8, a call awaiting approval behind thousands of
newer runs, a requeue under an id that is no longer the run's, Redis down, and two token
creates of one name at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.pool import Pool

from saga import RunState
from saga.cli.main import cli
from saga.client import Client
from saga.constants import run_keys
from saga.listing import Position
from saga.settings import Settings
from saga.testing import RedisServer
from saga.web import create_app, tokens
from saga.web.settings import WebSettings
from tasks import systems
from tests.integration.helpers import wait_until
from tests.integration.test_operations import at_once
from tests.integration.web.conftest import Web

pytestmark = pytest.mark.timeout(300)


def log_in(web: Web, token: str) -> TestClient:
    """A console session through the login form, as a browser opens one."""
    browser = web.client()
    form = browser.get("/console/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf is not None, form.text
    opened = browser.post(
        "/console/login", data={"token": token, "csrf": csrf[1]}, follow_redirects=False
    )
    assert opened.status_code == 303, opened.text
    return browser


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    return found[1]


# -- the reaper's escalation -----------------------------------------------------------------


@pytest.fixture
def reaper_escalation(web: Web) -> Iterator[str]:
    """A run whose head holds a state this version does not know, reaped: the reaper escalates
    it as ``<run>:reaper`` (what ``record_unreadable`` is for)."""
    run = web.saga.start_run()
    web.saga.store.client.hset(run_keys(run.run_id)[0], "state", "paused")
    web.saga.store.schedule(run.run_id, web.saga.store.now() - 1)
    web.saga.reap()
    escalation = f"{run.run_id}:reaper"
    assert web.saga.records.escalation(escalation) is not None
    yield escalation
    web.saga.store.client.delete(*run_keys(run.run_id))
    web.saga.store.forget(run.run_id)


def test_the_reapers_escalation_opens_refuses_a_requeue_and_resolves(
    web: Web, reaper_escalation: str
) -> None:
    """Listed, it opens on the API and the console; a requeue says why there is nothing to
    requeue (409); a resolve closes it, by the token's name; a malformed id is a 422 on the
    API and a usage error on the command line, read by the same parser."""
    # Given the reaper's escalation, listed
    client = web.client(web.operate_token)
    listed = client.get("/api/escalations").json()["escalations"]
    assert reaper_escalation in [e["escalation_id"] for e in listed]
    # When it is opened, requeued, and shown on the console
    shown = client.get(f"/api/escalations/{reaper_escalation}")
    requeued = client.post(f"/api/escalations/{reaper_escalation}/requeue", json={})
    console = log_in(web, web.operate_token)
    page = console.get(f"/console/escalations/{reaper_escalation}")
    # Then it reads, the requeue is refused saying why, and the page shows it
    assert shown.status_code == 200, shown.text
    assert shown.json()["why"]["kind"] == "unhandled"
    assert requeued.status_code == 409
    assert "the reaper's" in requeued.json()["message"]
    assert page.status_code == 200, page.text
    # When the console's resolve form is posted
    resolved = console.post(
        f"/console/escalations/{reaper_escalation}/resolve",
        data={"note": "looked at its keys", "csrf": csrf_of(page.text)},
        follow_redirects=False,
    )
    # Then it is closed, by alice
    assert resolved.status_code == 303, resolved.text
    record = web.saga.records.escalation(reaper_escalation)
    assert record is not None
    assert (record.resolved, record.resolved_by) == (True, "alice")
    again = client.post(f"/api/escalations/{reaper_escalation}/resolve", json={"note": "again"})
    assert again.status_code == 409
    # And an id that is neither <run>:<n> nor <run>:reaper is refused by every surface
    bad = client.get("/api/escalations/run-1:²")
    assert (bad.status_code, bad.json()["field"]) == (422, "path.escalation_id")
    cli_answer = CliRunner().invoke(
        cli, ["escalation", "show", "run-1:later"], env=web.env, catch_exceptions=False
    )
    assert cli_answer.exit_code == 2
    assert "is not <run_id>:<generation>" in cli_answer.output


# -- text saga refuses -----------------------------------------------------------------------


def test_text_saga_refuses_is_a_422_naming_the_field_and_a_long_reason_is_kept(
    web: Web, fresh_world: None
) -> None:
    """An agent name ``saga.agent`` would refuse, NUL in an input or a reason: 422 naming the
    field, nothing created; a 2000-character reason aborts the run, cut short to fit its
    ``(by alice)``."""
    client = web.client(web.operate_token)
    before = len(web.saga.store.client.keys("saga:{*}:run"))
    upper = client.post("/api/runs", json={"agent": "Refund", "input": "x"})
    nul = client.post("/api/runs", json={"agent": "refund", "input": "a\x00b"})
    assert (upper.status_code, upper.json()["field"]) == (422, "body.agent")
    assert (nul.status_code, nul.json()["field"]) == (422, "body.input")
    assert len(web.saga.store.client.keys("saga:{*}:run")) == before
    run = web.saga.start_run()
    refused = client.post(f"/api/runs/{run.run_id}/abort", json={"reason": "why\x00"})
    assert (refused.status_code, refused.json()["field"]) == (422, "body.reason")
    assert web.saga.store.head(run.run_id).state is RunState.RUNNING  # type: ignore[union-attr]
    aborted = client.post(f"/api/runs/{run.run_id}/abort", json={"reason": "r" * 2000})
    assert aborted.status_code == 200, aborted.text
    reason = aborted.json()["reason"]
    assert reason.endswith("r… (by alice)"), reason[-40:]
    assert len(reason) == len("aborted: ") + 2000


# -- malformed input -------------------------------------------------------------------------


def test_cursors_and_dates_past_the_calendar_are_refused_or_read_never_a_500(web: Web) -> None:
    """A forged cursor past year 9999 is a 422 (``query.cursor``) on the API and the console;
    a ``since`` before year 1 in UTC or an ``until`` past 9999 reads as that end."""
    client = web.client(web.read_token)
    forged = Position(10**20, "x").encode()
    far = Position(300_000_000_000_000_000, "x").encode()
    for cursor in (forged, far):
        answer = client.get("/api/runs", params={"cursor": cursor})
        assert (answer.status_code, answer.json()["field"]) == (422, "query.cursor")
    early = client.get("/api/runs", params={"since": "0001-01-01T00:00:00+14:00", "limit": 1})
    late = client.get("/api/runs", params={"until": "9999-12-31T23:59:59-14:00", "limit": 1})
    assert early.status_code == late.status_code == 200
    assert early.json()["runs"] and late.json()["runs"]  # nothing is older, nothing newer
    console = log_in(web, web.read_token)
    page = console.get("/console/runs", params={"cursor": forged})
    assert page.status_code == 422
    assert "text/html" in page.headers["content-type"]


def raw_post(web: Web, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """The status the app answers a POST whose header bytes are exactly ``headers`` (a test
    client re-encodes them as UTF-8, as a browser with a Latin-1 header would not)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "https",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-length", b"0"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 443),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(web.app(scope, receive, send))
    return int(sent[0]["status"])


def test_a_header_byte_that_is_not_utf8_is_no_500(web: Web) -> None:
    """HTTP headers are Latin-1 bytes: a POST carrying one (unauthenticated) is answered as
    any other POST (the login form's 403, the API's 401), not with a traceback."""
    assert raw_post(web, "/console/login", [(b"x-name", b"caf\xe9")]) == 403
    assert raw_post(web, "/api/runs", [(b"x-name", b"caf\xe9")]) == 401


def test_an_unexpected_error_logs_its_traceback_and_answers_json(
    web: Web, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a route (here: a run whose head holds a state this version cannot read,
    opened as a run) answers the one JSON shape, 500, and its traceback is in the log."""
    run = web.saga.start_run()
    web.saga.store.client.hset(run_keys(run.run_id)[0], "state", "paused")
    try:
        client = TestClient(
            web.app,
            base_url="https://testserver",
            headers={"Authorization": f"Bearer {web.read_token}"},
            raise_server_exceptions=False,
        )
        with caplog.at_level(logging.ERROR, logger="saga.web"):
            answer = client.get(f"/api/runs/{run.run_id}")
    finally:
        web.saga.store.client.delete(*run_keys(run.run_id))
        web.saga.store.forget(run.run_id)
    assert answer.status_code == 500
    assert answer.json()["message"] == "internal error (see the server's log)"
    [logged] = [r for r in caplog.records if r.exc_info and r.name == "saga.web"]
    assert "is not a valid RunState" in str(logged.exc_info[1])  # type: ignore[index]


# -- approvals -------------------------------------------------------------------------------


def test_a_call_awaiting_approval_is_listed_behind_thousands_of_newer_runs(
    web: Web, fresh_world: None
) -> None:
    """One run waits for a person; 2,100 runs start after it and end (more than a listing's
    page scans): the call is still listed, on the API and the console, until decided."""
    client = web.client(web.operate_token)
    run_id = client.post("/api/runs", json={"agent": "approver", "input": "reply"}).json()["run_id"]
    [call] = wait_until(
        lambda: client.get(f"/api/runs/{run_id}/approvals").json()["approvals"],
        timeout=30,
        what="the reply awaiting approval",
    )
    for _ in range(2100):
        web.saga.start_run().finish()
    listed = client.get("/api/approvals").json()["approvals"]
    assert [(a["run_id"], a["id"]) for a in listed if a["run_id"] == run_id] == [
        (run_id, call["id"])
    ]
    page = log_in(web, web.read_token).get("/console/approvals")
    assert run_id in page.text
    url = f"/api/runs/{run_id}/approvals/{call['id']}/deny"
    assert (
        client.post(url, json={"args_hash": call["args_hash"], "reason": "no"}).status_code == 200
    )
    wait_until(
        lambda: all(
            a["run_id"] != run_id for a in client.get("/api/approvals").json()["approvals"]
        ),
        timeout=30,
        what="the decided call gone from the listing",
    )


# -- a requeue under an old id ---------------------------------------------------------------


def test_while_a_requeue_unwinds_its_escalation_is_not_open_nor_requeued_again(
    web: Web, fresh_world: None
) -> None:
    """Requeued while billing is still down and slow (each reversal takes 3 s to fail, within
    the deployment's 4 s soft time limit: the tool's own failure, not a time limit's), the
    run unwinds again: meanwhile its old escalation is not listed as open and the run page
    shows no open escalation; a requeue under the old id is a 409 naming where the run
    stands. Once it escalates again (generation 1), the old id still requeues nothing."""
    run_id = web.escalated_run()
    client = web.client(web.operate_token)
    systems.set_delay("reversal", 3)
    first = client.post(f"/api/escalations/{run_id}:0/requeue", json={})
    assert first.status_code == 200, first.text
    # While the run unwinds again (its first reversal takes 3 s to fail)
    listed = client.get("/api/escalations", params={"run_id": run_id}).json()["escalations"]
    page = log_in(web, web.read_token).get(f"/console/runs/{run_id}")
    old = client.post(f"/api/escalations/{run_id}:0/requeue", json={})
    assert web.saga.picture(run_id).state is RunState.UNWINDING
    assert listed == []
    assert page.status_code == 200
    assert "Escalated:" not in page.text
    assert old.status_code == 409
    assert "not the run's current one" in old.json()["message"], old.text
    # Once it escalated again
    systems.set_delay("reversal", 0)
    wait_until(
        lambda: web.saga.records.escalation(f"{run_id}:1") is not None,
        timeout=60,
        what="escalation 1 recorded",
    )
    again = client.post(f"/api/escalations/{run_id}:0/requeue", json={})
    assert again.status_code == 409
    requeues = [a for a in web.saga.picture(run_id).actions if a["kind"] == "requeue"]
    assert len(requeues) == 1
    listed = client.get("/api/escalations", params={"run_id": run_id}).json()["escalations"]
    assert [e["escalation_id"] for e in listed] == [f"{run_id}:1"]


# -- Redis down ------------------------------------------------------------------------------


def test_with_redis_down_the_listing_is_a_503_naming_no_host(web: Web) -> None:
    """The app over a Redis this test started, then stopped: ``GET /api/runs`` answers 503
    "Redis does not answer", with no host or port in the body."""
    server = RedisServer().start()
    try:
        settings = dataclasses.replace(Settings.from_env(), redis_url=server.url + "/0")
        app = create_app(
            client=Client(settings=settings),
            records=web.saga.records,
            settings=WebSettings(app="tasks.app:saga"),
        )
        client = TestClient(
            app,
            base_url="https://testserver",
            headers={"Authorization": f"Bearer {web.read_token}"},
        )
        assert client.get("/api/runs").status_code == 200
        server.stop()
        answer = client.get("/api/runs")
    finally:
        server.stop()
    assert answer.status_code == 503, answer.text
    assert answer.json()["message"] == "Redis does not answer"
    assert str(server.port) not in answer.text and "127.0.0.1" not in answer.text


# -- token names -----------------------------------------------------------------------------


def test_two_creates_of_one_name_at_once_make_one_live_token(web: Web) -> None:
    """Ten pairs of creates at once: each pair makes one token, the other is refused with the
    message of the check; revoked, the name can be taken again."""
    for pair in range(10):
        name = f"twin-{pair}-{threading.get_ident()}"

        def create(name: str = name) -> str:
            try:
                tokens.create(web.saga.records, name, "read")
                return "made"
            except tokens.TokenError as exc:
                return str(exc)

        answers = at_once(2, create)
        assert sorted(answers) == sorted(
            ["made", f"a token named {name!r} exists: revoke it first, or pick another"]
        )
        live = [t for t in tokens.list_tokens(web.saga.records) if t.name == name]
        assert len(live) == 1
        tokens.revoke(web.saga.records, name)
        tokens.create(web.saga.records, name, "read")
        tokens.revoke(web.saga.records, name)


# -- readiness -------------------------------------------------------------------------------


def test_readiness_probes_share_one_check_over_the_records_pool(web: Web) -> None:
    """Twenty anonymous probes at once, after one: each answers ready, no new database
    connection is opened (the records' pool serves the schema check), and Redis is pinged
    far fewer times than probed (one check in flight, its answer shared)."""
    opened: list[object] = []

    def count(connection: object, record: object) -> None:
        opened.append(connection)

    pings = web.saga.store.client
    with web.client() as client:
        assert client.get("/health/ready").status_code == 200
        before = int(pings.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))
        event.listen(Pool, "connect", count)
        try:
            answers = at_once(20, lambda: client.get("/health/ready"))
        finally:
            event.remove(Pool, "connect", count)
        after = int(pings.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))
    assert [a.status_code for a in answers] == [200] * 20, answers
    assert opened == []
    assert after - before <= 10, after - before


# -- listings cut in SQL ---------------------------------------------------------------------


def test_the_escalation_listing_is_ordered_and_cut_by_the_database(web: Web) -> None:
    """Three escalations one after another: ``limit=2`` answers the two newest, ``since`` the
    ones at or after a moment, and the statement the database ran carries the LIMIT (the cost
    of a short page is the page, not the whole history)."""
    made = []
    for _ in range(3):
        run = web.saga.start_run()
        web.saga.records.record_unreadable(run.run_id, "a test's unreadable run")
        made.append(f"{run.run_id}:reaper")
    newest = web.saga.records.escalation(made[-1])
    assert newest is not None
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    client = web.client(web.read_token)
    engine = web.saga.records.engine
    event.listen(engine, "before_cursor_execute", seen)
    try:
        page = client.get("/api/escalations", params={"limit": 2}).json()["escalations"]
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    since = client.get("/api/escalations", params={"since": newest.created_at.isoformat()})
    assert [e["escalation_id"] for e in page] == [made[2], made[1]]
    assert made[2] in [e["escalation_id"] for e in since.json()["escalations"]]
    assert made[1] not in [e["escalation_id"] for e in since.json()["escalations"]]
    assert any("LIMIT" in s.upper() and "saga_escalations" in s for s in statements), statements
    for escalation in made:
        web.saga.records.resolve_escalation(escalation, "a test's", "test")
