"""The notice's signature, settings, body and HTTP post (to a server on the loopback)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import UTC, datetime

import pytest

from saga import Settings
from saga.errors import ConfigurationError, NotificationError, SignatureError
from saga.notifications import (
    SCHEMA_VERSION,
    NotifySettings,
    notification_body,
    sign,
    verify,
)
from saga.notifications.sinks import encode, post
from saga.records import EscalationRecord

SECRET = "s3cret"
BODY = b'{"id":"run-1:0","schema_version":1}'
NOW = 1_700_000_000


def test_a_signed_body_verifies_and_returns_its_timestamp() -> None:
    header = sign(BODY, SECRET, timestamp=NOW)
    assert header.startswith(f"t={NOW},v1=")
    assert verify(BODY, header, SECRET, now=NOW + 10) == NOW


@pytest.mark.parametrize(
    ("body", "secret", "now", "problem"),
    [
        (BODY + b" ", SECRET, NOW, "does not match"),  # the body was changed
        (BODY, "other", NOW, "does not match"),  # signed with another key
        (BODY, SECRET, NOW + 301, "tolerance 300s"),  # replayed after the window
        (BODY, SECRET, NOW - 301, "tolerance 300s"),  # a clock far ahead
    ],
)
def test_a_changed_body_another_key_or_an_old_timestamp_is_refused(
    body: bytes, secret: str, now: int, problem: str
) -> None:
    with pytest.raises(SignatureError, match=problem):
        verify(body, sign(BODY, SECRET, timestamp=NOW), secret, now=now)


@pytest.mark.parametrize("header", [None, "", "v1=abc", f"t={NOW}", "t=soon,v1=abc"])
def test_a_missing_or_malformed_header_is_refused(header: str | None) -> None:
    with pytest.raises(SignatureError):
        verify(BODY, header, SECRET, now=NOW)


def test_any_of_several_signatures_may_match_while_a_key_is_rotated() -> None:
    old = sign(BODY, "old-key", timestamp=NOW)
    new = sign(BODY, SECRET, timestamp=NOW).split(",")[1]
    assert verify(BODY, f"{old},{new}", SECRET, now=NOW) == NOW


def test_the_signature_covers_the_timestamp() -> None:
    """Moving the timestamp forward (to pass the window) breaks the signature."""
    digest = sign(BODY, SECRET, timestamp=NOW).split(",")[1]
    with pytest.raises(SignatureError, match="does not match"):
        verify(BODY, f"t={NOW + 600},{digest}", SECRET, now=NOW + 600)


def test_no_sink_is_configured_by_default() -> None:
    assert NotifySettings().sinks == ()


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"webhook_url": "http://hooks.example.com/x", "webhook_secret": "k"}, "https://"),
        ({"webhook_url": "https://hooks.example.com/x"}, "without SAGA_NOTIFY_WEBHOOK_SECRET"),
        ({"callable": "mymodule"}, "package.module:function"),
        ({"timeout": 0}, "SAGA_NOTIFY_TIMEOUT"),
        ({"attempts": 0}, "SAGA_NOTIFY_ATTEMPTS"),
    ],
)
def test_unsafe_or_incomplete_settings_are_refused(
    settings: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        NotifySettings(**settings)  # type: ignore[arg-type]


def test_http_is_allowed_to_a_loopback_address_only() -> None:
    local = NotifySettings(webhook_url="http://127.0.0.1:8080/hook", webhook_secret="k")
    assert local.sinks == ("webhook",)


def test_settings_are_read_from_the_environment_and_never_print_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAGA_NOTIFY_WEBHOOK_URL", "https://hooks.example.com/saga")
    monkeypatch.setenv("SAGA_NOTIFY_WEBHOOK_SECRET", "very-secret")
    monkeypatch.setenv("SAGA_NOTIFY_CALLABLE", "ops.pager:page")
    monkeypatch.setenv("SAGA_NOTIFY_ATTEMPTS", "5")
    settings = NotifySettings.from_env()
    assert settings.sinks == ("callable", "webhook")
    assert settings.retry.attempts == 5
    assert "very-secret" not in repr(settings)


def test_the_body_is_the_escalation_with_a_schema_version() -> None:
    record = EscalationRecord(
        escalation_id="run-1:0",
        run_id="run-1",
        reason="compensation failed",
        cause="step 3 failed",
        created_at=datetime(2024, 5, 1, tzinfo=UTC),
        steps_done=[{"step": 2, "tool": "issue_credit"}],
        stack=[{"step": 2, "tool": "reverse_credit"}],
        failed_compensations=[],
        not_undone=[{"step": 2, "why": "its compensation failed"}],
        resolved=False,
        resolution="",
    )
    body = notification_body(record)
    assert body["schema_version"] == SCHEMA_VERSION == 1
    assert body["id"] == body["escalation_id"] == "run-1:0"
    assert body["created_at"] == "2024-05-01T00:00:00+00:00"
    # the escalation package a person reads with `saga escalation show`, nothing less
    assert body["kind"] == body["type"] == "saga.escalation"
    assert body["why"]["kind"] == "compensation_failed"
    assert body["live"][0]["why"] == "its compensation failed"
    assert "saga requeue run-1" in body["commands"]["requeue"]
    assert encode(body) == encode(dict(reversed(list(body.items()))))  # keys sorted


def test_settings_never_print_the_webhooks_path_nor_a_urls_password() -> None:
    """A chat webhook's URL is itself a credential; a password may hold '/', ':' or '@'."""
    notify = NotifySettings(
        webhook_url="https://hooks.example.com/services/T0/B0/tokenpart", webhook_secret="k"
    )
    assert "tokenpart" not in repr(notify) and "hooks.example.com" in repr(notify)
    settings = Settings(
        redis_url="redis://saga:pa/ss:w@rd@redis:6379/2",
        database_url="postgresql+psycopg://saga:s3/cr@t@db:5432/saga",
        notifications=notify,
    )
    shown = repr(settings)
    for secret in ("pa/ss", "w@rd", "s3/cr", "tokenpart"):
        assert secret not in shown
    assert "redis://saga:***@redis:6379/2" in shown and "@db:5432/saga" in shown


class _Dripper:
    """A webhook that answers one byte at a time, each well within the socket timeout: it
    never lets urllib's per-operation timeout fire. Says whether the client hung up on it."""

    def __init__(self, interval: float, total: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/hook"
        self.interval, self.total = interval, total
        self.cut_off = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        connection, _ = self.server.accept()
        with connection:
            connection.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Slow: " + b"x" * self.total
            try:
                for byte in answer:
                    connection.sendall(bytes([byte]))
                    time.sleep(self.interval)
                connection.sendall(b"\r\n\r\n")
            except OSError:
                self.cut_off.set()
                return
            if connection.recv(1) == b"":  # the client closed its end before the answer ended
                self.cut_off.set()

    def close(self) -> None:
        self.server.close()
        self.thread.join(30)


def test_a_webhook_that_drips_its_answer_is_cut_off_at_the_timeout() -> None:
    """The timeout bounds the whole POST, not each read: a receiver dripping its answer past
    it is cut off (and the notice's lease, the timeout plus a margin, is never outlived)."""
    dripper = _Dripper(interval=0.2, total=40)  # about 10 s of answer, a byte every 0.2 s
    settings = NotifySettings(webhook_url=dripper.url, webhook_secret="k", timeout=1.0)
    try:
        with pytest.raises(NotificationError, match=r"did not answer within 1s"):
            post(settings, {"id": "run-1:0"}, "run-1:0:webhook", 1)
        assert dripper.cut_off.wait(15), "the POST was not cut off"
    finally:
        dripper.close()
