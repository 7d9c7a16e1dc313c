"""Free text at every entry point, on PostgreSQL: the longest accepted value is recorded as
given; anything longer, or stranger than a text column can hold (NUL, a lone surrogate, a
control character in a name), is refused where it enters, naming the field, with nothing
changed. A record refused by the database once is refused on every attempt, so the run's keys
would never expire and the reaper would trip on it every pass: that must never start.

A private deployment (Redis, a worker) records to a PostgreSQL schema of this test's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from saga import InvalidTextError, RunState
from saga.agents import launch
from saga.client import Client
from saga.validation import NAME_MAX_LENGTH, TEXT_MAX_LENGTH
from tasks import systems
from tests.conftest import postgres_schema
from tests.integration.helpers import demo_steps, wait_until
from tests.reliability.conftest import Private

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgres]

#: What a person may well type: accents, typographic quotes, CJK, an emoji (4 bytes in UTF-8).
UNICODE = "Zoë’s refund — ✓ 退款 🧾 "
STRANGE = {
    "NUL": "ops\x00admin",
    "lone surrogate": "ops \ud800",
    "newline": "ops\nadmin",
    "escape": "ops\x1b[31m",
}


def longest(length: int) -> str:
    return (UNICODE * (length // len(UNICODE) + 1))[:length]


@pytest.fixture
def env(private: Callable[..., Private]) -> Iterator[Private]:
    with postgres_schema("free_text") as (_, url):
        made = private(extra_env={"SAGA_DATABASE_URL": url})
        made.worker(concurrency=2)
        yield made
        made.saga.records.dispose()


@pytest.fixture
def client(env: Private) -> Iterator[Client]:
    made = Client(broker_url=env.url + "/0", redis_url=env.url + "/0", settings=env.saga.settings)
    yield made
    made.store.client.close()


def recorded(env: Private, run_id: str, state: RunState) -> Any:
    return wait_until(
        lambda: (r := env.saga.records.run(run_id)) is not None and r.state == state.value and r,
        60,
        f"run {run_id} recorded {state.value}",
    )


def escalated(env: Private) -> str:
    """A credit issued, the run aborted, its reversal failing for good."""
    run = env.saga.start_run()
    demo_steps(run, upto=2)
    systems.set_down("reversal")
    run.abort("the customer cancelled")
    recorded(env, run.run_id, RunState.ESCALATED)
    return run.run_id


def test_who_and_why_of_a_resolve_or_requeue_are_recorded_or_refused(env: Private) -> None:
    """``by`` (a 200-character column) and the note: each refused when too long or strange,
    nothing changed; then the longest of each is recorded exactly."""
    run_id = escalated(env)
    [row] = env.saga.records.escalations(run_id)
    note = longest(TEXT_MAX_LENGTH)
    bad_by = [longest(NAME_MAX_LENGTH + 1), *STRANGE.values()]
    for by in bad_by:
        with pytest.raises(InvalidTextError, match="by"):
            env.saga.resolve_escalation(row.escalation_id, note="called them", by=by)
        with pytest.raises(InvalidTextError, match="by"):
            env.saga.requeue_failed_compensations(run_id, by=by, corrections={})
    for bad_note in (longest(TEXT_MAX_LENGTH + 1), STRANGE["NUL"], STRANGE["lone surrogate"]):
        with pytest.raises(InvalidTextError, match="note"):
            env.saga.resolve_escalation(row.escalation_id, note=bad_note, by="ops")
    assert env.saga.records.escalation(row.escalation_id).resolved is False
    assert env.saga.records.actions(run_id) == []

    by = longest(NAME_MAX_LENGTH)
    resolved = env.saga.resolve_escalation(row.escalation_id, note=note, by=by)

    assert (resolved.resolved_by, resolved.resolution) == (by, note)
    [action] = env.saga.records.actions(run_id)
    assert (action.by, action.note) == (by, note)
    wait_until(lambda: (h := env.saga.store.head(run_id)) is not None and h.recorded, 30, "kept")


def test_a_web_apps_agent_input_and_reasons_are_recorded_or_refused(
    env: Private, client: Client
) -> None:
    """A 64-character agent name, the longest input and abort reason are recorded; a longer
    or stranger one is refused before anything exists; a person's ``by`` likewise."""
    agent = "a" + "b" * 63
    for bad in ("a" + "b" * 64, "Refund", "refund me", "réfund", "refund\x00", ""):
        with pytest.raises(InvalidTextError, match="agent name"):
            client.enqueue_run(bad, "Hello.")
    for bad in (STRANGE["NUL"], STRANGE["lone surrogate"]):
        with pytest.raises(InvalidTextError, match="input"):
            client.enqueue_run("refund", bad)
    assert env.saga.store.active_runs() == []

    text = longest(20_000)  # the input is bounded in bytes: max_payload_bytes
    # Past the client's check (no worker hosts it), as a run of a deploy to come; nobody
    # plays its turns here.
    run_id = launch.enqueue_run(env.saga.store, client.app, agent, text)
    for bad in (longest(2001), STRANGE["NUL"], STRANGE["lone surrogate"]):
        with pytest.raises(InvalidTextError, match="reason"):
            client.abort_run(run_id, bad)
    for by in (longest(NAME_MAX_LENGTH + 1), STRANGE["NUL"], STRANGE["newline"]):
        with pytest.raises(InvalidTextError, match="by"):
            client.approve(run_id, "1:0", args_hash="0" * 64, by=by)
    with pytest.raises(InvalidTextError, match="reason"):
        client.deny(run_id, "1:0", STRANGE["NUL"], args_hash="0" * 64, by="ops")
    assert env.saga.picture(run_id).state is RunState.RUNNING

    reason = longest(2000)
    env.saga.run(run_id).abort(reason)  # as abort_run would, unwound on the tools' worker
    row = recorded(env, run_id, RunState.COMPENSATED)

    assert (row.agent, row.reason) == (agent, f"aborted: {reason}")
    transcript = env.saga.records.transcript(run_id)
    assert transcript is not None and transcript.agent == agent
    assert transcript.transcript["input"] == text


def test_a_nul_a_tool_or_model_wrote_is_recorded_not_refused(env: Private) -> None:
    """Text nobody typed (an error message, a reason built from one) may hold a NUL: the
    record keeps it as U+FFFD rather than failing on every attempt."""
    run = env.saga.start_run()
    demo_steps(run, upto=1)
    env.saga.abort(run.run_id, "the model said: stop\x00now")  # the library's own call

    row = recorded(env, run.run_id, RunState.COMPENSATED)

    assert row.reason == "aborted: the model said: stop\ufffdnow"
