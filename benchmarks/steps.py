"""The four steps' work and the two undos, as plain functions over ``tasks.systems``: what the
bare chain, the saga tools and the DBOS workflow all do (one idempotency key per step), so the
peers benchmark compares the engines and nothing else. No saga import: the DBOS driver, in its
own virtualenv, imports this too.

The failing path's fourth step asks the mail system as ``send_mail`` does, then is refused for
good (no retry helps): ``bounce``.
"""

from __future__ import annotations

from typing import Any

from tasks import systems

ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"
STATUSES = ("waiting_on_customer", "open")
SUBJECT, BODY = "Your credit", "We credited $1.00 to order 4921."
AMOUNT_CENTS = 100


class BouncedError(Exception):
    """The mail system refused the message for good: nothing was sent, no retry helps."""

    retryable = False


def get_order(order_id: int) -> dict[str, Any]:
    return systems.get_order(order_id)


def issue_credit(order_id: int, amount_cents: int, key: str) -> dict[str, Any]:
    return systems.issue_credit(order_id, amount_cents, f"{key}:2", "bench")


def set_ticket_status(ticket_id: int, status: str, key: str) -> dict[str, Any]:
    return systems.set_ticket_status(ticket_id, status, f"{key}:3")


def send_reply(to: str, key: str) -> dict[str, Any]:
    return systems.send_mail(to, SUBJECT, BODY, f"{key}:4")


def bounce(to: str, key: str) -> None:
    """The failing fourth step in every mode: the mail system is asked, and says no."""
    systems.check_service("mail")
    raise BouncedError(f"mailbox {to} unavailable ({key})")


def restore_status(ticket_id: int, status: str, key: str) -> dict[str, Any]:
    return systems.set_ticket_status(ticket_id, status, f"{key}:3:undo")


def reverse_credit(credit_id: str, key: str) -> dict[str, Any]:
    return systems.reverse_credit(credit_id, f"{key}:2:undo")


def drive_saga(saga: Any, i: int, fail: bool, timeout: float) -> Any:
    """One saga run of these steps, driven as an agent drives it (each result read before
    the next call); failing, it waits for the unwind. Returns the run's last picture."""
    from saga.errors import StepFailedError

    run = saga.start_run()
    order = run.call("get_order", order_id=ORDER).result(timeout)
    run.call("issue_credit", order_id=order["order_id"], amount_cents=AMOUNT_CENTS).result(timeout)
    run.call("set_ticket_status", ticket_id=TICKET, status=STATUSES[i % 2]).result(timeout)
    tool = "send_reply_bounced" if fail else "send_reply"
    mail = run.call(tool, to=order["customer_email"], subject=SUBJECT, body=BODY)
    if not fail:
        mail.result(timeout)
        return run.finish(timeout)
    try:
        mail.result(timeout)
    except StepFailedError:
        ended = run.wait(timeout)
        if ended.state.value == "compensated":
            return ended
    raise RuntimeError(f"run {run.run_id} did not fail and compensate")
