"""Small, bounded helpers for tests that drive a real worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from saga import Run, RunPicture, StepFailedError
from saga.constants import run_keys
from saga.stack import RunStore

ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"
CREDIT = 250_000


def wait_until(condition: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll until ``condition()`` is truthy; fail the test (never hang) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def demo_steps(run: Run, upto: int = 4) -> list[Any]:
    """The seed's sequence: get_order, issue_credit, set_ticket_status, send_reply.

    Returns the results of the steps that succeeded; stops at the first that failed.
    """
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_order", {"order_id": ORDER}),
        ("issue_credit", {"order_id": ORDER, "amount_cents": CREDIT, "memo": "late delivery"}),
        ("set_ticket_status", {"ticket_id": TICKET, "status": "pending_refund"}),
        ("send_reply", {"to": EMAIL, "subject": "Your credit", "body": "We credited $2,500."}),
    ]
    results = []
    for tool, args in calls[:upto]:
        try:
            results.append(run.call(tool, **args).result(timeout=20))
        except StepFailedError:
            break
    return results


def compensated_steps(picture: RunPicture) -> list[int]:
    """Steps whose compensation is confirmed done, in the order they were confirmed."""
    done = [c for c in picture.compensations if c.state.value == "done"]
    return [c.step for c in sorted(done, key=lambda c: c.settled_at or 0.0)]


def moved_after_reading(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run moves on just after its next whole reading (``RunStore.picture``): its version
    bumped, as another process's transition landing right then would. The run ids so read."""
    real, moved = store.picture, []

    def then_moved(run_id: str) -> RunPicture | None:
        picture = real(run_id)
        if not moved:
            moved.append(run_id)
            store.client.hincrby(run_keys(run_id)[0], "version", 1)
        return picture

    monkeypatch.setattr(store, "picture", then_moved)
    return moved
