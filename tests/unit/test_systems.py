"""The three fake systems must behave like real ones for the saga demo to prove anything.

Idempotency keys must make redelivery harmless, a reversal must add a line rather than erase
one, and a fault switch flipped in one process must be felt by every other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tasks import systems

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SAGA_DEMO_DATA", str(tmp_path))
    systems.reset()
    yield tmp_path
    systems.dispose_engines()


def _python(code: str, data: Path) -> subprocess.Popen[str]:
    """Start a separate interpreter on the same data directory, as a worker process would be."""
    env = {**os.environ, "SAGA_DEMO_DATA": str(data), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def test_seed_data(data: Path) -> None:
    assert systems.get_order(4921) == {
        "order_id": 4921,
        "customer_email": "ada@example.com",
        "total_cents": 499900,
        "currency": "USD",
    }
    assert systems.get_ticket(9104) == {"ticket_id": 9104, "order_id": 4921, "status": "open"}
    assert systems.ledger() == []
    assert systems.outbox() == []
    assert {p.name for p in data.glob("*.db")} == {"billing.db", "tickets.db", "outbox.db"}


def test_unknown_things_are_not_found_and_not_retryable(data: Path) -> None:
    with pytest.raises(systems.NotFoundError):
        systems.get_order(1)
    with pytest.raises(systems.NotFoundError):
        systems.get_ticket(1)
    with pytest.raises(systems.NotFoundError):
        systems.issue_credit(1, 100, "k")
    assert systems.NotFoundError.retryable is False
    assert systems.ServiceUnavailableError.retryable is True


def test_credit_is_idempotent_per_key(data: Path) -> None:
    first = systems.issue_credit(4921, 2500, "credit-1", memo="late delivery")
    again = systems.issue_credit(4921, 2500, "credit-1", memo="late delivery")
    assert first == again
    assert first["credit_id"] == f"cr_4921_{first['entry_id']}"
    assert first["amount_cents"] == 2500
    [line] = systems.ledger(4921)
    assert line["kind"] == "credit"
    assert line["memo"] == "late delivery"
    assert isinstance(line["created_at"], str)


@pytest.mark.parametrize("amount", [0, -5, 499901])
def test_credit_amount_must_be_positive_and_within_total(data: Path, amount: int) -> None:
    with pytest.raises(ValueError):
        systems.issue_credit(4921, amount, "bad")
    assert systems.ledger() == []


def test_reversal_appends_a_negative_line_and_keeps_the_credit(data: Path) -> None:
    credit = systems.issue_credit(4921, 2500, "credit-1")
    reversal = systems.reverse_credit(credit["credit_id"], "undo-1")
    assert reversal["credit_id"] == credit["credit_id"]
    assert reversal["amount_cents"] == -2500
    assert reversal["reversal_id"] == f"rv_4921_{reversal['entry_id']}"
    original, undo = systems.ledger()
    assert (original["kind"], original["amount_cents"]) == ("credit", 2500)
    assert (undo["kind"], undo["amount_cents"]) == ("reversal", -2500)
    assert undo["reverses_entry_id"] == original["entry_id"]
    assert sum(line["amount_cents"] for line in systems.ledger()) == 0


def test_reversal_is_idempotent_and_happens_once_per_credit(data: Path) -> None:
    credit = systems.issue_credit(4921, 2500, "credit-1")
    first = systems.reverse_credit(credit["credit_id"], "undo-1")
    assert systems.reverse_credit(credit["credit_id"], "undo-1") == first
    assert systems.reverse_credit(credit["credit_id"], "undo-2") == first
    assert len(systems.ledger()) == 2


def test_reversing_an_unknown_credit_is_not_found(data: Path) -> None:
    for credit_id in ("cr_4921_99", "cr_1_1", "nonsense"):
        with pytest.raises(systems.NotFoundError):
            systems.reverse_credit(credit_id, f"undo-{credit_id}")
    assert systems.ledger() == []


def test_a_key_names_one_kind_of_action(data: Path) -> None:
    credit = systems.issue_credit(4921, 100, "same-key")
    with pytest.raises(ValueError):
        systems.reverse_credit(credit["credit_id"], "same-key")
    systems.send_mail("ada@example.com", "hi", "body", "outbox-key")
    with pytest.raises(ValueError):
        systems.post_webhook("https://hooks.example.com", {}, "outbox-key")


def test_ticket_status_reports_previous_and_is_idempotent(data: Path) -> None:
    first = systems.set_ticket_status(9104, "resolved", "t-1")
    assert first == {"ticket_id": 9104, "previous": "open", "status": "resolved"}
    assert systems.set_ticket_status(9104, "resolved", "t-1") == first
    assert systems.set_ticket_status(9104, "escalated", "t-1") == first
    assert systems.get_ticket(9104)["status"] == "resolved"
    restored = systems.set_ticket_status(9104, "open", "t-2")
    assert restored["previous"] == "resolved"
    history = systems.ticket_history(9104)
    assert [(h["from_status"], h["to_status"]) for h in history] == [
        ("open", "resolved"),
        ("resolved", "open"),
    ]
    assert [h["idempotency_key"] for h in history] == ["t-1", "t-2"]
    with pytest.raises(systems.NotFoundError):
        systems.set_ticket_status(1, "open", "t-3")


def test_outbox_is_idempotent_per_key(data: Path) -> None:
    mail = systems.send_mail("ada@example.com", "Your credit", "Sorry.", "mail-1")
    assert systems.send_mail("ada@example.com", "Your credit", "Sorry.", "mail-1") == mail
    assert mail == {
        "message_id": mail["message_id"],
        "to": "ada@example.com",
        "subject": "Your credit",
    }
    hook = systems.post_webhook("https://hooks.example.com/c", {"order": 4921}, "hook-1")
    assert systems.post_webhook("https://hooks.example.com/c", {"order": 4921}, "hook-1") == hook
    assert hook["url"] == "https://hooks.example.com/c"
    rows = systems.outbox()
    assert [r["channel"] for r in rows] == ["mail", "webhook"]
    assert json.loads(rows[1]["body"]) == {"order": 4921}
    assert f"msg_{rows[0]['id']}" == mail["message_id"]
    assert f"wh_{rows[1]['id']}" == hook["delivery_id"]


def test_down_service_raises_and_writes_nothing(data: Path) -> None:
    credit = systems.issue_credit(4921, 100, "credit-1")
    systems.set_down("billing")
    with pytest.raises(systems.ServiceUnavailableError, match="billing is down"):
        systems.issue_credit(4921, 200, "credit-2")
    # Down means no answer at all, not even the stored result of an earlier call.
    with pytest.raises(systems.ServiceUnavailableError):
        systems.issue_credit(4921, 100, "credit-1")
    assert len(systems.ledger()) == 1
    systems.get_order(4921)  # orders is a separate service and still up
    systems.set_down("billing", False)
    assert systems.issue_credit(4921, 100, "credit-1") == credit


@pytest.mark.parametrize(
    ("service", "call"),
    [
        ("orders", lambda: systems.get_order(4921)),
        ("reversal", lambda: systems.reverse_credit("cr_4921_1", "r")),
        ("tickets", lambda: systems.set_ticket_status(9104, "closed", "t")),
        ("mail", lambda: systems.send_mail("a@example.com", "s", "b", "m")),
        ("webhook", lambda: systems.post_webhook("https://x.example.com", {}, "w")),
    ],
)
def test_every_operation_checks_its_service(
    data: Path, service: str, call: Callable[[], object]
) -> None:
    systems.set_down(service)
    with pytest.raises(systems.ServiceUnavailableError, match=f"{service} is down"):
        call()
    assert systems.get_ticket(9104)["status"] == "open"
    assert systems.outbox() == []


def test_fail_next_fails_exactly_that_many_times(data: Path) -> None:
    systems.fail_next("mail", 2)
    messages = []
    for _ in range(2):
        with pytest.raises(systems.ServiceUnavailableError) as caught:
            systems.send_mail("ada@example.com", "s", "b", "mail-1")
        messages.append(str(caught.value))
    assert messages == ["mail failed (injected, 1 left)", "mail failed (injected, 0 left)"]
    assert systems.outbox() == []
    systems.send_mail("ada@example.com", "s", "b", "mail-1")
    systems.send_mail("ada@example.com", "s", "b", "mail-2")
    assert len(systems.outbox()) == 2


def test_delay_slows_the_service(data: Path) -> None:
    systems.set_delay("tickets", 0.3)
    started = time.monotonic()
    systems.set_ticket_status(9104, "pending", "t-1")
    assert time.monotonic() - started >= 0.3
    systems.set_delay("tickets", 0)
    started = time.monotonic()
    systems.set_ticket_status(9104, "open", "t-2")
    assert time.monotonic() - started < 0.3


def test_a_switch_flipped_in_another_process_is_seen_here(data: Path) -> None:
    systems.get_ticket(9104)  # open an engine first, so its pool could hold a stale view
    code = "from tasks import systems; systems.set_down('mail'); systems.fail_next('tickets', 1)"
    _finish(_python(code, data))
    with pytest.raises(systems.ServiceUnavailableError, match="mail is down"):
        systems.send_mail("ada@example.com", "s", "b", "mail-1")
    with pytest.raises(systems.ServiceUnavailableError, match="tickets failed"):
        systems.set_ticket_status(9104, "closed", "t-1")
    systems.set_ticket_status(9104, "closed", "t-1")
    _finish(_python("from tasks import systems; systems.clear_switches()", data))
    systems.send_mail("ada@example.com", "s", "b", "mail-1")


def test_concurrent_redelivery_credits_once(data: Path) -> None:
    code = (
        "import json; from tasks import systems; "
        "print(json.dumps(systems.issue_credit(4921, 700, 'shared-key')))"
    )
    procs = [_python(code, data) for _ in range(6)]
    results = [json.loads(_finish(proc)) for proc in procs]
    assert all(result == results[0] for result in results)
    assert [line["amount_cents"] for line in systems.ledger()] == [700]


def test_unknown_service_is_a_value_error(data: Path) -> None:
    for switch in (systems.set_down, systems.check_service):
        with pytest.raises(ValueError, match="known services: billing, mail"):
            switch("payments")
    with pytest.raises(ValueError):
        systems.fail_next("payments", 1)
    with pytest.raises(ValueError):
        systems.set_delay("payments", 1.0)


def test_reset_clears_switches_and_data(data: Path) -> None:
    systems.issue_credit(4921, 100, "credit-1")
    systems.set_down("orders")
    systems.reset()
    assert systems.get_order(4921)["total_cents"] == 499900
    assert systems.ledger() == []


def test_snapshot_shows_all_three_systems(data: Path) -> None:
    systems.issue_credit(4921, 100, "credit-1")
    systems.send_mail("ada@example.com", "s", "b", "mail-1")
    snap = systems.snapshot()
    assert set(snap) == {"ledger", "tickets", "outbox"}
    assert len(snap["ledger"]) == 1
    assert snap["tickets"] == [{"ticket_id": 9104, "order_id": 4921, "status": "open"}]
    assert len(snap["outbox"]) == 1
    json.dumps(snap)


def test_data_dir_is_read_on_every_call(
    data: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    systems.issue_credit(4921, 100, "credit-1")
    other = tmp_path_factory.mktemp("other")
    monkeypatch.setenv("SAGA_DEMO_DATA", str(other))
    assert systems.data_dir() == other
    systems.reset()
    assert systems.ledger() == []
    monkeypatch.setenv("SAGA_DEMO_DATA", str(data))
    assert len(systems.ledger()) == 1
