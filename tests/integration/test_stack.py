"""The compensation stack in a real Redis, driven script by script the way a worker drives it.

No worker and no broker: every call below is one of the Lua scripts a worker, the dispatcher or
the unwind would run, so each fence (duplicate success, unwind ownership, conclusion, requeue) is
proven on its own.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from saga import payload
from saga.constants import (
    LOOK_AFTER_EXPIRY,
    agent_key,
    compensation_idempotency_key,
    run_keys,
    settled_key,
)
from saga.errors import StoreUnavailableError
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.rules import gate_for
from saga.stack import ChainPush, Conclusion, Outcome, RunPicture, RunStore
from tests.conftest import TEST_STORE

RETENTION = 60
DEADLINE = 900.0

NewRun = Callable[..., str]


@pytest.fixture
def store(redis_url: str) -> Iterator[RunStore]:
    run_store = RunStore.from_url(redis_url, retention_seconds=RETENTION)
    yield run_store
    run_store.client.close()


@pytest.fixture
def new_run(store: RunStore) -> Iterator[NewRun]:
    """Create runs with fresh ids; delete all their keys afterwards."""
    created: list[str] = []

    def make(allow_after_pivot: bool = False, agent: str = "") -> str:
        """``agent``: a hosted run of that agent (its loop's hash too), else one of run.call."""
        run_id = uuid.uuid4().hex
        assert store.create(
            run_id,
            deadline=DEADLINE,
            allow_after_pivot=allow_after_pivot,
            agent=agent,
            input_json="hi" if agent else "",
        )
        created.append(run_id)
        return run_id

    yield make
    for run_id in created:
        store.client.delete(*run_keys(run_id), agent_key(run_id))
        store.forget(run_id)


# -- helpers: what a dispatcher and a worker do --------------------------------------------


def reserve(store: RunStore, run_id: str, tool: str, tool_class: ToolClass) -> int:
    """The dispatcher's half: reserve the next step behind the class's gate."""
    args = json.dumps({"tool": tool})
    outcome = store.reserve(run_id, tool, tool_class, args, gate_for(tool_class))
    assert outcome.status == "ok", outcome
    return int(outcome.values[0])


LEASE = 30.0
#: The claim of each compensation's latest execution, as the worker that began it holds it.
_CLAIMS: dict[tuple[str, int], str] = {}


def begin(store: RunStore, run_id: str, step: int) -> Outcome:
    """A delivery of the step's own message (its reserved tool and arguments) begins it."""
    tool, args = store.client.hmget(run_keys(run_id)[1], [f"{step}:tool", f"{step}:args"])
    claim = uuid.uuid4().hex
    return store.begin_step(run_id, step, str(tool or "x"), str(args or "{}"), claim, LEASE)


def begin_comp(store: RunStore, run_id: str, step: int, unwind: str | None = None) -> Outcome:
    """The current owner's chain (or ``unwind``'s) begins the compensation of ``step``."""
    claim = uuid.uuid4().hex
    _CLAIMS[(run_id, step)] = claim
    owner = store.owner(run_id) if unwind is None else unwind
    return store.begin_compensation(run_id, step, claim, "task", owner, LEASE)


def record_comp(
    store: RunStore, run_id: str, step: int, outcome: str, error: dict[str, Any] | None = None
) -> str:
    """The execution that began it records its outcome (done, failed, retrying)."""
    event = {"failed": "fail", "retrying": "retry"}.get(outcome, outcome)
    claim = _CLAIMS.get((run_id, step), "")
    return store.record_compensation(run_id, step, event, error, claim=claim).status


def conclude(
    store: RunStore, run_id: str, state: RunState, reason: str = "", owner: str | None = None
) -> Outcome:
    """The unwind's owner (by default the current one) concludes the run."""
    return store.conclude(run_id, state, reason, store.owner(run_id) if owner is None else owner)


def start(store: RunStore, run_id: str, tool: str, tool_class: ToolClass) -> int:
    """Reserve a step and begin it, as the worker that picks it up would."""
    step = reserve(store, run_id, tool, tool_class)
    began = begin(store, run_id, step)
    assert began.status == "run", began
    return step


def entry_json(run_id: str, step: int, tool: str) -> str:
    """The stack entry a worker pushes for a step whose tool has a compensation."""
    entry = {
        "step": step,
        "idempotency_key": compensation_idempotency_key(run_id, step),
        "tool": tool,
        "args": {"ref": f"ref-{step}"},
        "description": f"{tool} for step {step}",
    }
    return payload.dumps(entry, what="undo", limit=10_000)


def succeed(
    store: RunStore, run_id: str, step: int, undo: str = "", *, pivot: bool = False
) -> Outcome:
    result = payload.dumps({"step": step, "ok": True}, what="result", limit=10_000)
    entry = entry_json(run_id, step, undo) if undo else ""
    return store.record_success(run_id, step, result, entry, pivot)


def fail(store: RunStore, run_id: str, step: int, message: str = "boom") -> Outcome:
    return store.record_failure(run_id, step, {"type": "RuntimeError", "message": message})


def run_hash(store: RunStore, run_id: str) -> dict[str, str]:
    return store.client.hgetall(run_keys(run_id)[0])  # type: ignore[return-value]


def stack_of(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in store.client.lrange(run_keys(run_id)[3], 0, -1)]  # type: ignore[union-attr]


def version(store: RunStore, run_id: str) -> int:
    return int(run_hash(store, run_id)["version"])


def three_writes_and_abort(store: RunStore, run_id: str) -> None:
    """Three undoable writes succeed, then the run is aborted: an unwind with three entries."""
    for tool, klass in [
        ("issue_credit", ToolClass.COMPENSATABLE_WRITE),
        ("set_ticket_status", ToolClass.REVERSIBLE_WRITE),
        ("hold_stock", ToolClass.COMPENSATABLE_WRITE),
    ]:
        step = start(store, run_id, tool, klass)
        assert succeed(store, run_id, step, f"undo_{tool}").status == "ok"
    aborted = store.abort(run_id, "agent gave up")
    assert (aborted.status, aborted.owns_unwind) == ("ok", True)


# -- create / view -------------------------------------------------------------------------


def test_create_is_once_only_and_view_reads_the_new_run(store: RunStore, new_run: NewRun) -> None:
    """A run id is created once; its first view is running, version 0, nothing in flight."""
    run_id = new_run(allow_after_pivot=True)

    assert store.create(run_id, deadline=DEADLINE) is False
    view = store.view(run_id)
    assert view is not None
    assert (view.state, view.version, view.pivot_step, view.in_flight) == (
        RunState.RUNNING,
        "0",
        None,
        {},
    )
    assert view.allow_after_pivot is True
    assert store.view(uuid.uuid4().hex) is None
    assert store.picture(uuid.uuid4().hex) is None


# -- record_success ------------------------------------------------------------------------


def test_duplicated_success_pushes_once(store: RunStore, new_run: NewRun) -> None:
    """The same success recorded twice pushes one entry, bumps the version once, says dup."""
    # Given a running compensatable step
    run_id = new_run()
    step = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    before = version(store, run_id)

    # When its success is recorded twice (a redelivered message)
    first = succeed(store, run_id, step, "reverse_credit")
    second = succeed(store, run_id, step, "reverse_credit")

    # Then the second is a no-op
    assert first == Outcome("ok", (0, 0, 0))  # not late; not a hosted turn's last call
    assert second.status == "dup"
    assert second.owns_unwind is False
    assert store.client.llen(run_keys(run_id)[3]) == 1
    assert version(store, run_id) == before + 1
    picture = store.picture(run_id)
    assert picture is not None
    assert picture.step(step).state is StepState.SUCCEEDED
    assert picture.step(step).result == {"step": step, "ok": True}
    assert [c.step for c in picture.compensations] == [step]
    assert picture.compensations[0].state is CompensationState.PENDING
    assert store.view(run_id).in_flight == {}  # type: ignore[union-attr]


def test_success_without_an_undo_pushes_nothing(store: RunStore, new_run: NewRun) -> None:
    """A read or convergent write leaves the stack and the compensations empty."""
    run_id = new_run()
    step = start(store, run_id, "get_order", ToolClass.READ)

    assert succeed(store, run_id, step).status == "ok"

    picture = store.picture(run_id)
    assert picture is not None
    assert (picture.stack, picture.compensations) == ([], [])


def test_pivot_is_set_by_the_first_irreversible_success_only(
    store: RunStore, new_run: NewRun
) -> None:
    """Reversible successes do not move the pivot; the first irreversible one does, once."""
    # Given a reversible step that settled (no pivot yet), then two irreversible steps in flight
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, run_id, credit, "reverse_credit")
    assert store.view(run_id).pivot_step is None  # type: ignore[union-attr]
    mail = start(store, run_id, "send_reply", ToolClass.IRREVERSIBLE_WRITE)
    hook = start(store, run_id, "post_webhook", ToolClass.IRREVERSIBLE_WRITE)

    # When the later irreversible step settles first, then the earlier one
    succeed(store, run_id, hook, pivot=True)
    succeed(store, run_id, mail, pivot=True)

    # Then the pivot is the first to settle, and it stays there
    assert store.view(run_id).pivot_step == hook  # type: ignore[union-attr]
    assert run_hash(store, run_id)["pivot"] == str(hook)
    assert store.picture(run_id).pivot_step == hook  # type: ignore[union-attr]


def test_a_success_that_lands_on_a_failed_step_is_pushed_not_dropped(
    store: RunStore, new_run: NewRun
) -> None:
    """An effect landing on a step already judged failed is recorded, its undo on the stack."""
    # Given a step judged failed (its run unwinding, the unwind owned by that failure)
    run_id = new_run()
    step = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    fail(store, run_id, step)

    # When its effect lands after all
    late = succeed(store, run_id, step, "reverse_credit")

    # Then it is recorded and its undo pushed, for the unwind to send
    assert late.status == "ok"
    assert [e["step"] for e in stack_of(store, run_id)] == [step]
    assert store.picture(run_id).step(step).landed == "late"  # type: ignore[union-attr]


# -- unwind ownership ----------------------------------------------------------------------


def test_two_failures_start_one_unwind(store: RunStore, new_run: NewRun) -> None:
    """Steps 2 and 3 both fail: the first does not own (3 in flight), the last does."""
    # Given a read that succeeded and two writes in flight
    run_id = new_run()
    read = start(store, run_id, "get_order", ToolClass.READ)
    succeed(store, run_id, read)
    two = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    three = start(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    assert (two, three) == (2, 3)

    # When both fail
    first = fail(store, run_id, two, "credit api down")
    run_after_first = run_hash(store, run_id)
    second = fail(store, run_id, three, "tickets api down")

    # Then exactly one owns the unwind: the one that settled last
    assert [first.owns_unwind, second.owns_unwind] == [False, True]
    assert (first.status, second.status) == ("ok", "ok")
    assert run_after_first["state"] == "unwinding"
    assert run_after_first["owner"] == ""
    run = run_hash(store, run_id)
    assert (run["state"], run["owner"], run["sent"]) == ("unwinding", "step:3", "0")
    assert run["reason"] == "step 2 failed"
    assert store.owner(run_id) == "step:3"


def test_the_step_that_settles_last_owns_even_by_succeeding(
    store: RunStore, new_run: NewRun
) -> None:
    """A failure with a step still in flight waits; that step's success takes the unwind."""
    run_id = new_run()
    one = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    two = start(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)

    failed = fail(store, run_id, one)
    settled = succeed(store, run_id, two, "restore_status")

    assert failed.owns_unwind is False
    assert settled == Outcome("ok", (1, 0, 0))
    assert store.owner(run_id) == f"step:{two}"
    assert [e["step"] for e in stack_of(store, run_id)] == [two]


def test_redelivered_failure_owns_again_only_until_sent(store: RunStore, new_run: NewRun) -> None:
    """A redelivered errback resumes the unwind it owned and never sent, and nothing else."""
    # Given a single step that failed and so owns the unwind
    run_id = new_run()
    step = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    first = fail(store, run_id, step)
    assert first.owns_unwind is True
    before = version(store, run_id)

    # When the failure is delivered again before the chain was sent
    again = fail(store, run_id, step)

    # Then it is a duplicate that still owns the unwind, and nothing changed
    assert again.status == "dup"
    assert again.owns_unwind is True
    assert version(store, run_id) == before

    # When the owner marks the chain sent (a stranger cannot)
    assert store.mark_sent(run_id, "step:99") is False
    assert run_hash(store, run_id)["sent"] == "0"
    assert store.mark_sent(run_id, f"step:{step}") is True

    # Then a further redelivery no longer owns it
    late = fail(store, run_id, step)
    assert (late.status, late.owns_unwind) == ("dup", False)


def test_the_mark_pushes_the_unwinds_chain_for_its_owner_once(
    store: RunStore, new_run: NewRun
) -> None:
    """The unwind's first message, prepared, is pushed by the mark's script: only by the
    unwind's owner, and once however often the same call comes (a retried command)."""
    run_id = new_run()
    step = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    assert fail(store, run_id, step).owns_unwind is True
    queue = f"saga-test-queue:{{{run_id}}}"  # (in the run's slot, as a script's keys must be)
    push = ChainPush(queue, f"{run_id}:{step}:undo:a", "the first message")
    try:
        # A stranger's mark pushes nothing
        assert store.mark_sent(run_id, "step:99", push) is False
        assert store.client.llen(queue) == 0
        assert run_hash(store, run_id)["sent"] == "0"
        # The owner's pushes the message with the mark, and the same call again nothing more
        assert store.mark_sent(run_id, f"step:{step}", push) is True
        assert store.mark_sent(run_id, f"step:{step}", push) is True
        assert store.client.lrange(queue, 0, -1) == ["the first message"]
        assert run_hash(store, run_id)["sent"] == "1"
        # Another chain of the same owner (an undo pushed after the first was sent) is pushed
        later = ChainPush(queue, f"{run_id}:{step}:undo:b", "the later chain")
        assert store.mark_sent(run_id, f"step:{step}", later) is True
        assert store.client.lrange(queue, 0, -1) == ["the later chain", "the first message"]
    finally:
        store.client.delete(queue)


def test_the_final_failure_pushes_the_unwinds_chain_with_its_record_only_if_unmoved(
    store: RunStore, new_run: NewRun
) -> None:
    """The final failure's record pushes the chain made from the run as read before it, and
    marks it sent, only when the record makes the step the owner and the run is still at that
    reading's version; the same call again (its reply lost) pushes nothing more."""
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    assert succeed(store, run_id, credit, "reverse_credit").status == "ok"
    mail = start(store, run_id, "send_reply", ToolClass.COMPENSATABLE_WRITE)
    error = {"type": "RuntimeError", "message": "mail is down"}
    queue = f"saga-test-queue:{{{run_id}}}"  # (in the run's slot, as a script's keys must be)
    push = ChainPush(queue, f"{run_id}:{credit}:undo:a", "the first message")
    try:
        # A reading the run moved on from: the record stands and owns, nothing is pushed
        stale = str(version(store, run_id) - 1)
        moved = store.record_failure_and_push(run_id, mail, error, stale, push)
        assert (moved.status, moved.owns_unwind, moved.pushed) == ("ok", True, False)
        assert store.client.llen(queue) == 0
        assert run_hash(store, run_id)["sent"] == "0"
        picture = store.picture(run_id)
        assert picture is not None and picture.step(mail).state is StepState.FAILED
    finally:
        store.client.delete(queue)

    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    assert succeed(store, run_id, credit, "reverse_credit").status == "ok"
    mail = start(store, run_id, "send_reply", ToolClass.COMPENSATABLE_WRITE)
    queue = f"saga-test-queue:{{{run_id}}}"
    push = ChainPush(queue, f"{run_id}:{credit}:undo:b", "the first message")
    try:
        # The reading's version: recorded, owned, pushed and marked sent, as one
        read_at = str(version(store, run_id))
        outcome = store.record_failure_and_push(run_id, mail, error, read_at, push)
        assert (outcome.status, outcome.owns_unwind, outcome.pushed) == ("ok", True, True)
        assert store.client.lrange(queue, 0, -1) == ["the first message"]
        state = run_hash(store, run_id)
        assert (state["state"], state["owner"], state["sent"]) == ("unwinding", f"step:{mail}", "1")
        assert state["sent_chain"] == push.chain
        # The same call again: a duplicate that owns nothing and pushes nothing
        again = store.record_failure_and_push(run_id, mail, error, read_at, push)
        assert (again.status, again.owns_unwind, again.pushed) == ("dup", False, False)
        assert store.client.llen(queue) == 1
    finally:
        store.client.delete(queue)


def test_a_failure_with_another_step_in_flight_pushes_nothing(
    store: RunStore, new_run: NewRun
) -> None:
    """A step still in flight settles later and owns the unwind: the failure's record does
    not push the chain it was handed, whatever the version."""
    run_id = new_run()
    first = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    second = start(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    queue = f"saga-test-queue:{{{run_id}}}"
    push = ChainPush(queue, f"{run_id}:0:undo:a", "a chain")
    error = {"type": "RuntimeError", "message": "down"}
    try:
        read_at = str(version(store, run_id))
        outcome = store.record_failure_and_push(run_id, first, error, read_at, push)
        assert (outcome.status, outcome.owns_unwind, outcome.pushed) == ("ok", False, False)
        assert store.client.llen(queue) == 0
        assert fail(store, run_id, second).owns_unwind is True
    finally:
        store.client.delete(queue)


def test_an_undo_recorded_done_pushes_the_next_message_once(
    store: RunStore, new_run: NewRun
) -> None:
    """The next undo's message, prepared, is pushed by the script that records an undo done,
    only then: not on a repeat of that record, nor with a failure."""
    run_id = new_run()
    one = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, run_id, one, "reverse_credit")
    two = start(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    succeed(store, run_id, two, "restore_status")
    three = start(store, run_id, "send_reply", ToolClass.COMPENSATABLE_WRITE)
    assert fail(store, run_id, three).owns_unwind
    queue = f"saga-test-queue:{{{run_id}}}"  # (in the run's slot, as a script's keys must be)
    try:
        assert begin_comp(store, run_id, two).status == "run"
        claim = _CLAIMS[(run_id, two)]
        push = (queue, "the next undo")
        done = store.record_compensation(run_id, two, "done", None, claim, "", push)
        assert done.status == "ok"
        again = store.record_compensation(run_id, two, "done", None, claim, "", push)
        assert again.status == "dup"
        assert store.client.lrange(queue, 0, -1) == ["the next undo"]
        assert begin_comp(store, run_id, one).status == "run"
        error = {"type": "RuntimeError", "message": "no"}
        claim = _CLAIMS[(run_id, one)]
        failed = store.record_compensation(run_id, one, "fail", error, claim, "", push)
        assert failed.status == "ok"
        assert store.client.llen(queue) == 1
    finally:
        store.client.delete(queue)


def test_the_last_undos_record_makes_the_conclusion_judged_before_it_only_if_unmoved(
    store: RunStore, new_run: NewRun
) -> None:
    """A conclusion judged on the run as read before the last undo's record is made by that
    record's script only if the record leaves the run at the version it was judged for and
    took the undo's entry off the stack, for the chain's owner; otherwise the record stands
    alone, and a repeat of it is a duplicate."""

    def last_undo_running() -> tuple[str, int, str, str]:
        run_id = new_run()
        credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
        succeed(store, run_id, credit, "reverse_credit")
        mail = start(store, run_id, "send_reply", ToolClass.COMPENSATABLE_WRITE)
        assert fail(store, run_id, mail).owns_unwind
        assert store.mark_sent(run_id, f"step:{mail}")
        assert begin_comp(store, run_id, credit).status == "run"
        return run_id, credit, f"step:{mail}", _CLAIMS[(run_id, credit)]

    def recorded(run_id: str, credit: int) -> RunPicture:
        picture = store.picture(run_id)
        assert picture is not None
        assert [c.state for c in picture.compensations] == [CompensationState.DONE]
        return picture

    # Judged for the version the record leaves: recorded done and concluded, as one
    run_id, credit, owner, claim = last_undo_running()
    after = str(version(store, run_id) + 1)
    judged = Conclusion(RunState.COMPENSATED, "step 2 failed", owner, after)
    outcome = store.record_done_and_conclude(run_id, credit, claim, judged)
    assert outcome.status == "ok" and outcome.values[0] == "ok"
    picture = recorded(run_id, credit)
    assert picture.state is RunState.COMPENSATED and not picture.stack
    version_after, ended_at, reason = outcome.values[1:4]
    # the script's clock as it wrote it ('%.6f'), read as the number the run's picture holds
    assert (version_after, float(ended_at), reason) == (
        picture.version,
        picture.ended,
        "step 2 failed",
    )
    assert picture.compensations[0].settled_at == picture.ended
    assert store.record_done_and_conclude(run_id, credit, claim, judged).status == "dup"

    # The run moved on since the reading: recorded done, not concluded
    run_id, credit, owner, claim = last_undo_running()
    stale = Conclusion(RunState.COMPENSATED, "", owner, str(version(store, run_id)))
    outcome = store.record_done_and_conclude(run_id, credit, claim, stale)
    assert (outcome.status, outcome.values) == ("ok", ("moved",))
    assert recorded(run_id, credit).state is RunState.UNWINDING

    # The undo's entry was not the one on the stack: recorded done, not concluded
    run_id, credit, owner, claim = last_undo_running()
    store.client.lset(run_keys(run_id)[3], 0, '{"step": 1, "other": true}')
    judged = Conclusion(RunState.COMPENSATED, "", owner, str(version(store, run_id) + 1))
    outcome = store.record_done_and_conclude(run_id, credit, claim, judged)
    assert (outcome.status, outcome.values) == ("ok", ())
    picture = recorded(run_id, credit)
    assert picture.state is RunState.UNWINDING and picture.stack

    # Another owner's conclusion (a stale chain): recorded done, not concluded
    run_id, credit, owner, claim = last_undo_running()
    judged = Conclusion(RunState.COMPENSATED, "", "reaper:1", str(version(store, run_id) + 1))
    outcome = store.record_done_and_conclude(run_id, credit, claim, judged)
    assert (outcome.status, outcome.values) == ("ok", ("stale",))
    assert recorded(run_id, credit).state is RunState.UNWINDING


def test_redelivered_failure_of_a_non_owner_does_not_own(store: RunStore, new_run: NewRun) -> None:
    """The step that failed first (while another was in flight) never owns, even redelivered."""
    run_id = new_run()
    two = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    three = start(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    fail(store, run_id, two)
    assert fail(store, run_id, three).owns_unwind is True

    again = fail(store, run_id, two)

    assert (again.status, again.owns_unwind) == ("dup", False)
    assert store.owner(run_id) == f"step:{three}"


# -- begin_step ----------------------------------------------------------------------------


def test_begin_step_counts_attempts_and_replays_outcomes(store: RunStore, new_run: NewRun) -> None:
    """Each delivery counts an attempt; a settled step replays its result or its error."""
    run_id = new_run()
    good = reserve(store, run_id, "get_order", ToolClass.READ)
    bad = reserve(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)

    assert begin(store, run_id, good) == Outcome("run", (1, "", "0"))
    assert begin(store, run_id, good).status == "busy"  # the first delivery holds its lease
    assert begin(store, run_id, bad) == Outcome("run", (1, "", "0"))
    succeed(store, run_id, good)
    fail(store, run_id, bad, "card declined")

    replay = begin(store, run_id, good)
    assert replay.status == "succeeded"
    assert json.loads(replay.values[0]) == {"step": good, "ok": True}
    failed = begin(store, run_id, bad)
    assert failed.status == "failed"
    assert json.loads(failed.values[0]) == {"type": "RuntimeError", "message": "card declined"}
    assert store.picture(run_id).step(good).attempts == 1  # type: ignore[union-attr]
    assert begin(store, run_id, 99) == Outcome("unknown")
    assert begin(store, uuid.uuid4().hex, 1) == Outcome("unknown")


def test_begin_after_a_delivery_vanished_in_the_step_says_so(
    store: RunStore, new_run: NewRun
) -> None:
    """Taking over a claim whose lease ran out (its delivery died) marks the step orphaned:
    a final failure of a later attempt cannot tell that nothing happened. A retry releases
    its claim, so the attempt after a retry is not taken for a death."""
    run_id = new_run()
    step = reserve(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    assert begin(store, run_id, step).values[2] == "0"
    store.record_retry(run_id, step, {"message": "503"}, 0.0)
    assert begin(store, run_id, step).values[2] == "0"  # the retry's attempt: no death
    store.client.hset(run_keys(run_id)[1], f"{step}:lease", "0")  # that delivery died
    assert begin(store, run_id, step).values[2] == "1"


def test_dispatched_step_of_an_unwinding_run_is_skipped_and_takes_ownership(
    store: RunStore, new_run: NewRun
) -> None:
    """A step not yet started when the run began failing is skipped; as the last, it owns."""
    # Given step 1 running and step 2 dispatched but not picked up
    run_id = new_run()
    one = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    two = reserve(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)

    # When step 1 fails, step 2 is still in flight, so nobody owns yet
    assert fail(store, run_id, one).owns_unwind is False
    before = version(store, run_id)

    # When step 2 is picked up
    skipped = begin(store, run_id, two)

    # Then it is skipped without running, and as the last to settle it owns the unwind
    assert skipped == Outcome("skip", (1,))
    picture = store.picture(run_id)
    assert picture is not None
    assert picture.step(two).state is StepState.SKIPPED
    assert picture.step(two).attempts == 0
    assert store.view(run_id).in_flight == {}  # type: ignore[union-attr]
    assert store.owner(run_id) == f"step:{two}"
    assert version(store, run_id) == before + 1
    # A repeat (the first reply lost) resumes the unwind while nobody has sent it; once it is
    # sent, a repeat changes nothing.
    assert begin(store, run_id, two) == Outcome("skip", (1,))
    store.client.hset(run_keys(run_id)[0], "sent", "1")
    assert begin(store, run_id, two) == Outcome("skip", (0,))
    assert version(store, run_id) == before + 1


def test_skip_with_another_step_in_flight_does_not_own(store: RunStore, new_run: NewRun) -> None:
    """A skip is only the owner when nothing else is in flight."""
    run_id = new_run()
    one = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    two = reserve(store, run_id, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    three = start(store, run_id, "hold_stock", ToolClass.COMPENSATABLE_WRITE)
    fail(store, run_id, one)

    assert begin(store, run_id, two) == Outcome("skip", (0,))
    assert succeed(store, run_id, three, "release_stock").owns_unwind is True
    assert store.owner(run_id) == f"step:{three}"


# -- reserve -------------------------------------------------------------------------------


def test_a_closed_gate_refuses_and_changes_nothing(store: RunStore, new_run: NewRun) -> None:
    """Class 5 behind an unsettled write, class 4 past the pivot: ``refused``, nothing moved."""
    # Given a credit in flight
    run_id = new_run()
    credit = reserve(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    run_before = run_hash(store, run_id)
    steps_before = store.client.hgetall(run_keys(run_id)[1])
    mail = ToolClass.IRREVERSIBLE_WRITE

    # When the mail asks to go out
    outcome = store.reserve(run_id, "send_reply", mail, "{}", gate_for(mail))

    # Then it is refused and nothing moved
    assert outcome == Outcome("refused")
    assert run_hash(store, run_id) == run_before
    assert store.client.hgetall(run_keys(run_id)[1]) == steps_before

    # and once the credit settled and the mail went out, a new credit is refused
    begin(store, run_id, credit)
    succeed(store, run_id, credit, "issue_credit")
    assert store.reserve(run_id, "send_reply", mail, "{}", gate_for(mail)).status == "ok"
    credit_class = ToolClass.COMPENSATABLE_WRITE
    again = store.reserve(run_id, "issue_credit", credit_class, "{}", gate_for(credit_class))
    assert again == Outcome("refused")


def test_reserve_on_an_ended_run(store: RunStore, new_run: NewRun) -> None:
    """An ended run cannot reserve: ``ended`` with the state."""
    run_id = new_run()
    assert conclude(store, run_id, RunState.COMPLETED).status == "ok"

    read = gate_for(ToolClass.READ)
    assert store.reserve(run_id, "get_order", ToolClass.READ, "{}", read) == Outcome(
        "ended", ("completed",)
    )
    assert run_hash(store, run_id)["next_step"] == "0"


def test_reserve_on_an_unwinding_run(store: RunStore, new_run: NewRun) -> None:
    """An unwinding run takes no new steps either."""
    run_id = new_run()
    store.abort(run_id, "stop")

    read = gate_for(ToolClass.READ)
    assert store.reserve(run_id, "get_order", ToolClass.READ, "{}", read) == Outcome(
        "ended", ("unwinding",)
    )


# -- compensations -------------------------------------------------------------------------


def test_compensation_attempts_are_counted_across_calls(store: RunStore, new_run: NewRun) -> None:
    """Every begin counts an attempt, through retries, and hands over the stored entry."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)

    first = begin_comp(store, run_id, 2)
    assert record_comp(store, run_id, 2, "retrying", {"message": "503"}) == "ok"
    second = begin_comp(store, run_id, 2)

    assert (first.status, first.values[0]) == ("run", 1)
    assert (second.status, second.values[0]) == ("run", 2)
    assert json.loads(second.values[1])["tool"] == "undo_set_ticket_status"
    assert json.loads(second.values[1])["idempotency_key"] == f"{run_id}:2:undo"
    comp = next(c for c in store.picture(run_id).compensations if c.step == 2)  # type: ignore[union-attr]
    assert (comp.state, comp.attempts) == (CompensationState.RUNNING, 2)
    assert comp.error == {"message": "503"}
    assert begin_comp(store, run_id, 9) == Outcome("unknown")


def test_done_removes_exactly_its_own_entry(store: RunStore, new_run: NewRun) -> None:
    """Confirming the middle undo removes only it; the others stay, in order."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    before = stack_of(store, run_id)
    assert [e["step"] for e in before] == [1, 2, 3]

    begin_comp(store, run_id, 2)
    assert record_comp(store, run_id, 2, "done") == "ok"

    assert stack_of(store, run_id) == [before[0], before[2]]
    assert record_comp(store, run_id, 2, "done") == "dup"
    assert stack_of(store, run_id) == [before[0], before[2]]
    assert begin_comp(store, run_id, 2) == Outcome("done")
    comp = next(c for c in store.picture(run_id).compensations if c.step == 2)  # type: ignore[union-attr]
    assert (comp.state, comp.attempts) == (CompensationState.DONE, 1)


def test_failed_compensation_keeps_its_entry(store: RunStore, new_run: NewRun) -> None:
    """An undo that failed for good stays on the stack, with its error recorded."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    before = stack_of(store, run_id)

    begin_comp(store, run_id, 3)
    error = {"type": "ConnectionError", "message": "stock api down"}
    assert record_comp(store, run_id, 3, "failed", error) == "ok"

    assert stack_of(store, run_id) == before
    comp = next(c for c in store.picture(run_id).compensations if c.step == 3)  # type: ignore[union-attr]
    assert (comp.state, comp.error) == (CompensationState.FAILED, error)
    assert record_comp(store, run_id, 7, "done") == "unknown"


# -- conclude ------------------------------------------------------------------------------


def test_conclude_is_fenced_and_keys_expire_once_recorded(store: RunStore, new_run: NewRun) -> None:
    """Only the first conclusion lands; the keys expire within the retention once recorded."""
    # Given an unwinding run whose undos all ran
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    for n in (3, 2, 1):
        begin_comp(store, run_id, n)
        record_comp(store, run_id, n, "done")

    # When it is concluded twice
    first = conclude(store, run_id, RunState.COMPENSATED)
    second = conclude(store, run_id, RunState.ESCALATED, "late")

    # Then the second is refused, and the first state stands
    assert first.status == "ok"
    assert second == Outcome("ended", ("compensated",))
    picture = store.picture(run_id)
    assert picture is not None
    assert (picture.state, picture.reason) == (RunState.COMPENSATED, "agent gave up")
    assert picture.ended is not None
    existing = [k for k in run_keys(run_id) if store.client.exists(k)]
    assert existing == [run_keys(run_id)[i] for i in (0, 1, 4)]  # inflight and stack are empty
    # (kept until the SQL record is written: a record of another version does not count)
    assert all(store.client.ttl(key) == -1 for key in existing)
    due = store.due_at(run_id)
    assert not store.mark_recorded(run_id, str(int(first.values[0]) - 1))
    assert store.due_at(run_id) == due  # a refused mark leaves the reaper's look where it was
    assert store.mark_recorded(run_id, str(first.values[0]))
    for key in existing:
        ttl = store.client.ttl(key)
        assert 0 < ttl <= RETENTION, (key, ttl)  # type: ignore[operator]
    # the reaper looks again once the keys have expired (the same script wrote the entry, on
    # the server's clock: read exactly, as the estimate may lag it by a fraction of a ms)
    expired = store.now(exact=True) + RETENTION + LOOK_AFTER_EXPIRY
    assert expired - 5 <= (store.due_at(run_id) or 0) <= expired


def test_conclude_keeps_the_reason_when_none_is_given(store: RunStore, new_run: NewRun) -> None:
    """An empty reason leaves the recorded one; a given reason replaces it."""
    kept, replaced = new_run(), new_run()
    for run_id in (kept, replaced):
        fail(store, run_id, start(store, run_id, "get_order", ToolClass.READ))

    assert conclude(store, kept, RunState.COMPENSATED).status == "ok"
    assert conclude(store, replaced, RunState.ESCALATED, "compensation failed").status == "ok"
    assert run_hash(store, kept)["reason"] == "step 1 failed"
    assert run_hash(store, replaced)["reason"] == "compensation failed"


def test_completed_is_refused_while_steps_are_in_flight(store: RunStore, new_run: NewRun) -> None:
    """A run cannot complete with steps unsettled; it says which ones."""
    run_id = new_run()
    one = start(store, run_id, "get_order", ToolClass.READ)
    two = reserve(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    three = start(store, run_id, "set_priority", ToolClass.CONVERGENT_WRITE)
    succeed(store, run_id, one)

    refused = conclude(store, run_id, RunState.COMPLETED)

    assert refused.status == "inflight"
    assert sorted(int(s) for s in refused.values) == [two, three]
    assert run_hash(store, run_id)["state"] == "running"
    assert store.client.ttl(run_keys(run_id)[0]) == -1


def test_completed_needs_a_running_run_and_the_others_an_unwinding_one(
    store: RunStore, new_run: NewRun
) -> None:
    """``completed`` ends a running run; ``compensated`` cannot end a running one."""
    run_id = new_run()

    assert conclude(store, run_id, RunState.COMPENSATED) == Outcome("ended", ("running",))
    assert conclude(store, run_id, RunState.COMPLETED).status == "ok"
    assert conclude(store, run_id, RunState.COMPLETED) == Outcome("ended", ("completed",))
    assert conclude(store, uuid.uuid4().hex, RunState.COMPLETED) == Outcome("unknown")


# -- requeue -------------------------------------------------------------------------------


def test_every_failed_attempt_of_a_compensation_keeps_its_error(
    store: RunStore, new_run: NewRun
) -> None:
    """Retries and the final failure each leave their error, across a requeue, for the card."""
    # Given an undo that fails twice (a retry, then for good), is requeued and fails again
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    begin_comp(store, run_id, 3)
    record_comp(store, run_id, 3, "retrying", {"message": "first", "attempt": 1})
    begin_comp(store, run_id, 3)
    record_comp(store, run_id, 3, "failed", {"message": "second", "attempt": 2})
    for step in (2, 1):
        begin_comp(store, run_id, step)
        record_comp(store, run_id, step, "done")
    assert conclude(store, run_id, RunState.ESCALATED, "compensation failed").status == "ok"
    assert store.requeue(run_id).status == "ok"
    begin_comp(store, run_id, 3)
    record_comp(store, run_id, 3, "failed", {"message": "third \u00e9", "attempt": 3})

    # When the run is read back
    picture = store.picture(run_id)
    assert picture is not None

    # Then the undo lists each error in order, with when it was recorded; the others none
    [undo] = [c for c in picture.compensations if c.step == 3]
    assert [e["error"] for e in undo.errors] == [
        {"message": "first", "attempt": 1},
        {"message": "second", "attempt": 2},
        {"message": "third \u00e9", "attempt": 3},
    ]
    assert all(float(e["at"]) > 0 for e in undo.errors)
    assert [c.errors for c in picture.compensations if c.step != 3] == [[], []]


def test_requeue_reopens_a_run_whose_compensation_failed(store: RunStore, new_run: NewRun) -> None:
    """An escalated run with a failed undo goes back to unwinding, kept, with a new owner."""
    # Given a run escalated because one of its undos failed
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    begin_comp(store, run_id, 3)
    record_comp(store, run_id, 3, "done")
    begin_comp(store, run_id, 2)
    record_comp(store, run_id, 2, "failed", {"message": "tickets down"})
    begin_comp(store, run_id, 1)
    record_comp(store, run_id, 1, "done")
    assert conclude(store, run_id, RunState.ESCALATED, "compensation failed").status == "ok"

    # When it is requeued
    outcome = store.requeue(run_id)

    # Then it unwinds again, its failed undo pending, its keys no longer expiring
    assert outcome == Outcome("ok", ("requeue:1", 1))
    picture = store.picture(run_id)
    assert picture is not None
    assert picture.state is RunState.UNWINDING
    assert {c.step: c.state for c in picture.compensations} == {
        1: CompensationState.DONE,
        2: CompensationState.PENDING,
        3: CompensationState.DONE,
    }
    assert [e["step"] for e in picture.stack] == [2]
    assert picture.extra == {"owner": "requeue:1", "sent": "0", "generation": "1"}
    assert picture.ended is None
    for key in run_keys(run_id):
        if store.client.exists(key):
            assert store.client.ttl(key) == -1, key
    # and the requeued undo starts a fresh attempt budget, its earlier round kept in history
    [again] = [c for c in picture.compensations if c.step == 2]
    assert (again.attempts, again.round_start) == (1, 1)
    assert [h["attempts"] for h in again.history] == [1]
    assert json.loads(again.history[0]["error"]) == {"message": "tickets down"}
    assert begin_comp(store, run_id, 2).values[0] == 1
    record_comp(store, run_id, 2, "done")
    # and it can be concluded again
    assert conclude(store, run_id, RunState.COMPENSATED).status == "ok"


def test_requeue_refuses_a_compensated_run(store: RunStore, new_run: NewRun) -> None:
    """Nothing failed, nothing to run again."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    for n in (3, 2, 1):
        record_comp(store, run_id, n, "done")
    conclude(store, run_id, RunState.COMPENSATED)

    assert store.requeue(run_id) == Outcome("refused", ("compensated",))
    assert run_hash(store, run_id)["generation"] == "0"


def test_requeue_refuses_a_run_past_its_pivot(store: RunStore, new_run: NewRun) -> None:
    """Past the pivot a person decides: requeue does not unwind it."""
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, run_id, credit, "reverse_credit")
    mail = start(store, run_id, "send_reply", ToolClass.IRREVERSIBLE_WRITE)
    succeed(store, run_id, mail, pivot=True)
    status = start(store, run_id, "set_priority", ToolClass.CONVERGENT_WRITE)
    fail(store, run_id, status)
    conclude(store, run_id, RunState.ESCALATED, "failed after an irreversible step")

    assert store.requeue(run_id) == Outcome("refused", ("escalated",))
    run = run_hash(store, run_id)
    assert (run["state"], run["generation"]) == ("escalated", "0")
    assert store.client.ttl(run_keys(run_id)[0]) == -1  # kept until its record is written


def test_requeue_refuses_a_running_or_unknown_run(store: RunStore, new_run: NewRun) -> None:
    """Only escalated runs can be requeued."""
    run_id = new_run()

    assert store.requeue(run_id) == Outcome("refused", ("running",))
    assert store.requeue(uuid.uuid4().hex) == Outcome("unknown")


# -- isolation between runs ----------------------------------------------------------------


def test_two_interleaved_runs_keep_to_their_own_keys(store: RunStore, new_run: NewRun) -> None:
    """Steps of two runs, interleaved, never touch the other's stack or keys."""
    # Given two runs
    a, b = new_run(), new_run()

    # When their steps interleave
    a1 = start(store, a, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    b1 = start(store, b, "set_ticket_status", ToolClass.REVERSIBLE_WRITE)
    b2 = start(store, b, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    a2 = start(store, a, "hold_stock", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, b, b2, "reverse_credit")
    succeed(store, a, a1, "reverse_credit")
    succeed(store, a, a2, "release_stock")
    succeed(store, b, b1, "restore_status")
    fail_b = store.abort(b, "b gave up")
    begin_comp(store, b, b1)
    record_comp(store, b, b1, "done")

    # Then each stack holds only its own entries
    stack_a, stack_b = stack_of(store, a), stack_of(store, b)
    assert [(e["step"], e["tool"]) for e in stack_a] == [
        (1, "reverse_credit"),
        (2, "release_stock"),
    ]
    assert [(e["step"], e["tool"]) for e in stack_b] == [(2, "reverse_credit")]
    assert all(e["idempotency_key"].startswith(f"{a}:") for e in stack_a)
    assert all(e["idempotency_key"].startswith(f"{b}:") for e in stack_b)
    assert run_hash(store, a)["state"] == "running"
    assert fail_b.owns_unwind is True
    assert (a1, a2, b1, b2) == (1, 2, 1, 2)

    # And no key of one run names the other
    # (the settled:<n> lists are the wake-up signals of clients waiting on a step)
    keys_a = {k for k in store.client.scan_iter(match=f"*{a}*") if ":settled:" not in k}
    keys_b = {k for k in store.client.scan_iter(match=f"*{b}*") if ":settled:" not in k}
    assert keys_a == {k for k in run_keys(a) if k != run_keys(a)[2]}
    assert keys_b == {k for k in run_keys(b) if k != run_keys(b)[2]}
    assert not any(b in key for key in keys_a)
    assert not any(a in key for key in keys_b)


def test_every_key_of_a_run_shares_its_hash_tag(store: RunStore, new_run: NewRun) -> None:
    """All keys of one run carry ``{run_id}`` and so land in one cluster slot."""
    run_id = new_run()
    step = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    two = start(store, run_id, "set_priority", ToolClass.CONVERGENT_WRITE)
    succeed(store, run_id, step, "reverse_credit")

    keys = run_keys(run_id)
    stored = set(store.client.scan_iter(match=f"*{run_id}*"))
    signals = {k for k in stored if ":settled:" in k}

    assert stored - signals == set(keys)  # all five exist now (step two is still in flight)
    assert signals == {settled_key(run_id, step)}
    assert two == 2
    assert len(set(keys)) == 5
    for key in [*keys, *signals]:
        assert key.count("{") == 1
        assert key[key.index("{") + 1 : key.index("}")] == run_id
    assert {key_slot(k.encode()) for k in stored} == {key_slot(run_id.encode())}


# -- the store being down ------------------------------------------------------------------


@pytest.fixture
def down() -> Iterator[RunStore]:
    """A store whose Redis does not answer (nothing listens on port 1)."""
    run_store = RunStore.from_url("redis://127.0.0.1:1/0", retention_seconds=RETENTION)
    yield run_store
    run_store.client.close()


@pytest.mark.parametrize(
    "operation",
    [
        pytest.param(lambda s, r: s.begin_step(r, 1, "t", "{}", "c", 1.0), id="begin_step"),
        pytest.param(lambda s, r: s.abort(r, "stop"), id="abort"),
        pytest.param(lambda s, r: s.create(r, deadline=DEADLINE), id="create"),
        pytest.param(lambda s, r: s.view(r), id="view"),
        pytest.param(lambda s, r: s.picture(r), id="picture"),
    ],
)
def test_unreachable_store_is_a_retryable_saga_error(
    down: RunStore, operation: Callable[[RunStore, str], object]
) -> None:
    """A Redis that does not answer is ``StoreUnavailableError`` (retryable), whatever the
    store was asked: scripts and plain reads alike."""
    with pytest.raises(StoreUnavailableError, match="saga store unreachable") as err:
        operation(down, uuid.uuid4().hex)

    assert err.value.retryable is True
    assert isinstance(err.value.__cause__, redis.ConnectionError)


# -- in doubt ------------------------------------------------------------------------------


def test_an_effect_that_lands_after_it_was_reconciled_as_missing_is_not_lost(
    store: RunStore, new_run: NewRun
) -> None:
    """Reconciled "not happened", run compensated, then the credit lands: escalated, undo kept."""
    # Given a credit in doubt, reconciled as never having happened, and the run compensated
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    doubt = store.mark_in_doubt(run_id, credit, {"type": "NoOutcome", "message": "?"})
    assert doubt.status == "in_doubt"
    resolved = store.resolve_in_doubt(run_id, credit, "not_found", "", "", False, "")
    assert resolved.owns_unwind
    assert conclude(store, run_id, RunState.COMPENSATED).status == "ok"

    # When the credit's worker records its success after all
    late = succeed(store, run_id, credit, "reverse_credit")

    # Then the run is reopened to unwind that credit too, owned by the late step, keys kept
    assert late == Outcome("late", (1, 1))
    picture = store.picture(run_id)
    assert picture is not None
    assert (picture.state, picture.extra["owner"]) == (RunState.UNWINDING, f"step:{credit}")
    assert [e["step"] for e in picture.stack] == [credit]
    assert store.client.ttl(run_keys(run_id)[0]) == -1
    assert begin_comp(store, run_id, credit).status == "run"
    record_comp(store, run_id, credit, "done")
    assert conclude(store, run_id, RunState.COMPENSATED).status == "ok"


def test_an_effect_landing_on_an_escalated_run_goes_on_its_card(
    store: RunStore, new_run: NewRun
) -> None:
    """A late effect on a run already escalated stays escalated, undo kept, record pending."""
    # Given a credit in doubt that nothing could reconcile: the run ended escalated
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    store.mark_in_doubt(run_id, credit, {"type": "NoOutcome", "message": "?"})
    store.resolve_in_doubt(run_id, credit, "unknown", "", "", False, "step 1 in doubt")
    assert conclude(store, run_id, RunState.ESCALATED, "step 1 in doubt").status == "ok"
    assert store.mark_recorded(run_id, run_hash(store, run_id)["version"])

    # When its effect lands after all
    late = succeed(store, run_id, credit, "reverse_credit")

    # Then it stays escalated, the undo on its stack, its keys kept until it is recorded again
    assert late == Outcome("late", (0, 1))
    run = run_hash(store, run_id)
    assert (run["state"], run["recorded"]) == ("escalated", "0")
    assert run["cause"] == "step 1 landed after the run ended escalated"
    assert [e["step"] for e in stack_of(store, run_id)] == [credit]
    assert store.client.ttl(run_keys(run_id)[0]) == -1
    # and a repeat of that success (its reply lost) says the same
    assert succeed(store, run_id, credit, "reverse_credit") == Outcome("dup", (0, 1))
    # and a requeue runs the undo
    assert store.requeue(run_id).status == "ok"
    assert begin_comp(store, run_id, credit).status == "run"


def test_a_stale_unwind_neither_compensates_nor_concludes(store: RunStore, new_run: NewRun) -> None:
    """After the reaper takes an unwind over, the old chain's messages change nothing."""
    # Given an unwind owned by "abort", then taken over by the reaper
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    old_owner = store.owner(run_id)
    view = store.view(run_id)
    assert view is not None and store.take_over(run_id, view.version, "reaper:1")

    # When the old chain's compensation and conclusion arrive
    stale = begin_comp(store, run_id, 3, old_owner)
    concluded = conclude(store, run_id, RunState.COMPENSATED, "", old_owner)

    # Then both are refused, and the new owner's go through
    assert (stale, concluded) == (Outcome("stale"), Outcome("stale"))
    assert begin_comp(store, run_id, 3, "reaper:1").status == "run"
    picture = store.picture(run_id)
    assert picture is not None and picture.state is RunState.UNWINDING
    assert next(c for c in picture.compensations if c.step == 3).task_id == "task"


def test_a_move_not_in_the_table_is_refused_loudly(
    store: RunStore, new_run: NewRun, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry of an undo nobody began, a refusal of a step that succeeded: refused, logged."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    with caplog.at_level("ERROR", logger="saga.stack"):
        refused = store.record_compensation(run_id, 3, "retry", {"message": "?"})
        verdict = store.record_failure(run_id, 1, {"message": "?"}, event="reject")
    assert refused == Outcome("illegal", ("comp", "pending", "retry"))
    assert verdict == Outcome("illegal", ("step", "succeeded", "reject"))
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
        "refused comp transition 'pending' --retry--> (not in saga/machine.py's table; "
        "record_compensation [3])",
        "refused step transition 'succeeded' --reject--> (not in saga/machine.py's "
        "table; record_failure [1])",
    ]
    assert {c.state for c in store.picture(run_id).compensations} == {  # type: ignore[union-attr]
        CompensationState.PENDING
    }


# -- an operator's scripts: corrections, resolve, rebuilding expired keys ------------------


def escalated_with_undo_2_failed(store: RunStore, new_run: NewRun) -> str:
    """Three writes aborted; undo 2 fails, 3 and 1 are done: escalated, recorded."""
    run_id = new_run()
    three_writes_and_abort(store, run_id)
    for step, outcome in ((3, "done"), (2, "failed"), (1, "done")):
        begin_comp(store, run_id, step)
        record_comp(store, run_id, step, outcome, {"message": "tickets down"})
    assert conclude(store, run_id, RunState.ESCALATED, "compensation failed").status == "ok"
    assert store.mark_recorded(run_id, run_hash(store, run_id)["version"])
    return run_id


def corrected(store: RunStore, run_id: str, step: int, **args: Any) -> str:
    picture = store.picture(run_id)
    assert picture is not None
    [undo] = [c for c in picture.compensations if c.step == step]
    return payload.dumps(
        {**undo.entry, "args": {**undo.entry["args"], **args}}, what="u", limit=9999
    )


def test_a_correction_replaces_the_undo_on_the_stack_and_in_its_record(
    store: RunStore, new_run: NewRun
) -> None:
    """The corrected entry is the very string on the stack, so its done still removes it."""
    run_id = escalated_with_undo_2_failed(store, new_run)
    entry = corrected(store, run_id, 2, ref="ref-moved")

    outcome = store.requeue(run_id, {2: entry}, run_hash(store, run_id)["version"], '{"by":"a"}')

    assert outcome == Outcome("ok", ("requeue:1", 1))
    assert store.client.lrange(run_keys(run_id)[3], 0, -1) == [entry]
    began = begin_comp(store, run_id, 2)
    assert (began.status, json.loads(began.values[1])["args"]) == ("run", {"ref": "ref-moved"})
    record_comp(store, run_id, 2, "done")
    assert stack_of(store, run_id) == []
    assert conclude(store, run_id, RunState.COMPENSATED).status == "ok"
    assert run_hash(store, run_id)["requeue:1"] == '{"by":"a"}'


def test_corrections_apply_whole_or_not_at_all(store: RunStore, new_run: NewRun) -> None:
    """One correction for an undo already done, or a run that moved since they were made:
    refused, and nothing changed (not even the correction that was fine)."""
    run_id = escalated_with_undo_2_failed(store, new_run)
    before = (run_hash(store, run_id), store.client.hgetall(run_keys(run_id)[4]))
    fine, done = corrected(store, run_id, 2, ref="x"), corrected(store, run_id, 3, ref="y")
    now = run_hash(store, run_id)["version"]

    assert store.requeue(run_id, {2: fine, 3: done}, now) == Outcome("uncorrectable", ("3", "done"))
    assert store.requeue(run_id, {2: fine}, str(int(now) - 1)) == Outcome("moved", (now,))
    assert (run_hash(store, run_id), store.client.hgetall(run_keys(run_id)[4])) == before


def test_a_resolve_fences_requeue_until_an_effect_lands_late(
    store: RunStore, new_run: NewRun
) -> None:
    """Resolved at its version, the run refuses requeue and a second resolve; an effect that
    lands later moves it on, and it is open to a requeue again."""
    # Given an escalated run: an undo failed, and step 2 in doubt with nothing to tell
    run_id = new_run()
    credit = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, run_id, credit, "reverse_credit")
    doubted = start(store, run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    store.mark_in_doubt(run_id, doubted, {"type": "NoOutcome", "message": "?"})
    store.resolve_in_doubt(run_id, doubted, "unknown", "", "", False, "step 2 in doubt")
    begin_comp(store, run_id, credit, unwind=f"step:{doubted}")
    record_comp(store, run_id, credit, "failed", {"message": "billing down"})
    assert conclude(store, run_id, RunState.ESCALATED, "step 2 in doubt").status == "ok"
    assert store.mark_recorded(run_id, run_hash(store, run_id)["version"])

    # When a person resolves it
    said = json.dumps({"by": "bob", "note": "refunded by phone", "escalation_id": f"{run_id}:0"})
    assert store.resolve(run_id, 1, said).status == "stale"
    resolved = store.resolve(run_id, 0, said)

    # Then it refuses requeue and a second resolve; its record is due again, keys kept
    assert resolved.status == "ok"
    assert store.requeue(run_id) == Outcome("resolved", (said,))
    assert store.resolve(run_id, 0, said).values[0] == said
    picture = store.picture(run_id)
    assert picture is not None and picture.resolution is not None
    assert picture.resolution["by"] == "bob" and not picture.recorded
    assert store.client.ttl(run_keys(run_id)[0]) == -1

    # When the doubted credit lands after all, the resolution no longer holds: requeue runs
    assert succeed(store, run_id, doubted, "reverse_credit").status == "late"
    picture = store.picture(run_id)
    assert picture is not None and picture.resolution is None
    assert store.requeue(run_id) == Outcome("ok", ("requeue:1", 2))


def test_a_resolve_is_refused_while_a_requeue_unwinds(store: RunStore, new_run: NewRun) -> None:
    run_id = escalated_with_undo_2_failed(store, new_run)
    assert store.requeue(run_id).status == "ok"
    assert store.resolve(run_id, 0, "{}") == Outcome("state", ("unwinding",))
    assert store.resolve(uuid.uuid4().hex, 0, "{}") == Outcome("unknown")


def test_expired_keys_are_rebuilt_only_into_nothing(store: RunStore, new_run: NewRun) -> None:
    """Rebuilt from the picture the record holds: the same run, expiring again; a second
    rebuild (the keys exist) writes nothing, and the rebuilt run is requeued as before."""
    # Given an escalated run whose keys have gone
    run_id = escalated_with_undo_2_failed(store, new_run)
    recorded = store.picture(run_id)
    assert recorded is not None
    store.client.delete(*run_keys(run_id))

    # When it is rebuilt, twice
    assert store.restore(recorded)
    assert not store.restore(dataclasses.replace(recorded, reason="something else"))

    # Then it reads back as it was, its keys expiring after the retention period
    assert store.picture(run_id) == recorded
    for key in (run_keys(run_id)[0], run_keys(run_id)[3]):
        assert 0 < store.client.ttl(key) <= RETENTION
    # and a requeue reopens it exactly as it would have
    assert store.requeue(run_id) == Outcome("ok", ("requeue:1", 1))
    assert begin_comp(store, run_id, 2).status == "run"
    record_comp(store, run_id, 2, "done")
    assert stack_of(store, run_id) == []


def test_more_callers_than_connections_wait_for_one_instead_of_failing(redis_url: str) -> None:
    """A web app with more threads waiting on Redis than the pool holds: each waits for a free
    connection (redis-py's plain pool would raise "Too many connections" past its cap)."""
    if TEST_STORE in ("sentinel", "cluster"):  # (no ?options there: the keyword instead)
        small = RunStore.from_url(redis_url, RETENTION, max_connections=3)
    else:
        separator = "&" if "?" in redis_url else "?"
        small = RunStore.from_url(f"{redis_url}{separator}max_connections=3", RETENTION)
    errors: list[BaseException] = []

    def wait_on_redis() -> None:
        try:
            small.client.blpop([f"test-pool-{uuid.uuid4().hex}"], timeout=0.2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait_on_redis) for _ in range(12)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == []
        if TEST_STORE == "cluster":  # a pool per node, each capped
            nodes = small.client.get_nodes()  # type: ignore[attr-defined]
            pools = [node.redis_connection.connection_pool for node in nodes]
            assert {pool.max_connections for pool in pools} == {3}
            assert all(isinstance(pool, redis.BlockingConnectionPool) for pool in pools)
        else:
            assert small.client.connection_pool.max_connections == 3
    finally:
        small.client.close()


def test_the_success_that_completes_a_hosted_turn_says_so_once(
    store: RunStore, new_run: NewRun
) -> None:
    """record_success checks the step's turn in the same script: its 4th value is the turn
    for the one success that completed it, 0 for any other, and absent on a repeat (whose
    first caller may have died before sending the next turn: the repeat's caller checks)."""
    from saga.agents.messages import ModelTurn, ToolCall
    from saga.agents.turn_state import TurnStore

    run_id = new_run(agent="bench")
    calls = (ToolCall("a", "look_up", {"n": 1}), ToolCall("b", "look_up", {"n": 2}))
    TurnStore(store, 1 << 20).record_answer(run_id, 1, ModelTurn(calls=calls))
    steps = []
    for i in range(2):
        args = json.dumps({"n": i + 1})
        gate = gate_for(ToolClass.READ)
        reserved = store.reserve(run_id, "look_up", ToolClass.READ, args, gate, marker=f"1:{i}")
        steps.append(int(reserved.values[0]))
        assert begin(store, run_id, steps[-1]).status == "run"
    driven = start(store, run_id, "look_up", ToolClass.READ)  # no marker: run.call's step

    assert succeed(store, run_id, steps[0]).values[2] == 0  # two more in flight
    assert succeed(store, run_id, driven).values[2] == 0  # not a turn's call
    assert succeed(store, run_id, steps[1]).values[2] == 1  # the last: turn 1 is done
    repeat = succeed(store, run_id, steps[1])
    assert repeat.status == "dup" and len(repeat.values) == 2
    assert store.advance_turn(run_id, step=steps[1]) == 0  # first writer won already
