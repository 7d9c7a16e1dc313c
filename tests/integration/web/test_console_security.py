"""The console's sessions, login and headers against what an attacker can do: read Redis,
plant a cookie from another port of the host, craft a link; and its rough edges (error codes,
booleans, malformed field names, plain http). Over the package's deployment (real Redis,
real records); the live streams over a real ``saga serve``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from saga.constants import WEB_SESSION_PREFIX, WEB_TOKEN_SESSIONS_PREFIX, agent_key, run_keys
from saga.web import tokens
from saga.web.settings import WebSettings
from tests.integration.helpers import wait_until
from tests.integration.web.conftest import Web, login_value

pytestmark = pytest.mark.timeout(180)


def _token(web: Web, scope: str = "read") -> tuple[str, str]:
    """A token of its own for one test (one a test may revoke): its name and text."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    text, _ = tokens.create(web.saga.records, name, scope)
    return name, text


def _sessions(web: Web) -> dict[str, str]:
    """Every console session as a reader of Redis sees it: key -> value."""
    client = web.saga.store.client
    return {k: client.get(k) for k in client.scan_iter(match=WEB_SESSION_PREFIX + "*")}


# -- sessions ---------------------------------------------------------------------------------


def test_a_redis_reader_finds_nothing_to_act_with(web: Web) -> None:
    """A session's key and value, as a read-only Redis user reads them, make neither a cookie
    nor a CSRF token: an abort posted with them is refused and the run goes on."""
    # Given alice logged in and a running run
    _, text = _token(web, "operate")
    before = set(_sessions(web))
    alice = web.console(text)
    run = web.saga.start_run()
    # When a reader takes the new session's key and value from Redis
    (key, raw), *_ = ((k, v) for k, v in _sessions(web).items() if k not in before)
    stored = json.loads(raw)
    cookie = alice.cookies["saga_session"]
    real_csrf = login_value(alice.get(f"/console/runs/{run.run_id}").text)
    # Then neither the cookie nor the CSRF token is in Redis
    assert cookie not in key and cookie not in raw and real_csrf not in raw
    assert set(stored) == {"token_id", "opened"}
    # And posting with what was read does nothing
    outsider = web.client()
    digest = key.removeprefix(WEB_SESSION_PREFIX)
    for csrf in (*map(str, stored.values()), digest):
        answer = outsider.post(
            f"/console/runs/{run.run_id}/abort",
            data={"csrf": csrf, "reason": "read from Redis"},
            headers={"Cookie": f"saga_session={digest}"},
            follow_redirects=False,
        )
        assert answer.status_code == 303 and "/console/login" in answer.headers["location"]
    assert web.saga.store.head(run.run_id).state.value == "running"  # type: ignore[union-attr]
    run.abort("test over")


def test_a_token_holds_a_bounded_number_of_sessions_the_oldest_ends(web: Web) -> None:
    """Logging in once more than ``sessions_per_token`` ends the oldest session only."""
    _, text = _token(web)
    cap = WebSettings().sessions_per_token
    logins = [web.console(text) for _ in range(cap + 1)]
    assert logins[0].get("/console/runs", follow_redirects=False).status_code == 303
    for login in logins[1:]:
        assert login.get("/console/runs", follow_redirects=False).status_code == 200
    token_id = text.split("_")[1]
    assert web.saga.store.client.zcard(WEB_TOKEN_SESSIONS_PREFIX + token_id) == cap


def test_logout_ends_the_session_and_its_entry(web: Web) -> None:
    """After logout the cookie opens nothing, and the token's list of sessions forgets it."""
    _, text = _token(web)
    alice = web.console(text)
    csrf = login_value(alice.get("/console/runs").text)
    cookie = alice.cookies["saga_session"]
    token_id = text.split("_")[1]
    assert web.saga.store.client.zcard(WEB_TOKEN_SESSIONS_PREFIX + token_id) == 1
    assert alice.post("/console/logout", data={"csrf": csrf}).status_code == 200
    again = web.client().get(
        "/console/runs", headers={"Cookie": f"saga_session={cookie}"}, follow_redirects=False
    )
    assert again.status_code == 303 and "error=expired" in again.headers["location"]
    assert "Your session ended" in web.client().get(again.headers["location"]).text
    assert web.saga.store.client.zcard(WEB_TOKEN_SESSIONS_PREFIX + token_id) == 0


# -- logging in -------------------------------------------------------------------------------


def test_a_planted_login_cookie_cannot_log_the_browser_in(web: Web) -> None:
    """Another port of this host can set ``saga_login`` for this one: a value the server did
    not mint is refused, and the form does not adopt it; a value it did mint, posted from
    another origin of the site (``Sec-Fetch-Site: same-site``), is refused too."""
    _, text = _token(web)
    planted = {"Cookie": "saga_login=planted"}
    # A planted value, repeated in the form: refused
    answer = web.client().post(
        "/console/login", data={"csrf": "planted", "token": text}, headers=planted
    )
    assert answer.status_code == 403 and "saga_session" not in answer.headers.get("set-cookie", "")
    # The form mints its own value, whatever cookie came in
    form = web.client().get("/console/login", headers=planted)
    minted = login_value(form.text)
    assert minted != "planted" and f"saga_login={minted};" in form.headers["set-cookie"]
    # A value minted here but posted from another port of the host: refused
    browser = web.client()
    minted = login_value(browser.get("/console/login").text)
    answer = browser.post(
        "/console/login",
        data={"csrf": minted, "token": text},
        headers={"Sec-Fetch-Site": "same-site"},
    )
    assert answer.status_code == 403 and "another origin" in answer.text
    # A tampered or stale value: refused
    nonce, stamp, signature = minted.split(".")
    for bad in (f"{nonce}x.{stamp}.{signature}", f"{nonce}.{int(stamp) - 7200}.{signature}"):
        refused = web.client().post(
            "/console/login",
            data={"csrf": bad, "token": text},
            headers={"Cookie": f"saga_login={bad}"},
        )
        assert refused.status_code == 403 and "saga_session" not in refused.headers.get(
            "set-cookie", ""
        )
    # While the value minted for this very browser, from its own page, logs in
    answer = browser.post(
        "/console/login",
        data={"csrf": minted, "token": text},
        headers={"Sec-Fetch-Site": "same-origin"},
        follow_redirects=False,
    )
    assert answer.status_code == 303 and "saga_session=" in answer.headers["set-cookie"]


def test_forms_posted_from_another_origin_are_refused(web: Web) -> None:
    """A logged-in session's form, CSRF token and all, posted cross-origin: nothing done."""
    _, text = _token(web, "operate")
    alice = web.console(text)
    run = web.saga.start_run()
    csrf = login_value(alice.get(f"/console/runs/{run.run_id}").text)
    for site in ("same-site", "cross-site"):
        answer = alice.post(
            f"/console/runs/{run.run_id}/abort",
            data={"csrf": csrf, "reason": "x"},
            headers={"Sec-Fetch-Site": site},
        )
        assert answer.status_code == 403, site
    assert web.saga.store.head(run.run_id).state.value == "running"  # type: ignore[union-attr]
    run.abort("test over")


def test_the_login_page_shows_only_its_own_messages(web: Web) -> None:
    """``?error=`` picks one of the page's messages; free text in the link is never shown."""
    client = web.client()
    phishing = "Session expired: paste your token at https://evil.example/saga"
    page = client.get("/console/login", params={"error": phishing}).text
    assert "evil.example" not in page and "Log in again." in page
    assert "unknown or revoked" in client.get("/console/login?error=token").text
    assert 'role="alert"' not in client.get("/console/login").text


def test_a_failed_login_and_a_401_are_logged_without_the_token(
    web: Web, caplog: pytest.LogCaptureFixture
) -> None:
    """Each refusal leaves a warning naming the path and the peer, never the token's text."""
    client = web.client()
    wrong = "saga_000000000000_" + "x" * 43
    with caplog.at_level(logging.WARNING, logger="saga.web"):
        csrf = login_value(client.get("/console/login").text)
        answer = client.post("/console/login", data={"csrf": csrf, "token": wrong})
        assert "unknown or revoked" in answer.text
        assert web.client(wrong).get("/api/runs").status_code == 401
        assert web.client().get("/api/runs").status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "saga.web"]
    assert any("POST /console/login" in line for line in lines), lines
    assert sum("GET /api/runs" in line for line in lines) == 2, lines
    assert not any(wrong in line or "x" * 43 in line for line in lines)


def test_plain_http_with_secure_cookies_names_the_setting(web: Web) -> None:
    """Served over http:// on a host that is not local, the Secure login cookie does not
    come back: the refusal says which setting to change."""
    browser = TestClient(web.app, base_url="http://console.example")
    csrf = login_value(browser.get("/console/login").text)
    answer = browser.post("/console/login", data={"csrf": csrf, "token": web.read_token})
    assert answer.status_code == 403 and "SAGA_API_SECURE_COOKIES" in answer.text


def test_a_link_into_the_console_lands_there_after_logging_in(web: Web) -> None:
    """A page opened logged out goes to the login form and, logged in, back to that page;
    a ``next`` leading off the console (another host, a scheme) lands on the runs."""
    run = web.saga.start_run()
    browser = web.client()
    page = f"/console/runs/{run.run_id}"
    away = browser.get(page, follow_redirects=False)
    assert away.status_code == 303
    form = browser.get(away.headers["location"]).text
    assert f'name="next" value="{page}"' in form
    answer = browser.post(
        "/console/login",
        data={"csrf": login_value(form), "token": web.read_token, "next": page},
        follow_redirects=False,
    )
    assert (answer.status_code, answer.headers["location"]) == (303, page)
    for bad in ("//evil.example/x", "https://evil.example", "/console/\\evil", "/elsewhere"):
        again = web.client()
        csrf = login_value(again.get("/console/login").text)
        answer = again.post(
            "/console/login",
            data={"csrf": csrf, "token": web.read_token, "next": bad},
            follow_redirects=False,
        )
        assert answer.headers["location"] == "/console/runs", bad
    run.abort("test over")


# -- headers and rough edges ------------------------------------------------------------------


def test_console_pages_and_api_answers_carry_security_headers(web: Web) -> None:
    """Every console page: not stored, a CSP of its own files, no framing, no sniffing, no
    referrer; the API's answers too (but the CSP); the static files may be cached."""
    bob = web.console(web.read_token)
    for path in ("/console/runs", "/console/login", "/console/escalations"):
        headers = bob.get(path).headers
        assert headers["cache-control"] == "no-store", path
        assert "default-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"
    api = web.client(web.read_token).get("/api/runs").headers
    assert api["cache-control"] == "no-store" and api["x-content-type-options"] == "nosniff"
    static = bob.get("/console/static/console.js").headers
    assert "cache-control" not in static and static["x-content-type-options"] == "nosniff"


def test_the_error_page_is_titled_with_its_status(web: Web) -> None:
    bob = web.console(web.read_token)
    page = bob.get("/console/runs/no-such-run")
    assert page.status_code == 404 and "<title>404 · saga</title>" in page.text


def test_escalations_all_is_a_real_boolean(web: Web) -> None:
    """``all=0`` lists open ones only (box unticked), ``all=1`` ticks it, nonsense is a 422."""
    bob = web.console(web.read_token)
    assert "checked" not in _all_box(bob.get("/console/escalations?all=0").text)
    assert "checked" not in _all_box(bob.get("/console/escalations?all=false").text)
    assert "checked" in _all_box(bob.get("/console/escalations?all=1").text)
    assert bob.get("/console/escalations?all=maybe").status_code == 422


def _all_box(page: str) -> str:
    start = page.index('name="all"')
    return page[start : page.index(">", start)]


def test_a_malformed_correction_field_is_a_422(web: Web, fresh_world: None) -> None:
    """``fix.3`` (no argument) and ``fix.².x`` (a superscript digit) say which field is wrong."""
    run_id = web.escalated_run()
    alice = web.console(web.operate_token)
    page = alice.get(f"/console/escalations/{run_id}:0")
    csrf = login_value(page.text)
    for field in ("fix.3", "fix.².amount", "fix..amount", "fix.-1.amount"):
        answer = alice.post(
            f"/console/escalations/{run_id}:0/requeue/preview",
            data={"csrf": csrf, field: "1"},
        )
        assert answer.status_code == 422 and "no such argument" in answer.text, field


# -- live streams (a real ``saga serve``) -----------------------------------------------------


class Stream:
    """A live stream read in a thread: its status and its lines as they come."""

    def __init__(self, url: str, cookie: str) -> None:
        self.status: int | None = None
        self.lines: list[str] = []
        self.closed = threading.Event()
        self._url, self._cookie = url, cookie
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream(
                "GET",
                self._url,
                headers={"Cookie": self._cookie},
                timeout=httpx.Timeout(30, read=60),
            ) as answer:
                self.status = answer.status_code
                for line in answer.iter_lines():
                    self.lines.append(line)
                    if self._stop.is_set():
                        return
        finally:
            self.closed.set()

    def stop(self) -> None:
        self._stop.set()

    def events(self) -> list[str]:
        return [x.removeprefix("event: ") for x in self.lines if x.startswith("event: ")]


def _cookie(server: str, token: str) -> str:
    """A console login over http://127.0.0.1, cookies sent back by hand (they are Secure)."""
    with httpx.Client(base_url=server, timeout=30) as http:
        form = http.get("/console/login")
        login = form.headers["set-cookie"].split(";", 1)[0]
        answer = http.post(
            "/console/login",
            data={"csrf": login_value(form.text), "token": token},
            headers={"Cookie": login},
        )
        assert answer.status_code == 303, answer.text
        return answer.headers["set-cookie"].split(";", 1)[0]


@pytest.fixture
def streams() -> Iterator[list[Stream]]:
    opened: list[Stream] = []
    yield opened
    for stream in opened:
        stream.stop()


def test_a_stream_of_an_unknown_run_is_a_404(web: Web, server: str) -> None:
    cookie = _cookie(server, web.read_token)
    answer = httpx.get(f"{server}/console/runs/no-such-run/events", headers={"Cookie": cookie})
    assert answer.status_code == 404


def test_a_stream_ends_at_once_on_logout_and_on_revoke(
    web: Web, server: str, streams: list[Stream]
) -> None:
    """Two open streams: one session logs out, the other's token is revoked; each sends
    ``end`` and closes, and neither sends the run's next section."""
    run = web.saga.start_run()
    url = f"{server}/console/runs/{run.run_id}/events"
    name, text = _token(web)
    revoked, leaving = _cookie(server, text), _cookie(server, web.read_token)
    streams += [Stream(url, revoked), Stream(url, leaving)]
    for stream in streams:
        wait_until(lambda s=stream: "update" in s.events(), timeout=30, what="the first update")
    # When the one token is revoked and the other session logs out
    tokens.revoke(web.saga.records, name)
    with httpx.Client(base_url=server, timeout=30) as http:
        csrf = login_value(http.get("/console/runs", headers={"Cookie": leaving}).text)
        out = http.post("/console/logout", data={"csrf": csrf}, headers={"Cookie": leaving})
        assert out.status_code == 303
    # Then both end, having sent nothing more
    for stream in streams:
        assert stream.closed.wait(30), stream.lines
        assert stream.events() == ["update", "end"], stream.lines
    # And the revoked token's sessions are forgotten
    assert web.saga.store.client.zcard(WEB_TOKEN_SESSIONS_PREFIX + text.split("_")[1]) == 0
    run.abort("test over")


def test_a_session_holds_a_few_streams_then_429(web: Web, server: str) -> None:
    """``streams_per_session`` streams open on one login; one more is a 429; once one is
    closed by its browser, a new one is accepted."""
    run = web.saga.start_run()
    path = f"/console/runs/{run.run_id}/events"
    cookie = _cookie(server, web.read_token)
    port = int(server.rsplit(":", 1)[1])
    opened = [_raw_stream(port, path, cookie) for _ in range(WebSettings().streams_per_session)]
    try:
        assert [status for status, _ in opened] == [200] * len(opened)
        assert httpx.get(server + path, headers={"Cookie": cookie}, timeout=30).status_code == 429
        # When one browser goes away, its place is free again (once the stream notices)
        opened.pop(0)[1].close()

        def one_more() -> bool:
            opened.append(_raw_stream(port, path, cookie))
            return opened[-1][0] == 200

        wait_until(one_more, timeout=30, what="a stream accepted once one closed")
    finally:
        for _, sock in opened:
            sock.close()
        run.abort("test over")


def _raw_stream(port: int, path: str, cookie: str) -> tuple[int, socket.socket]:
    """A stream opened on a socket of its own (closed by the caller): its status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nCookie: {cookie}\r\n\r\n".encode())
    head = sock.recv(64).decode("latin-1")
    if not head.startswith("HTTP/1.1 200"):
        sock.close()
    return int(head.split(" ", 2)[1]), sock


def test_a_stream_ends_cleanly_when_its_run_vanishes(
    web: Web, server: str, streams: list[Stream]
) -> None:
    """The run's keys gone with no record (expired before the reaper recorded it): the
    stream sends ``end`` instead of dying mid-body."""
    run = web.saga.start_run()
    streams.append(
        Stream(f"{server}/console/runs/{run.run_id}/events", _cookie(server, web.read_token))
    )
    wait_until(lambda: "update" in streams[0].events(), timeout=30, what="the first update")
    # When its keys vanish (what expiry does) before any record
    web.saga.store.client.delete(*run_keys(run.run_id), agent_key(run.run_id))
    assert streams[0].closed.wait(30), streams[0].lines
    assert streams[0].events() == ["update", "end"]
