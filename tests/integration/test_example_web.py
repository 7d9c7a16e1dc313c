"""The support form example (``examples/support_form``) against real workers: the form
enqueues a hosted run, the progress page follows it to its end, and a call that waits for a
person is approved or denied from the page. The app talks to the workers only through
``saga.client``, as it would deployed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient

from examples.support_form.app import create_app
from saga.client import Client
from saga.testing import WorkerProcess
from tasks import systems
from tests.conftest import ROOT
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(60)
FORM = {"order": "4921", "email": "ada@example.com", "message": "It came two weeks late."}


@pytest.fixture
def saga_client(turn_worker: WorkerProcess, saga: Any, redis_url: str) -> Iterator[Client]:
    made = Client(redis_url=redis_url)  # the broker: the session's SAGA_BROKER_URL
    yield made
    made.store.client.close()


def browser(saga_client: Client, agent: str) -> FlaskClient:
    app = create_app(saga_client, agent=agent)
    app.testing = True
    return app.test_client()


def submit(web: FlaskClient) -> str:
    """Send the form; the answer is at once a redirect to the run's page."""
    response = web.post("/runs", data=FORM)
    assert response.status_code == 303
    found = re.fullmatch(r"/runs/(\w+)", response.headers["Location"])
    assert found is not None
    return found.group(1)


def progress(web: FlaskClient, run_id: str) -> dict[str, Any]:
    response = web.get(f"/runs/{run_id}.json")
    assert response.status_code == 200
    found: dict[str, Any] = response.get_json()
    return found


def until_ended(web: FlaskClient, run_id: str) -> dict[str, Any]:
    """Poll the JSON view as the page's reload would, bounded."""
    ended: dict[str, Any] = wait_until(
        lambda: (p := progress(web, run_id))["state"] != "running" and p,
        30,
        f"run {run_id} to end",
    )
    return ended


def awaiting(web: FlaskClient, run_id: str) -> dict[str, Any]:
    status: dict[str, Any] = wait_until(
        lambda: (p := progress(web, run_id))["awaiting_approval"] and p, 20, "an approval request"
    )
    [pending] = status["pending_approvals"]
    return dict(pending)


def decide(web: FlaskClient, run_id: str, pending: dict[str, Any], **fields: str) -> Any:
    form = {"approval_id": pending["id"], "args_hash": pending["args_hash"], **fields}
    return web.post(f"/runs/{run_id}/decision", data=form)


def test_the_form_starts_the_refund_and_the_page_follows_it_to_the_end(
    saga_client: Client,
) -> None:
    """The demo's refund agent: four steps, the reply once the writes settled, completed."""
    web = browser(saga_client, "refund")
    assert b"Late or damaged order?" in web.get("/").data
    run_id = submit(web)

    status = until_ended(web, run_id)

    assert status["state"] == "completed"
    assert [s["tool"] for s in status["steps"]] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert status["input"].startswith("Order 4921, from ada@example.com")
    page = web.get(f"/runs/{run_id}").get_data(as_text=True)
    assert "Your request: completed" in page and 'http-equiv="refresh"' not in page
    assert page.count('class="step"') == 4 and "I credited $2,500" in page
    assert "reverse credit" in page  # the stack the run would have unwound
    assert len(systems.ledger()) == 1 and len(systems.outbox()) == 1


def test_an_approved_reply_goes_out(saga_client: Client) -> None:
    """The page shows the waiting call with its buttons and stops reloading; approving it
    from the page sends the reply, once."""
    web = browser(saga_client, "approver")
    run_id = submit(web)
    pending = awaiting(web, run_id)
    page = web.get(f"/runs/{run_id}").get_data(as_text=True)
    assert "Approve send_reply?" in page and pending["args_hash"] in page
    assert 'http-equiv="refresh"' not in page

    response = decide(web, run_id, pending, decision="approve", by="ops@acme")
    status = until_ended(web, run_id)

    assert response.status_code == 303
    assert status["state"] == "completed" and status["final_text"] == "Sent."
    assert len(systems.outbox()) == 1
    # Single use: the same decision again is applied already (nothing goes out twice), and
    # anyone else's is refused.
    again = decide(web, run_id, pending, decision="approve", by="ops@acme")
    assert again.status_code == 303 and len(systems.outbox()) == 1
    other = decide(web, run_id, pending, decision="approve", by="someone@acme")
    assert other.status_code == 409


def test_a_denied_reply_is_not_sent_and_the_agent_is_told_why(saga_client: Client) -> None:
    web = browser(saga_client, "approver")
    run_id = submit(web)
    pending = awaiting(web, run_id)

    decide(web, run_id, pending, decision="deny", by="ops@acme", reason="wrong tone")
    status = until_ended(web, run_id)

    assert status["state"] == "completed"
    assert status["final_text"] == "Not sent: a person (ops@acme) declined send_reply: wrong tone"
    assert systems.outbox() == []


def test_bad_requests_are_refused_before_reaching_the_workers(saga_client: Client) -> None:
    """An unknown run is a 404; a form without an order, or a decision without a name,
    a 400; arguments other than the ones shown, a 409."""
    web = browser(saga_client, "approver")
    assert web.get("/runs/no-such-run").status_code == 404
    assert web.get("/runs/no-such-run.json").status_code == 404
    assert web.post("/runs", data={**FORM, "order": ""}).status_code == 400
    run_id = submit(web)
    pending = awaiting(web, run_id)

    assert decide(web, run_id, pending, decision="approve", by="").status_code == 400
    forged = {**pending, "args_hash": "0" * 64}
    assert decide(web, run_id, forged, decision="approve", by="ops@acme").status_code == 409
    decide(web, run_id, pending, decision="deny", by="ops@acme", reason="test over")
    assert until_ended(web, run_id)["state"] == "completed"


def test_the_app_imports_no_tool_code() -> None:
    """Deployable apart from the workers: importing it loads neither the tools nor Celery
    tasks of the demo app."""
    probe = (
        "import sys, examples.support_form.app\n"
        "print(sorted(m for m in sys.modules if m == 'tasks' or m.startswith('tasks.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
