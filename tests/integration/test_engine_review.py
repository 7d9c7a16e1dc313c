"""Regression tests for the engine review's reproduced defects (../shared/reviews is where the
scripts came from): each drives the real scripts and worker functions through the interleaving
that broke the engine, and checks the corrected behaviour. One test per defect, named by it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import DataError, OperationalError

from saga import RunState, StepState
from saga.constants import run_keys, step_idempotency_key
from saga.errors import DispatchError, MessageNotSentError
from saga.forward import settle_success
from saga.model import CompensationState
from saga.reaper import ReapReport, _resolve
from saga.revoke import on_revoked
from tests.integration.engine_harness import Harness, harness

CREDIT = "tools.issue_credit"
REVERSE = "tools.reverse_credit"


@pytest.fixture
def h(redis_url: str, tmp_path: Path) -> Iterator[Harness]:
    yield from harness(redis_url, tmp_path)


def credit_step(h: Harness, run_id: str, amount: int = 100) -> int:
    """Dispatch a credit and leave its message queued."""
    return h.saga.dispatch(run_id, "issue_credit", {"amount": amount}).step


def issued(h: Harness, run_id: str, amount: int = 100) -> int:
    """A credit dispatched and delivered: its effect applied, its undo pushed."""
    step = credit_step(h, run_id, amount)
    h.deliver(h.take(CREDIT, run_id=run_id, step=step))
    return step


def judge_unknown(h: Harness, run_id: str, step: int) -> None:
    """The step began and nothing can tell whether it happened: the run ends escalated."""
    h.saga.store.mark_in_doubt(run_id, step, {"type": "NoOutcome", "message": "?"})
    verdict = h.saga.store.resolve_in_doubt(run_id, step, "unknown", "", "", False, "in doubt")
    assert verdict.owns_unwind
    h.saga.core.start_unwind(run_id, f"step:{step}")
    h.drain()


def revoke_request(message: Any) -> SimpleNamespace:
    return SimpleNamespace(
        kwargs=message.kwargs,
        name=message.name,
        chain=message.chain,
        id=message.task_id,
        root_id=None,
    )


def test_defect_1_a_requeued_compensation_gets_a_fresh_attempt_budget(h: Harness) -> None:
    """After each requeue the undo gets its whole retry policy again, history kept (r13)."""
    # Given a credit whose reversal fails for good (5 attempts), the run escalated
    run_id = h.start()
    issued(h, run_id)
    h.world.failing_reversals = 100
    h.saga.abort(run_id, "cancelled")
    h.drain()
    assert h.saga.picture(run_id).state is RunState.ESCALATED
    # When it is requeued three times, billing down each time but the last
    for round_ in (1, 2, 3):
        h.world.calls.clear()
        if round_ == 3:
            h.world.failing_reversals = 0
        assert h.saga.requeue_failed_compensations(run_id) == 1
        h.drain()
        attempts = [a for tool, a in h.world.calls if tool == "reverse_credit"]
        # Then every round starts at attempt 1 with the whole budget
        assert attempts == ([1, 2, 3, 4, 5] if round_ < 3 else [1])
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.COMPENSATED
    [undo] = picture.compensations
    assert (undo.attempts, undo.round_start, len(undo.history)) == (16, 15, 3)
    assert h.world.reversals == [f"{run_id}:1:undo"]


def test_defect_2_the_reaper_never_fails_a_step_that_began(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A stale "never started" verdict is refused by the script; the effect is kept (r1)."""
    # Given a run idle past its deadline whose credit is still queued, as the reaper saw it
    run_id = h.start(deadline=1)
    step = credit_step(h, run_id)
    stale = h.saga.picture(run_id)
    # When the worker begins and applies it, then the reaper acts on its stale picture
    message = h.take(CREDIT, step=step)
    store = h.saga.store
    began = store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 30.0)
    assert began.status == "run"
    report = ReapReport()
    _resolve(h.saga.core, stale, store.now() + 10, report)
    # Then the verdict was refused (an expected race: no ERROR logged); the worker's success
    # is recorded; nothing unwinds
    assert report.never_started == []
    assert [r.message for r in caplog.records if r.levelno >= logging.ERROR] == []
    error = {"type": "NeverStarted", "message": "stale"}
    assert store.record_failure(run_id, step, error, "never_started").status == "began"
    assert h.saga.picture(run_id).step(step).state is StepState.RUNNING
    tool = h.registry.get("issue_credit")
    settle_success(h.saga.core, tool, run_id, step, message.kwargs["args"], {"credit_id": "x"})
    picture = h.saga.picture(run_id)
    assert (picture.state, picture.step(step).state) == (RunState.RUNNING, StepState.SUCCEEDED)
    assert [e["step"] for e in picture.stack] == [step]


def test_defect_3_a_revoke_of_a_step_that_began_asks_the_lookup(h: Harness) -> None:
    """Revoked (not terminated) after an earlier delivery applied it: in doubt, found, undone
    (r1b)."""
    # Given a credit whose first delivery applied it and died before recording
    run_id = h.start()
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c1", 0.0)
    h.world.credits[step_idempotency_key(run_id, step)] = 100
    # When its redelivery is revoked without terminating anything
    on_revoked(h.saga.core, revoke_request(message), terminated=False)
    h.drain()
    # Then the lookup found it, and it was undone
    picture = h.saga.picture(run_id)
    assert picture.step(step).reconciled == "happened"
    assert picture.state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{step}:undo"]


def test_defect_3_a_revoke_of_a_step_never_begun_fails_it(h: Harness) -> None:
    """A revoked step that no delivery began never ran: failed, no lookup, nothing to undo."""
    run_id = h.start()
    step = credit_step(h, run_id)
    on_revoked(h.saga.core, revoke_request(h.take(CREDIT, step=step)), terminated=True)
    h.drain()
    picture = h.saga.picture(run_id)
    assert (picture.step(step).state, picture.state) == (StepState.FAILED, RunState.COMPENSATED)


def test_defect_4_an_unencodable_result_escalates_instead_of_looping(h: Harness) -> None:
    """A result with a lone surrogate is recorded as unrecordable; the run unwinds (r5)."""
    run_id = h.start()
    step = credit_step(h, run_id)
    h.take(CREDIT, step=step)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 30.0)
    tool = h.registry.get("issue_credit")
    bad = {"credit_id": step_idempotency_key(run_id, step), "title": "Refund \ud83d"}
    settle_success(h.saga.core, tool, run_id, step, {"amount": 100}, bad)
    h.world.credits[step_idempotency_key(run_id, step)] = 100
    h.drain()
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is StepState.SUCCEEDED
    assert "is not valid text" in picture.step(step).result["unrecorded"]
    assert picture.state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{step}:undo"]


def test_defect_4_a_tool_gone_from_the_deploy_escalates_naming_it(h: Harness) -> None:
    """An in-doubt step of a tool no longer registered: escalated once, the reaper moves on."""
    run_id = h.start(deadline=1)
    step = credit_step(h, run_id)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 0.0)
    h.saga.store.client.hset(run_keys(run_id)[1], f"{step}:tool", "retired_tool")
    report = h.saga.reap(now=h.saga.store.now() + 5)
    h.drain()
    picture = h.saga.picture(run_id)
    assert report.in_doubt == [(run_id, step, "unknown")]
    assert picture.state is RunState.ESCALATED
    assert "'retired_tool' is not registered" in picture.reason
    assert h.saga.reap(now=h.saga.store.now() + 5).in_doubt == []


def test_defect_5_a_dispatch_error_after_the_step_began_returns_its_handle(h: Harness) -> None:
    """The publish raised yet the worker began the step: the caller gets the handle (r9)."""
    run_id = h.start()

    def began_then_raised(message: Any) -> None:
        h.queue.remove(message)
        h.deliver(message)  # the message got through and ran
        raise ConnectionResetError("reset by peer")

    h.send_error = began_then_raised
    handle = h.saga.dispatch(run_id, "issue_credit", {"amount": 100})
    h.send_error = None
    assert handle.result(timeout=5) == {"credit_id": f"{run_id}:1"}
    assert len(h.world.credits) == 1


def test_defect_5_a_dispatch_error_before_anything_ran_is_retryable(h: Harness) -> None:
    """The broker refused and nothing began: DispatchError, the step released."""
    run_id = h.start()

    def refused(message: Any) -> None:
        h.queue.remove(message)
        raise ConnectionRefusedError("no broker")

    h.send_error = refused
    with pytest.raises(DispatchError) as err:
        h.saga.dispatch(run_id, "issue_credit", {"amount": 100})
    assert err.value.retryable
    assert h.saga.picture(run_id).step(1).state is StepState.NOT_DISPATCHED


def test_defect_6_a_requeue_whose_chain_is_lost_is_resumed_by_the_reaper(h: Harness) -> None:
    """The requeue's chain never reaches the broker; the reaper finds the run and resends (r2)."""
    run_id = h.start(deadline=5)
    issued(h, run_id)
    h.world.failing_reversals = 100
    h.saga.abort(run_id, "cancelled")
    h.drain()
    h.world.failing_reversals = 0

    def lost(message: Any) -> None:
        h.queue.remove(message)
        raise ConnectionRefusedError("broker away")

    h.send_error = lost
    with pytest.raises(MessageNotSentError, match="the reaper does") as refused:
        h.saga.requeue_failed_compensations(run_id)
    assert (refused.value.run_id, refused.value.applied) == (run_id, "requeued")
    h.send_error = None
    assert run_id in h.saga.store.active_runs()
    report = h.saga.reap(now=h.saga.store.now() + 10)
    h.drain()
    assert report.resumed == [run_id]
    assert h.saga.picture(run_id).state is RunState.COMPENSATED


def test_defect_8_complete_with_the_database_down_is_recorded_later(h: Harness) -> None:
    """Redis says completed at once; the SQL record follows when the database is back (r3)."""
    run_id = h.start()
    issued(h, run_id)
    records = h.saga.records
    real = records.record_outcome

    def down(*_: Any) -> None:
        raise OperationalError("INSERT", {}, Exception("database is down"))

    records.record_outcome = down  # type: ignore[method-assign]
    picture = h.saga.complete(run_id)
    assert (picture.state, picture.recorded) == (RunState.COMPLETED, False)
    assert h.saga.store.client.ttl(run_keys(run_id)[0]) == -1  # kept until recorded
    report = h.saga.reap()
    assert report.broken and report.broken[0][0] == run_id
    records.record_outcome = real  # type: ignore[method-assign]
    report = h.saga.reap(now=h.saga.store.now() + 400)
    assert report.recorded == [run_id]
    assert records.run(run_id).state == "completed"  # type: ignore[union-attr]
    assert h.saga.picture(run_id).recorded
    assert h.saga.store.client.ttl(run_keys(run_id)[0]) > 0  # type: ignore[operator]


def test_defect_8_a_late_landing_with_the_database_down_is_escalated_later(h: Harness) -> None:
    """An effect lands after the run ended escalated, the database away: its escalation row
    is written by the reaper once it is back (r3b)."""
    run_id = h.start()
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 0.0)
    h.registry.get("issue_credit")  # (no lookup answer yet: the effect has not landed)
    judge_unknown(h, run_id, step)
    assert h.saga.picture(run_id).state is RunState.ESCALATED
    records = h.saga.records
    real = records.record_outcome
    records.record_outcome = lambda *_: (_ for _ in ()).throw(  # type: ignore[method-assign]
        OperationalError("INSERT", {}, Exception("down"))
    )
    tool = h.registry.get("issue_credit")
    with pytest.raises(OperationalError):
        settle_success(h.saga.core, tool, run_id, step, message.kwargs["args"], {"credit_id": "c"})
    records.record_outcome = real  # type: ignore[method-assign]
    assert run_id in h.saga.store.active_runs()
    h.saga.reap(now=h.saga.store.now() + 400)
    [escalation] = records.escalations(run_id, open_only=True)
    assert [e["step"] for e in escalation.stack] == [step]
    assert h.saga.picture(run_id).recorded


def test_defect_9_a_lost_reply_to_record_success_keeps_unwind_ownership(h: Harness) -> None:
    """The success landed, its reply was lost; the repeat still starts the unwind (r8)."""
    run_id = h.start()
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 30.0)
    h.saga.abort(run_id, "user cancelled")  # nobody owns the unwind while step 1 is in flight
    tool = h.registry.get("issue_credit")
    result = {"credit_id": step_idempotency_key(run_id, step)}
    h.world.credits[result["credit_id"]] = 100
    result_json, entry_json, _ = h.saga.core.encode_effect(
        tool, run_id, step, {"amount": 100}, result
    )
    first = h.saga.store.record_success(run_id, step, result_json, entry_json, False)
    assert first.owns_unwind  # ... and this answer is lost on the wire
    settle_success(h.saga.core, tool, run_id, step, message.kwargs["args"], result)  # the retry
    h.drain()
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{step}:undo"]


def test_a_lost_reply_to_a_begin_that_skipped_the_step_still_starts_the_unwind(
    h: Harness,
) -> None:
    """Defect 9's rule for ``begin_step``: the call that skipped a never-started step of an
    aborted run came to own the unwind; its reply was lost, and the repeat must still start
    it (found by the model check: the run stayed unwinding until its deadline)."""
    run_id = h.start()
    first = issued(h, run_id)
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    h.saga.abort(run_id, "user cancelled")  # step 2 is in flight: nobody owns the unwind yet
    store = h.saga.store
    skipped = store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "lost", 30.0)
    assert skipped.status == "skip" and skipped.owns_unwind  # ... and this answer is lost
    h.deliver(message)  # the repeat
    h.drain()
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is StepState.SKIPPED
    assert picture.state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{first}:undo"]


def test_a_final_failure_after_a_delivery_died_in_the_step_is_in_doubt_not_failed(
    h: Harness,
) -> None:
    """A delivery held the stock and died before reporting; the redelivery's call then fails
    for good. That failure says nothing about the dead delivery's hold, and the tool has no
    lookup: the step is in doubt and the run ends escalated naming it, never compensated
    with the hold live (found by the model check)."""
    run_id = h.start()
    step = h.saga.dispatch(run_id, "hold_stock", {"sku": "sku-1"}).step
    message = h.take("tools.hold_stock", step=step)
    store = h.saga.store
    died = store.begin_step(run_id, step, "hold_stock", '{"sku":"sku-1"}', "dead/1", 0.0)
    assert died.status == "run"
    key = step_idempotency_key(run_id, step)
    h.world.holds[key] = "sku-1"  # its effect, never reported
    h.world.failing_holds = 1
    assert isinstance(h.deliver(message), RuntimeError)  # attempt 2 of 2 raised
    h.drain()
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is not StepState.FAILED
    assert picture.state is RunState.ESCALATED
    assert f"step {step} (hold_stock) in doubt" in picture.doubt
    assert "an earlier delivery began this step and died" in picture.step(step).error["message"]
    assert h.world.holds == {key: "sku-1"}  # nothing pretended to release it


def test_a_final_failure_with_no_death_before_it_still_fails_the_step(h: Harness) -> None:
    """Without a dead delivery, a tool without a lookup that raised is taken at its word."""
    run_id = h.start()
    step = h.saga.dispatch(run_id, "hold_stock", {"sku": "sku-1"}).step
    message = h.take("tools.hold_stock", step=step)
    h.world.failing_holds = 2
    assert isinstance(h.deliver(message), Exception)  # attempt 1: retried
    h.saga.store.client.hset(run_keys(run_id)[1], f"{step}:lease", "0")  # its countdown ends
    assert isinstance(h.deliver(h.take("tools.hold_stock", step=step)), RuntimeError)
    h.drain()
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is StepState.FAILED
    assert picture.state is RunState.COMPENSATED


def test_defect_11_the_reaper_leaves_a_running_compensation_alone(h: Harness) -> None:
    """A slow undo under its lease is progress: no take-over, no second execution (r6)."""
    run_id = h.start(deadline=1)
    issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    undo = h.take(REVERSE)
    store = h.saga.store
    began = store.begin_compensation(run_id, 1, "old", undo.task_id, "abort", 30.0)
    assert began.status == "run"
    report = h.saga.reap(now=store.now() + 5)
    assert report.resumed == []
    second = store.begin_compensation(run_id, 1, "new", "other", "abort", 30.0)
    assert second.status == "busy"


def test_defect_12_a_late_landing_on_an_unknown_step_is_recorded_with_its_stack(
    h: Harness,
) -> None:
    """In doubt, unknown, escalated; then it lands: the escalation shows the undo, and every
    key (the new stack too) expires once that is recorded (r12)."""
    run_id = h.start()
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 0.0)
    judge_unknown(h, run_id, step)
    tool = h.registry.get("issue_credit")
    settle_success(h.saga.core, tool, run_id, step, message.kwargs["args"], {"credit_id": "c"})
    [escalation] = h.saga.records.escalations(run_id, open_only=True)
    assert [e["tool"] for e in escalation.stack] == ["reverse_credit"]
    for key in run_keys(run_id):
        if h.saga.store.client.exists(key):
            assert h.saga.store.client.ttl(key) > 0, key  # type: ignore[operator]


def test_defect_13_a_reaper_pass_during_create_keeps_the_run_indexed(h: Harness) -> None:
    """Indexed first, keys a moment later: a pass in between does not drop the run (r10)."""
    store = h.saga.store
    real = store._call

    def with_a_pass(script: str, run_id: str, *args: Any, **kw: Any) -> Any:
        if script == "create":
            h.saga.reap(now=store.now() + 10)
        return real(script, run_id, *args, **kw)

    store._call = with_a_pass  # type: ignore[method-assign]
    run_id = h.start(deadline=1)
    store._call = real  # type: ignore[method-assign]
    assert run_id in store.active_runs()
    assert h.saga.reap(now=store.now() + 100).abandoned == [run_id]


def test_defect_15_one_unreadable_run_does_not_stop_the_reaper(h: Harness) -> None:
    """A run with a corrupt field is escalated once; the other runs are still reaped."""
    broken, fine = h.start(deadline=1), h.start(deadline=1)
    h.saga.store.client.hset(run_keys(broken)[0], "deadline", "soon")
    report = h.saga.reap(now=h.saga.store.now() + 5)
    assert [run for run, _ in report.broken] == [broken]
    assert report.abandoned == [fine]
    [escalation] = h.saga.records.escalations(broken)
    assert escalation.reason == "the reaper could not handle this run"
    assert h.saga.reap(now=h.saga.store.now() + 5).broken == []  # not every pass


def test_a_record_the_database_refuses_for_good_is_escalated_not_retried_silently(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run row the database will never take (a value too long: R4 for hosted runs) is not
    "the database is away": the reaper escalates it, and the keys stay until it is written."""
    run_id = h.start()
    issued(h, run_id)
    refused = DataError("INSERT INTO saga_runs", {}, Exception("value too long"))

    def refuse(picture: Any) -> None:
        raise refused

    monkeypatch.setattr(h.saga.records, "record_outcome", refuse)
    h.saga.abort(run_id, "cancelled")
    h.drain()
    assert h.saga.store.head(run_id).recorded is False  # type: ignore[union-attr]

    report = h.saga.reap(now=h.saga.store.now() + 1)

    assert [run for run, _ in report.broken] == [run_id]
    [escalation] = h.saga.records.escalations(run_id)
    assert escalation.reason == "the reaper could not handle this run"
    assert "value too long" in escalation.cause
    assert h.saga.store.client.ttl(run_keys(run_id)[0]) == -1


def test_defect_16_a_write_that_raised_after_its_effect_is_found_and_undone(
    h: Harness,
) -> None:
    """On the last attempt the tool raises after crediting: the lookup finds it (16)."""
    run_id = h.start()
    tool = h.registry.get("issue_credit")
    real = tool.func

    def timeout_after_effect(ctx: Any, amount: int) -> Any:
        real(ctx, amount)
        raise TimeoutError("the reply never came")

    object.__setattr__(tool, "func", timeout_after_effect)
    step = credit_step(h, run_id)
    for _ in range(tool.retry.attempts):
        h.deliver(h.take(CREDIT, step=step))
    object.__setattr__(tool, "func", real)
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is StepState.SUCCEEDED
    assert [e["step"] for e in picture.stack] == [step]


def test_redis_clock_not_the_hosts(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose clock is an hour off changes no recorded time: scripts use Redis TIME."""
    monkeypatch.setattr(time, "time", lambda: 0.0)
    run_id = h.start()
    picture = h.saga.picture(run_id)
    assert abs(picture.created - h.saga.store.now()) < 5


def test_empty_owner_and_mismatched_messages_run_nothing(h: Harness) -> None:
    """A compensation message with no owner, a conclusion with none, and a forward message
    whose tool or arguments are not the reserved step's are all refused."""
    run_id = h.start()
    step = issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    store = h.saga.store
    assert store.begin_compensation(run_id, step, "c", "t", "", 30.0).status == "stale"
    assert store.conclude(run_id, RunState.COMPENSATED, "", "").status == "stale"
    other = h.start()
    forged = credit_step(h, other, amount=5)
    assert (
        store.begin_step(other, forged, "issue_credit", '{"amount":9999}', "c", 30.0).status
        == "mismatch"
    )
    assert (
        store.begin_step(other, forged, "send_mail", '{"amount":5}', "c", 30.0).status == "mismatch"
    )


def test_a_stale_revoke_of_a_compensation_changes_nothing(h: Harness) -> None:
    """A revoke from an unwind that was taken over is fenced by the owner."""
    run_id = h.start(deadline=1)
    issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    old = h.take(REVERSE)
    h.saga.reap(now=h.saga.store.now() + 5)  # the unwind looked stalled: a new owner
    on_revoked(h.saga.core, revoke_request(old), terminated=False)
    [undo] = h.saga.picture(run_id).compensations
    assert undo.state is CompensationState.PENDING
    h.drain()
    assert h.saga.picture(run_id).state is RunState.COMPENSATED


def test_a_redelivered_failed_compensation_resends_the_rest_once(h: Harness) -> None:
    """A crash between passing the chain on and the ack: the redelivery replays, and the
    duplicated rest of the chain runs each undo once, newest first."""
    run_id = h.start()
    first, second = issued(h, run_id), issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    h.world.failing_reversals = 5  # the newest undo (step 2) fails for good
    newest = h.take(REVERSE)
    assert newest.kwargs["compensates"] == second
    h.queue.insert(0, newest)
    while not any(m.kwargs.get("compensates") == first for m in h.queue):
        h.deliver(h.queue.pop(0))
    h.deliver(newest)  # redelivered after the worker died before the ack
    h.drain()
    picture = h.saga.picture(run_id)
    assert picture.state is RunState.ESCALATED
    assert h.world.reversals == [f"{run_id}:{first}:undo"]


def test_the_reaper_reads_only_due_runs(h: Harness) -> None:
    """Runs not due are not even looked at: the index says when to look."""
    runs = [h.start(deadline=600) for _ in range(5)]
    looked: list[str] = []
    real = h.saga.store.head
    h.saga.store.head = lambda run_id: looked.append(run_id) or real(run_id)  # type: ignore[method-assign]
    h.saga.reap()
    assert not set(runs) & set(looked)
    assert h.saga.store.active_count() >= 5


def test_a_second_escalation_supersedes_the_first(h: Harness) -> None:
    """A requeue that escalates again leaves one open escalation row, the newest."""
    run_id = h.start()
    issued(h, run_id)
    h.world.failing_reversals = 100
    h.saga.abort(run_id, "cancelled")
    h.drain()
    h.saga.requeue_failed_compensations(run_id)
    h.drain()
    rows = {e.escalation_id: (e.resolved, e.resolution) for e in h.saga.records.escalations(run_id)}
    assert rows == {
        f"{run_id}:0": (True, f"superseded by {run_id}:1"),
        f"{run_id}:1": (False, ""),
    }


def test_a_terminate_revoke_waits_for_the_lease_before_asking_the_lookup(h: Harness) -> None:
    """The child may still be applying the effect: in doubt, but no lookup while its lease
    holds (Redis clock); once it ran out, the reaper reconciles and the credit is undone."""
    run_id = h.start(deadline=1)
    step = credit_step(h, run_id)
    message = h.take(CREDIT, step=step)
    # (A lease of 3 s: the first reap below must come while it holds, on a loaded machine too.)
    h.saga.store.begin_step(run_id, step, "issue_credit", '{"amount":100}', "c", 3.0)
    on_revoked(h.saga.core, revoke_request(message), terminated=True)
    step_record = h.saga.picture(run_id).step(step)
    assert (step_record.state, step_record.reconciled) == (StepState.IN_DOUBT, "")
    assert h.saga.reap(now=h.saga.store.now() + 5).in_doubt == []  # the lease still holds
    h.world.credits[step_idempotency_key(run_id, step)] = 100  # the child finished after all
    time.sleep(3.1)
    report = h.saga.reap(now=h.saga.store.now() + 10)
    h.drain()
    assert report.in_doubt == [(run_id, step, "happened")]
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{step}:undo"]


def revoked_while_undoing(h: Harness, lease: float, terminated: bool) -> str:
    """A run whose only undo (of step 1) began under the claim "first" with ``lease`` seconds,
    then was revoked while running; its unwind settled. Its run id."""
    run_id = h.start()
    issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    undo = h.take(REVERSE)
    began = h.saga.store.begin_compensation(run_id, 1, "first", undo.task_id, "abort", lease)
    assert began.status == "run"
    on_revoked(h.saga.core, revoke_request(undo), terminated=terminated)
    h.drain()
    return run_id


def test_a_requeue_waits_for_the_lease_of_an_undo_revoked_while_running(h: Harness) -> None:
    """Found by the model check: an undo revoked while it ran may still be undoing; the run
    escalates, and a requeue's attempt waits ('busy') until that lease ran out, instead of
    running the same undo beside it."""
    # (A lease of 3 s: the requeue's attempt below must come while it holds, loaded or not.)
    run_id = revoked_while_undoing(h, 3.0, terminated=True)
    store = h.saga.store
    assert h.saga.picture(run_id).state is RunState.ESCALATED

    h.saga.requeue_failed_compensations(run_id)
    owner = h.saga.picture(run_id).extra["owner"]
    again = store.begin_compensation(run_id, 1, "second", "t2", owner, 30.0)
    assert again.status == "busy"  # the revoked execution's lease still holds
    time.sleep(3.1)
    h.drain()
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:1:undo"]


def test_a_requeued_undo_revoked_in_the_queue_keeps_the_running_executions_lease(
    h: Harness,
) -> None:
    """Found by the model check: an undo revoked (terminate) while it ran keeps its lease; a
    requeue's message revoked before it began fails the undo again, and must not end that
    lease with it: the next requeue's attempt still waits ('busy') for the first execution."""
    run_id = revoked_while_undoing(h, 30.0, terminated=True)
    store = h.saga.store
    h.saga.requeue_failed_compensations(run_id)
    on_revoked(h.saga.core, revoke_request(h.take(REVERSE)), terminated=False)
    h.drain()
    assert h.saga.picture(run_id).state is RunState.ESCALATED

    h.saga.requeue_failed_compensations(run_id)
    owner = h.saga.picture(run_id).extra["owner"]
    assert store.begin_compensation(run_id, 1, "third", "t3", owner, 30.0).status == "busy"
    store.record_compensation(run_id, 1, "fail", {"message": "killed"}, claim="first")
    assert store.begin_compensation(run_id, 1, "third", "t3", owner, 30.0).status == "run"


def test_an_undo_revoked_while_running_frees_its_lease_when_it_reports(h: Harness) -> None:
    """Found by the model check: the revoked execution ends (it reports its failure); it runs
    no more, so a requeued attempt must not wait for its lease, and its late report must not
    fail the requeued undo."""
    run_id = revoked_while_undoing(h, 30.0, terminated=False)
    store = h.saga.store
    h.saga.requeue_failed_compensations(run_id)

    late = store.record_compensation(run_id, 1, "fail", {"message": "late"}, claim="first")

    assert late.status == "stale"
    [comp] = h.saga.picture(run_id).compensations
    assert comp.state is CompensationState.PENDING
    owner = h.saga.picture(run_id).extra["owner"]
    assert store.begin_compensation(run_id, 1, "second", "t2", owner, 30.0).status == "run"


def test_an_older_undo_waits_for_a_newer_one_revoked_while_running(h: Harness) -> None:
    """Found by the model check: the revoke passes the chain on at once, but the revoked undo
    of step 2 may still be undoing; the undo of step 1 waits ('busy') until it reports."""
    run_id = h.start()
    issued(h, run_id)
    issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    newer = h.take(REVERSE)
    store = h.saga.store
    assert store.begin_compensation(run_id, 2, "d2", newer.task_id, "abort", 30.0).status == "run"
    on_revoked(h.saga.core, revoke_request(newer), terminated=True)

    older = store.begin_compensation(run_id, 1, "d1", "t1", "abort", 30.0)
    assert older.status == "busy"
    store.record_compensation(run_id, 2, "fail", {"message": "killed"}, claim="d2")
    assert store.begin_compensation(run_id, 1, "d1", "t1", "abort", 30.0).status == "run"


def test_the_reaper_does_not_abandon_a_run_that_moved_on_since_it_read_it(h: Harness) -> None:
    """Found by the model check: a reaper pass that read an idle run, then a call arrives;
    its abort on the stale reading is refused (version fence) and the call goes on."""
    run_id = h.start(deadline=1)
    stale = h.saga.picture(run_id)
    step = credit_step(h, run_id)
    report = ReapReport()
    _resolve(h.saga.core, stale, h.saga.store.now() + 10, report)
    assert report.abandoned == []
    h.drain()
    picture = h.saga.picture(run_id)
    assert (picture.state, picture.step(step).state) == (RunState.RUNNING, StepState.SUCCEEDED)


@pytest.mark.parametrize("script", ["begin_step", "begin_compensation"])
def test_a_lost_reply_to_a_begin_is_repeated_by_the_same_delivery(h: Harness, script: str) -> None:
    """Found by the model check: the begin ran on the server, its reply was lost; the same
    delivery asks again and is told to run (not "busy" until its own lease runs out)."""
    from saga.errors import StoreUnavailableError

    run_id = h.start()
    store, real = h.saga.store, h.saga.store._call
    lost = {"left": 1}

    def lose_one(name: str, rid: str, *args: Any, **kw: Any) -> Any:
        outcome = real(name, rid, *args, **kw)
        if name == script and lost["left"]:
            lost["left"] -= 1
            raise StoreUnavailableError("the reply was lost")
        return outcome

    store._call = lose_one  # type: ignore[method-assign]
    issued(h, run_id)
    h.saga.abort(run_id, "cancelled")
    h.drain()
    store._call = real  # type: ignore[method-assign]
    assert lost["left"] == 0
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:1:undo"]


def _losing_one_reply(h: Harness, script: str, outcome: str = "") -> dict[str, int]:
    """Make the next call of ``script`` (with ``outcome`` as its fourth argument, if given)
    run on the server and lose its reply, as a connection reset after the EVALSHA would."""
    from saga.errors import StoreUnavailableError

    store, real, real_read = h.saga.store, h.saga.store._call, h.saga.store._call_and_read
    lost = {"left": 1}

    def lose_one(name: str, rid: str, *args: Any, **kw: Any) -> Any:
        answer = real(name, rid, *args, **kw)
        if name == script and lost["left"] and (not outcome or args[1] == outcome):
            lost["left"] -= 1
            raise StoreUnavailableError("the reply was lost")
        return answer

    def lose_one_with_its_reading(name: str, rid: str, args: Any, extra: Any = ()) -> Any:
        # The script and the reading after it are one transaction: one reply to lose.
        answer = real_read(name, rid, args, extra)
        if name == script and lost["left"] and (not outcome or args[1] == outcome):
            lost["left"] -= 1
            raise StoreUnavailableError("the reply was lost")
        return answer

    store._call = lose_one  # type: ignore[method-assign]
    store._call_and_read = lose_one_with_its_reading  # type: ignore[method-assign]
    return lost


@pytest.mark.parametrize("script", ["record_retry", "record_failure"])
def test_a_lost_reply_to_a_steps_failure_keeps_its_unwind(h: Harness, script: str) -> None:
    """Found by the model check: the worker's failure (or retry) ran on the server and its
    reply was lost; the worker asks again and still retries, or starts the unwind it came to
    own, instead of failing the task and leaving the run to the reaper."""
    run_id = h.start()
    first = issued(h, run_id)
    step = h.saga.dispatch(run_id, "hold_stock", {"sku": "sku-1"}).step
    h.world.failing_holds = 2  # both attempts fail before any effect
    lost = _losing_one_reply(h, script)
    assert isinstance(h.deliver(h.take("tools.hold_stock", step=step)), Exception)
    h.saga.store.client.hset(run_keys(run_id)[1], f"{step}:lease", "0")  # the countdown ends
    h.drain()
    assert lost["left"] == 0
    picture = h.saga.picture(run_id)
    assert picture.step(step).state is StepState.FAILED
    assert picture.state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{first}:undo"]


@pytest.mark.parametrize("outcome", ["retry", "done"])
def test_a_lost_reply_to_an_undos_outcome_is_answered_as_a_repeat(h: Harness, outcome: str) -> None:
    """Found by the model check: an undo's retry (or its success) was recorded and the reply
    lost; the repeat is a duplicate, not an illegal move, and the unwind goes on."""
    run_id = h.start()
    first = issued(h, run_id)
    h.world.failing_reversals = 1 if outcome == "retry" else 0
    lost = _losing_one_reply(h, "record_compensation", outcome)
    h.saga.abort(run_id, "cancelled")
    for _ in range(5):
        h.drain()
        h.saga.store.client.hset(run_keys(run_id)[4], "1:lease", "0")  # a countdown ends
        if not h.queue:
            break
    assert lost["left"] == 0
    assert h.saga.picture(run_id).state is RunState.COMPENSATED
    assert h.world.reversals == [f"{run_id}:{first}:undo"]


def test_a_lost_reply_to_an_in_doubt_verdict_still_starts_the_unwind(h: Harness) -> None:
    """Found by the model check: the crash-looping step's verdict (in doubt, reconciled) was
    recorded and the reply lost; the worker asks again, finds it settled, and still sends the
    unwind that verdict came to own."""
    run_id = h.start()
    step = h.saga.dispatch(run_id, "hold_stock", {"sku": "sku-1"}).step
    died = h.saga.store.begin_step(run_id, step, "hold_stock", '{"sku":"sku-1"}', "dead/1", 0.0)
    assert died.status == "run"
    h.world.failing_holds = 1
    lost = _losing_one_reply(h, "resolve_in_doubt")
    assert isinstance(h.deliver(h.take("tools.hold_stock", step=step)), RuntimeError)
    h.drain()
    assert lost["left"] == 0
    assert h.saga.picture(run_id).state is RunState.ESCALATED
