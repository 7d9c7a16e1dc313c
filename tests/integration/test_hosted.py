"""The agent loop hosted on real workers: a threads-pool worker plays the turns
(``-Q saga.turns``), the session's prefork worker runs the tools, and the test talks to both
only as a web app would (``saga.client``). Agents: ``tests/integration/hosted_app.py``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from saga.agents import launch
from saga.client import Client, RunStatus
from saga.constants import AGENTS_KEY, agent_key, turn_lease_key
from saga.errors import (
    ApprovalError,
    InvalidRunOptionError,
    MessageNotSentError,
    RunEndedError,
    SagaError,
    UnknownAgentError,
    UnknownRunError,
)
from saga.testing import WorkerProcess
from tasks import systems
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(turn_worker: WorkerProcess, saga: Any, redis_url: str) -> Iterator[Client]:
    made = Client(redis_url=redis_url)  # the broker: the session's SAGA_BROKER_URL
    yield made
    made.store.client.close()


def ended(client: Client, run_id: str, timeout: float = 30.0) -> RunStatus:
    """The run once it has ended and its record is written (bounded)."""

    def done() -> RunStatus | None:
        status = client.get_run(run_id)
        recorded = client.store.head(run_id)
        ok = status.state in ("completed", "compensated", "escalated", "failed_to_start")
        return status if ok and recorded is not None and recorded.recorded else None

    found: RunStatus = wait_until(done, timeout, f"run {run_id} to end")
    return found


def results(status: RunStatus, turn: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = status.turns[turn - 1]["results"]
    return found


def test_the_credit_scenario_recovers_from_an_early_reply(client: Client, saga: Any) -> None:
    """The reply asked for beside the credit is refused and fed back; sent next turn; done."""
    run_id = client.enqueue_run("refund", "Order 4921 arrived late: refund it.")

    status = ended(client, run_id)

    assert status.state == "completed" and status.ended == "final answer"
    assert [s["tool"] for s in status.steps] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert all(s["state"] == "succeeded" for s in status.steps)
    refused = results(status, 2)[0]
    assert refused["is_error"] and "irreversible (class 5)" in refused["content"]["error"]
    assert status.turns[2]["calls"][0]["step"] == 4  # reissued: the pivot
    assert status.pivot_step == 4 and status.model_calls == 4
    assert status.final_text.startswith("I credited $2,500")
    assert len(systems.outbox()) == 1 and len(systems.ledger()) == 1
    record = saga.records.transcript(run_id)
    assert record is not None and record.model_calls == 4
    assert [t["turn"] for t in record.transcript["turns"]] == [1, 2, 3, 4]


def test_unknown_tools_and_bad_arguments_go_back_to_the_model(client: Client) -> None:
    """Nothing is dispatched; each call gets an error it can act on; the run completes."""
    status = ended(client, client.enqueue_run("mistakes", "Refund everything."))

    assert status.state == "completed" and status.steps == []
    unknown, bad, broken = (r["content"]["error"] for r in results(status, 1))
    assert unknown.startswith("unknown tool 'refund_everything'; you may call: get_order")
    assert "amount_cents" in bad and "valid integer" in bad
    assert "not valid JSON" in broken


def test_a_reversible_call_past_the_pivot_is_refused_and_fed_back(client: Client) -> None:
    """The dispatcher's own refusal (CallRefusedError) reaches the model, not the operator."""
    status = ended(client, client.enqueue_run("after_pivot", "Reply, then credit."))

    assert status.state == "completed"
    assert "past its pivot" in results(status, 2)[0]["content"]["error"]
    assert [s["tool"] for s in status.steps] == ["send_reply"]


def test_a_rejected_call_is_fed_back_without_unwinding(client: Client) -> None:
    """ToolRejected: the step is rejected, nothing happened, the model asks for less."""
    status = ended(client, client.enqueue_run("rejected", "Credit the whole order twice."))

    assert status.state == "completed"
    assert [s["state"] for s in status.steps] == ["rejected", "succeeded"]
    assert "exceeds order total" in results(status, 1)[0]["content"]["error"]
    assert [e["amount_cents"] for e in systems.ledger()] == [250_000]


def test_refusals_past_the_limit_unwind_the_run(client: Client) -> None:
    """Two refusals in a row are allowed here; the third aborts and the credit is reversed."""
    status = ended(client, client.enqueue_run("stubborn", "Refund."))

    assert status.state == "compensated"
    assert "3 refused or failed calls in a row" in status.ended
    assert len(status.turns) == 4
    assert [e["kind"] for e in systems.ledger()] == ["credit", "reversal"]


def test_a_failed_write_unwinds_the_run(client: Client) -> None:
    """The seed's rule: the ticket update fails for good, so the credit is reversed."""
    status = ended(client, client.enqueue_run("failed_write", "Refund."))

    assert status.state == "compensated"
    assert [s["state"] for s in status.steps] == ["succeeded", "failed"]
    assert [e["kind"] for e in systems.ledger()] == ["credit", "reversal"]
    assert len(status.turns) == 2  # no turn after the failure


def test_a_failed_read_is_fed_back(client: Client) -> None:
    """A read that fails changed nothing: the model is told and tries the right order."""
    status = ended(client, client.enqueue_run("failed_read", "Look the order up."))

    assert status.state == "completed"
    assert [s["state"] for s in status.steps] == ["rejected", "succeeded"]
    assert "order 1 not found" in results(status, 1)[0]["content"]["error"]


def test_a_write_failure_is_fed_back_when_the_agent_says_so(client: Client) -> None:
    """The per-tool override: a failed ticket update is told, and the run completes."""
    status = ended(client, client.enqueue_run("told_about_writes", "Refund."))

    assert status.state == "completed"
    assert [s["state"] for s in status.steps] == ["succeeded", "rejected"]


def test_the_turn_limit_finishes_the_run_when_asked_to(client: Client) -> None:
    """max_turns=2 with on_limit=finish: completed with what it did, no third model call."""
    status = ended(client, client.enqueue_run("turn_limit", "Look forever."))

    assert status.state == "completed" and status.ended == "turn limit: 2 turns"
    assert status.model_calls == 2


def test_the_same_run_id_twice_starts_one_run(client: Client) -> None:
    """enqueue_run is idempotent on run_id; another agent under the same id is refused."""
    run_id = uuid.uuid4().hex
    assert client.enqueue_run("refund", "Refund.", run_id=run_id) == run_id
    assert client.enqueue_run("refund", "Refund.", run_id=run_id) == run_id

    status = ended(client, run_id)

    assert status.state == "completed" and status.model_calls == 4
    with pytest.raises(SagaError, match="already exists"):
        client.enqueue_run("mistakes", "Other.", run_id=run_id)
    assert run_id in [r.run_id for r in client.list_runs(agent="refund")]


def test_a_web_app_can_abort_a_run_while_its_model_thinks(client: Client) -> None:
    """abort_run stops the loop at once; the unwind runs on the workers; a second abort is
    refused, and an unknown run says so."""
    run_id = client.enqueue_run("slow", "Take your time.")
    wait_until(lambda: client.get_run(run_id).model_calls == 1, 10, "the model to be asked")

    client.abort_run(run_id, "the customer cancelled")
    status = ended(client, run_id)

    assert status.state == "compensated" and status.steps == []
    assert status.reason.startswith("aborted: the customer cancelled")
    with pytest.raises(RunEndedError):
        client.abort_run(run_id)
    with pytest.raises(UnknownRunError):
        client.get_run(uuid.uuid4().hex)


def test_an_agent_no_worker_hosts_is_refused_where_it_enters(client: Client) -> None:
    """The workers publish the agents they host: a typo is refused by the web app's call,
    and nothing is created."""
    run_id = uuid.uuid4().hex
    with pytest.raises(UnknownAgentError, match="no worker hosts an agent 'no_such_agent'"):
        client.enqueue_run("no_such_agent", "Hello.", run_id=run_id)
    with pytest.raises(UnknownRunError):
        client.get_run(run_id)


def test_a_run_of_an_agent_its_turn_worker_does_not_host_fails_to_start(client: Client) -> None:
    """Past the client's check (no agents published yet, or a deploy that dropped it), the
    turn worker ends the run failed_to_start: nothing ran, so it is no compensation."""
    run_id = launch.enqueue_run(client.store, client.app, "no_such_agent", "Hello.")
    status = ended(client, run_id)

    assert status.state == "failed_to_start" and status.steps == []
    assert "failed to start: no agent 'no_such_agent' is declared" in status.reason
    assert status.ended == status.reason


def test_a_web_app_starts_runs_on_their_agents_deadline(client: Client, saga: Any) -> None:
    """client.enqueue_run takes the deadline the workers published for the agent (not
    SAGA_RUN_DEADLINE), unless the caller gives one."""
    own = client.enqueue_run("patient", "Hello.")
    given = client.enqueue_run("patient", "Hello.", deadline=30)

    assert (client.store.head(own) or pytest.fail()).deadline == 7
    assert (client.store.head(given) or pytest.fail()).deadline == 30
    assert ended(client, own).state == "completed"


def test_a_run_enqueued_before_any_worker_published_gets_its_agents_deadline_at_turn_one(
    client: Client, saga: Any
) -> None:
    """A web app that enqueues before any worker said which agents it hosts cannot know the
    agent's deadline: the run starts on SAGA_RUN_DEADLINE, and the turn worker gives it the
    agent's own as it plays the first turn (before an approval or the reaper is judged by it)."""
    published = client.store.client.hgetall(AGENTS_KEY)
    client.store.client.delete(AGENTS_KEY)
    try:
        run_id = client.enqueue_run("patient", "Hello.")
        assert ended(client, run_id).state == "completed"
    finally:
        client.store.client.hset(AGENTS_KEY, mapping=published)

    assert client.settings.run_deadline_seconds != 7
    assert (client.store.head(run_id) or pytest.fail()).deadline == 7
    assert client.store.client.hget(agent_key(run_id), "deadline_open") is None


def test_a_turn_the_broker_refuses_is_a_clear_error_and_the_same_call_again_sends_it(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run is created, then the broker refuses its first turn: the web app gets a
    MessageNotSentError saying so (not kombu's own error), and enqueue_run again with the
    same id sends the turn; the run completes once."""
    from kombu.exceptions import OperationalError

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("Error 111 connecting to the broker")

    run_id = f"refused-{uuid.uuid4().hex[:8]}"
    with monkeypatch.context() as patched:
        patched.setattr(client.app, "send_task", refused)
        with pytest.raises(MessageNotSentError, match="again with the same run id") as refused:
            client.enqueue_run("refund", "Order 4921 arrived late: refund it.", run_id=run_id)
    assert (refused.value.run_id, refused.value.applied) == (run_id, "created")
    assert "Error 111" not in str(refused.value)  # the broker's address stays in the log
    assert client.get_run(run_id).state == "running"

    assert client.enqueue_run("refund", "Order 4921 arrived late: refund it.", run_id=run_id)
    assert ended(client, run_id).state == "completed"


@pytest.mark.parametrize("deadline", [0, False, -1, float("nan"), float("inf"), "60"])
def test_a_deadline_that_is_no_positive_number_is_refused(client: Client, deadline: Any) -> None:
    """0 or False are not "the default": they are refused, and no run is created."""
    run_id = uuid.uuid4().hex
    with pytest.raises(InvalidRunOptionError, match="deadline"):
        client.enqueue_run("refund", "Hello.", run_id=run_id, deadline=deadline)
    with pytest.raises(UnknownRunError):
        client.get_run(run_id)


def test_results_each_within_the_limit_reach_the_model_together(client: Client) -> None:
    """Three results, each within the payload limit and over it together, are shown to the
    model (they are held to the transcript's limit), not a crash on every delivery."""
    status = ended(client, client.enqueue_run("big_statuses", "Make the statuses long."))

    assert status.state == "completed" and status.final_text == "Saw 3 results."
    assert [s["state"] for s in status.steps] == ["succeeded"] * 3


def test_waiting_for_another_askers_lease_spends_no_model_retry(client: Client) -> None:
    """A turn that waited on another delivery's lease still has its model retries: one 429
    afterwards is retried (the agent allows two attempts in all)."""
    run_id = uuid.uuid4().hex
    lease = turn_lease_key(run_id, 1)
    client.store.client.set(lease, "another-delivery", px=5000)  # held for ~3 lease waits
    client.enqueue_run("flaky", f"Finish run {run_id}.", run_id=run_id)

    status = ended(client, run_id, timeout=40)

    assert status.state == "completed" and status.final_text == "Done after one 429."
    assert status.model_calls == 2


# -- real formats: the SDK clients over a fake provider -----------------------------------------

WRITES = ["get_order", "issue_credit", "set_ticket_status", "send_reply"]
FORMATS = pytest.mark.parametrize("fmt", ["openai_chat", "openai_responses", "anthropic"])


def enqueue(client: Client, fmt: str, scenario: str) -> str:
    run_id = uuid.uuid4().hex
    return client.enqueue_run(fmt, f"{scenario} {run_id}", run_id=run_id)


@FORMATS
def test_parallel_calls_are_dispatched_in_the_models_order(client: Client, fmt: str) -> None:
    """Three calls in one answer are three steps in that order; the reply next; done."""
    status = ended(client, enqueue(client, fmt, "parallel"))

    assert status.state == "completed"
    assert [s["tool"] for s in status.steps] == WRITES
    assert [c["step"] for c in status.turns[0]["calls"]] == [1, 2, 3]
    assert status.usage == {"input_tokens": 1200, "output_tokens": 150}


@FORMATS
def test_an_early_reply_is_refused_then_sent_once_the_writes_settled(
    client: Client, fmt: str
) -> None:
    """The seed's scenario in each format: the reply beside the credit is refused and told,
    the model asks again next turn, and it goes out once, as the pivot."""
    status = ended(client, enqueue(client, fmt, "early_reply"))

    assert status.state == "completed" and status.model_calls == 4
    assert [s["tool"] for s in status.steps] == WRITES
    refused = results(status, 2)[0]
    assert refused["is_error"] and "irreversible (class 5)" in refused["content"]["error"]
    assert status.pivot_step == 4
    assert len(systems.outbox()) == 1 and len(systems.ledger()) == 1


@FORMATS
def test_an_unknown_tool_and_bad_arguments_are_told_to_the_model(client: Client, fmt: str) -> None:
    """Nothing is dispatched; each call gets an error it can act on in the format's result."""
    status = ended(client, enqueue(client, fmt, "mistakes"))

    assert status.state == "completed" and status.steps == []
    unknown, bad = (r["content"]["error"] for r in results(status, 1))
    assert unknown.startswith("unknown tool 'refund_everything'; you may call: get_order")
    assert "amount_cents" in bad and "valid integer" in bad
    assert status.final_text == "I could not do it."


@FORMATS
def test_a_429_is_retried_after_its_retry_after(client: Client, fmt: str) -> None:
    """The rate-limited turn is asked again (Retry-After: 2 s) and the run completes."""
    status = ended(client, enqueue(client, fmt, "rate_limited"))

    assert status.state == "completed"
    assert status.model_calls == 3  # the 429, the answer, the final answer
    assert len(status.turns) == 2


@FORMATS
def test_a_400_ends_the_run_and_unwinds_it(client: Client, fmt: str) -> None:
    """A request the provider refuses will never succeed: abort, and the credit is reversed."""
    status = ended(client, enqueue(client, fmt, "bad_request"))

    assert status.state == "compensated"
    assert "model call failed with HTTP 400" in status.ended
    assert status.model_calls == 2
    assert [e["kind"] for e in systems.ledger()] == ["credit", "reversal"]


# -- approval of irreversible calls ------------------------------------------------------------


def awaiting(client: Client, run_id: str) -> dict[str, Any]:
    status: RunStatus = wait_until(
        lambda: (s := client.get_run(run_id)).awaiting_approval and s, 20, "an approval request"
    )
    [pending] = status.pending_approvals
    assert status.steps == [] and status.to_dict()["awaiting_approval"] is True
    return pending


def test_an_approved_reply_goes_out_once_and_the_approval_is_single_use(client: Client) -> None:
    """The run waits with the exact arguments; only their hash approves them, once: the
    same decision again is told it was applied already, another decision is refused."""
    run_id = client.enqueue_run("approver", "Tell Ada.")
    pending = awaiting(client, run_id)
    assert (pending["id"], pending["tool"]) == ("1:0", "send_reply")
    assert pending["arguments"]["to"] == "ada@example.com"

    with pytest.raises(ApprovalError, match="not the ones awaiting approval"):
        client.approve(run_id, "1:0", args_hash="0" * 64, by="ops@acme")
    assert client.approve(run_id, "1:0", args_hash=pending["args_hash"], by="ops@acme")
    status = ended(client, run_id)

    assert status.state == "completed" and status.final_text == "Sent."
    assert len(systems.outbox()) == 1
    assert not client.approve(run_id, "1:0", args_hash=pending["args_hash"], by="ops@acme")
    with pytest.raises(ApprovalError, match="decided already"):
        client.approve(run_id, "1:0", args_hash=pending["args_hash"], by="ops@other")
    with pytest.raises(ApprovalError, match="decided already"):
        client.deny(run_id, "1:0", "no", args_hash=pending["args_hash"], by="ops@acme")
    assert len(systems.outbox()) == 1


def test_a_denied_reply_is_fed_back_to_the_model(client: Client) -> None:
    """deny() is the model's result: nothing is sent and the run goes on."""
    run_id = client.enqueue_run("approver", "Tell Ada.")
    pending = awaiting(client, run_id)

    client.deny(run_id, "1:0", "wrong tone", args_hash=pending["args_hash"], by="ops@acme")
    status = ended(client, run_id)

    assert status.state == "completed"
    assert status.final_text == "Not sent: a person (ops@acme) declined send_reply: wrong tone"
    assert systems.outbox() == []


def test_a_denial_moves_on_a_turn_whose_other_call_settled_long_before(client: Client) -> None:
    """The read beside the waiting reply settled while its turn could not end; the turn sent
    again by deny() has nothing left to dispatch, so it must end the turn itself."""
    run_id = client.enqueue_run("approver_and_read", "Tell Ada.")

    def read_settled_reply_waits() -> dict[str, Any] | None:
        status = client.get_run(run_id)
        settled = [(s["tool"], s["state"]) for s in status.steps] == [("get_order", "succeeded")]
        return status.pending_approvals[0] if settled and status.pending_approvals else None

    pending: dict[str, Any] = wait_until(read_settled_reply_waits, 20, "the read, then a request")
    client.deny(run_id, "1:0", "wrong tone", args_hash=pending["args_hash"], by="ops@acme")
    status = ended(client, run_id)

    assert status.state == "completed"
    assert status.final_text == "Not sent: a person (ops@acme) declined send_reply: wrong tone"
    assert [s["call"] for s in status.steps] == ["1:1"]
    assert systems.outbox() == []


def test_a_pending_approval_expires_with_the_run_deadline(client: Client, saga: Any) -> None:
    """Past the run's deadline the reaper wakes the turn, which tells the model it expired."""
    run_id = client.enqueue_run("approver", "Tell Ada.", deadline=2)
    pending = awaiting(client, run_id)
    time.sleep(2.2)

    with pytest.raises(ApprovalError, match="expired"):
        client.approve(run_id, "1:0", args_hash=pending["args_hash"], by="late@acme")
    assert run_id in saga.reap().resumed
    status = ended(client, run_id)

    assert status.final_text == "Not sent: nobody approved send_reply in time; the request expired"
    assert systems.outbox() == []


def test_unanswered_approvals_expire_without_spending_the_runs_revivals(
    client: Client, saga: Any
) -> None:
    """Five requests nobody answers: each expires at the run's deadline and is fed back
    (the reaper moves the run on without counting a revival); the run then completes."""
    run_id = client.enqueue_run("asks_again", "Tell Ada.", deadline=1)

    for expired in range(1, 6):
        awaiting(client, run_id)
        time.sleep(1.05)
        report = saga.reap(now=saga.store.now() + 2)
        assert run_id in report.resumed and run_id not in report.abandoned
        wait_until(
            lambda n=expired: (
                client.get_run(run_id).state != "running" or len(client.get_run(run_id).turns) > n
            ),
            20,
            f"turn {expired + 1}",
        )
    status = ended(client, run_id)

    assert status.state == "completed" and status.final_text == "Nobody approved; I gave up."
    assert [r["is_error"] for t in status.turns[:5] for r in t["results"]] == [True] * 5
    assert systems.outbox() == []
