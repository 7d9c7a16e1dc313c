"""A tool's forward step: one delivery of ``tools.<name>`` with a step, from claiming the step
to recording what it did, so that a redelivery replays the outcome and never applies the
effect twice, and a failure whose effect may still have happened is never taken as nothing.

The compensation is pushed inside the step's own task, before the message is acknowledged
(``task_acks_late``): a ``link`` callback would be a separate message sent before the result is
stored and the message acked, so a crash could lose the push or make it twice.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from celery import Task
from celery.exceptions import Ignore
from sqlalchemy.exc import SQLAlchemyError

from saga import metrics, payload
from saga.celery_amqp import broker_countdown
from saga.constants import step_idempotency_key
from saga.core import Core
from saga.delivery import (
    BUSY_WAIT,
    call_tool,
    claim_of,
    error_of,
    patiently,
    retryable,
    strike,
)
from saga.effects import UNDO_PROBLEM
from saga.errors import StepFailedError, StepInDoubtError, ToolRejected
from saga.model import RunState, StepContext, ToolClass
from saga.picture import RunPicture
from saga.reaper import mark_in_doubt
from saga.soft_limit import call_time
from saga.stack import Outcome
from saga.tools import Tool
from saga.unwind import unwinding

# The workers' logger, whichever of their modules logs: operators and tests match its name.
logger = logging.getLogger("saga.worker")

#: Arguments already crossed the broker within the dispatcher's limit: no second limit here.
_NO_LIMIT = 1 << 40


def run_step(
    core: Core, task: Task, tool: Tool, run_id: str, step: int, args: dict[str, Any]
) -> Any:
    store = core.store
    # (The dispatcher applied the size limit; this only has to match what it stored.)
    args_json = payload.dumps(args, what="arguments", limit=_NO_LIMIT)
    claim = claim_of(task)
    begin = patiently(
        core,
        f"run {run_id} step {step}: begin",
        store.begin_step,
        run_id,
        step,
        tool.name,
        args_json,
        claim,
        core.lease_seconds,
    )
    if begin.status == "succeeded":  # a redelivery: replay, never re-apply
        _after_success(core, run_id, step, int(begin.values[1]) == 1, int(begin.values[2]) == 1)
        return payload.loads(begin.values[0])
    if begin.status in ("failed", "rejected"):
        if int(begin.values[1]) == 1:  # a redelivered errback whose unwind was never sent
            core.start_unwind(run_id, f"step:{step}")
        core.step_settled(run_id, step)  # its first delivery may have died before telling
        error = (payload.loads(begin.values[0] or None) or {}).get("message", "failed")
        if begin.status == "rejected":
            return {"rejected": error}
        raise StepFailedError(run_id, step, tool.name, f"{error} (redelivered)")
    if begin.status == "busy":  # another delivery holds the step: come back when it may not
        raise task.retry(
            countdown=broker_countdown(
                task.app.conf, min(float(begin.values[0]), BUSY_WAIT.backoff_max)
            )
        )
    if begin.status != "run":
        if begin.owns_unwind:
            core.start_unwind(run_id, f"step:{step}")
        if begin.status == "skip":
            core.step_settled(run_id, step)
        log = logger.error if begin.status == "mismatch" else logger.warning
        log("run %s step %d (%s) not run: %s", run_id, step, tool.name, begin)
        raise Ignore()
    attempt, feed_back = int(begin.values[0]), begin.values[1] == "feed_back"
    orphaned = len(begin.values) > 2 and str(begin.values[2]) == "1"
    if attempt > tool.retry.attempts + core.settings.max_redeliveries:
        # Only redeliveries push this far (the worker died mid-step each time): stop looping,
        # and let the lookup say whether the effect happened.
        message = f"started {attempt - 1} times without an outcome (a crash loop?)"
        error = {"type": "AttemptsExceeded", "message": message}
        _in_doubt(core, run_id, step, error)
        raise StepInDoubtError(f"run {run_id} step {step} ({tool.name}): {message}")
    ctx = StepContext(run_id, step, step_idempotency_key(run_id, step), attempt)
    try:
        with call_time():
            strike(core, "before_effect", tool)
            result = call_tool(tool, ctx, args)
            strike(core, "after_effect", tool)
    except ToolRejected as exc:  # a business refusal: nothing happened, the model is told
        logger.info("run %s step %d (%s) rejected: %s", run_id, step, tool.name, exc)
        _record_failure(core, run_id, step, error_of(exc, attempt), "reject")
        metrics.step(tool.name, "rejected")
        return {"rejected": str(exc)}
    except Exception as exc:
        if retryable(exc) and tool.retry.allows_another(attempt):
            countdown = tool.retry.delay(attempt)
            hold = countdown + core.lease_seconds
            patiently(
                core,
                f"run {run_id} step {step}: the retry",
                store.record_retry,
                run_id,
                step,
                error_of(exc, attempt),
                hold,
            )
            metrics.step(tool.name, "retried")
            raise task.retry(exc=exc, countdown=broker_countdown(task.app.conf, countdown)) from exc
        event = "reject" if feed_back else "fail"
        error = error_of(exc, attempt)
        _settle_final_failure(core, tool, run_id, step, args, error, event, orphaned)
        raise
    _settle_success_patiently(core, tool, run_id, step, args, result, feed_back)
    strike(core, "after_push", tool)
    return result


def _settle_final_failure(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    error: dict[str, Any],
    event: str = "fail",
    orphaned: bool = False,
) -> None:
    """A write that raised may still have had its effect (a timeout after the request went
    out): where the tool declares a lookup, ask it before concluding that nothing happened.
    ``event``: ``fail`` (the run unwinds) or ``reject`` (its agent feeds failures back).

    ``orphaned``: an earlier delivery began the step and died without an outcome. That this
    attempt raised says nothing about what the dead one did: without a lookup to ask, the
    step is in doubt (a person is told), never taken as not applied."""
    writes = tool.tool_class is not None and tool.tool_class.is_write
    if orphaned and writes and tool.lookup is None:
        message = (
            f"{error.get('message', 'failed')}; an earlier delivery began this step and died "
            "without an outcome, and the tool has no lookup to tell whether it happened"
        )
        logger.warning("run %s step %d (%s) failed: %s", run_id, step, tool.name, message)
        error = {**error, "message": message}
        _in_doubt(core, run_id, step, error)
        metrics.step(tool.name, "failed")
        return
    if tool.lookup is not None and writes:
        try:
            with call_time():
                found = tool.lookup(step_idempotency_key(run_id, step), args)
        except Exception as exc:
            logger.exception("run %s step %d: lookup after the failure failed", run_id, step)
            error = {**error, "lookup": f"{type(exc).__name__}: {exc}"}
            _in_doubt(core, run_id, step, error)
            return
        if found is not None:
            logger.warning(
                "run %s step %d (%s) failed, but its lookup found the effect: recording it",
                run_id,
                step,
                tool.name,
            )
            _settle_success_patiently(core, tool, run_id, step, args, found, event == "reject")
            return
    _record_failure(core, run_id, step, error, event)
    metrics.step(tool.name, "failed" if event == "fail" else "rejected")


def _in_doubt(core: Core, run_id: str, step: int, error: dict[str, Any]) -> None:
    """Mark the step in doubt and reconcile it, however briefly the stack's Redis is away (a
    repeat whose first call landed resumes what that call decided)."""
    patiently(core, f"run {run_id} step {step}: in doubt", mark_in_doubt, core, run_id, step, error)


def _record_failure(core: Core, run_id: str, step: int, error: dict[str, Any], event: str) -> None:
    what = f"run {run_id} step {step}: the failure"
    picture = None
    if event != "fail":
        outcome = patiently(core, what, core.store.record_failure, run_id, step, error, event)
    elif (pushed := _fail_and_push(core, run_id, step, error)) is not None:
        outcome = pushed
    else:  # read back with it: the unwind it may own starts from that reading
        store = core.store
        outcome, picture = patiently(core, what, store.record_final_failure, run_id, step, error)
    if outcome.owns_unwind and not outcome.pushed:
        core.start_unwind(run_id, f"step:{step}", picture)
    # The script checked the step's hosted turn when it settled it (not on a repeat).
    turn_done = int(outcome.values[1]) if outcome.status == "ok" else None
    core.step_settled(run_id, step, turn_done)


def _fail_and_push(core: Core, run_id: str, step: int, error: dict[str, Any]) -> Outcome | None:
    """The final failure recorded, and the unwind it makes this step own pushed and marked
    sent by the same script: one wait for the disk where the usual way makes two (the record,
    then the mark). The chain is made beforehand, from the run as read just before (a read
    waits for no disk) and as this failure will leave it; the script pushes it only if the
    run is still at that reading's version. None where that cannot be (the failure then goes
    the usual way): nothing is prepared here, or the reading says this step will not own a
    plain unwind (another step in flight, another owner, a pivot passed), or that its keys
    are behind their SQL record (``Core.start_unwind`` escalates that)."""
    if not core.prepared.may_prepare():
        return None
    owner = f"step:{step}"
    before = patiently(core, f"run {run_id} step {step}: the run", core.store.picture, run_id)
    if before is None or not _would_own_plain_unwind(before, step):
        return None
    after = replace(before, state=RunState.UNWINDING, version=str(int(before.version) + 1))
    try:
        if core.behind_records(run_id, after.state, after.version, after.recorded_version):
            return None
    except SQLAlchemyError:
        return None
    prepared = core.prepared_unwind(after, owner)
    if prepared is None:
        return None
    record = core.store.record_failure_and_push
    what = f"run {run_id} step {step}: the failure"
    outcome = patiently(core, what, record, run_id, step, error, before.version, prepared.push)
    if outcome.pushed:
        core.prepared.pushed_from_here(prepared.signatures[0])
        unwinding(after, prepared.signatures)
    return outcome


def _would_own_plain_unwind(picture: RunPicture, step: int) -> bool:
    """Whether failing ``step`` makes it the owner of an unwind that sends a chain, as
    ``maybe_own`` in the scripts judges it, from a reading the script fences by version."""
    return (
        picture.state in (RunState.RUNNING, RunState.UNWINDING)
        and picture.version.isdigit()
        and picture.pivot_step is None
        and picture.in_flight == (step,)
        and not picture.extra.get("owner")
    )


def _settle_success_patiently(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
    feed_back: bool = False,
) -> None:
    """The effect happened; recording it must not depend on the broker being up.

    When the stack's Redis is away, a Celery retry would have to publish to that same Redis
    and the message would be dropped. So the task keeps trying itself, for a bounded time;
    the step never looks successful before its undo is pushed. A repeat whose first call did
    land (only the reply was lost) answers what that first call decided. If Redis stays away,
    the exception leaves the message unacknowledged for redelivery (or the reaper's lookup).
    """
    patiently(
        core,
        f"run {run_id} step {step}: the push",
        settle_success,
        core,
        tool,
        run_id,
        step,
        args,
        result,
        feed_back,
    )


def settle_success(
    core: Core,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
    feed_back: bool = False,
) -> None:
    """Record the result, push the undo and mark the pivot in one script.

    An effect that cannot be recorded as it is (``saga.effects``) is still a success with its
    undo pushed, its problem kept as the step's error in the same script, and the run set
    failing there too: always when the undo could not be built (the effect is live with no
    undo), and for a result that cannot be recorded unless the step's failures are fed back
    (``feed_back``: the caller is told and the run goes on, the undo on its stack)."""
    result_json, entry_json, problem = core.encode_effect(tool, run_id, step, args, result)
    fails = ""
    if problem is not None and (problem["type"] == UNDO_PROBLEM or not feed_back):
        fails = f"step {step} ({tool.name}): {problem['message']}"
        logger.error("run %s step %d (%s): %s; the run fails", run_id, step, tool.name, fails)
    elif problem is not None:
        logger.error("run %s step %d (%s): %s", run_id, step, tool.name, problem["message"])
        problem = {**problem, "run_goes_on": True}  # what the caller's error says
    irreversible = tool.tool_class is ToolClass.IRREVERSIBLE_WRITE
    outcome = core.store.record_success(
        run_id, step, result_json, entry_json, irreversible, problem, fails
    )
    if outcome.status in ("ok", "dup", "late"):
        metrics.step(tool.name, "succeeded")
        mine = int(outcome.values[0]) == 1
        turn_done = int(outcome.values[2]) if len(outcome.values) > 2 else None
        _after_success(core, run_id, step, mine, int(outcome.values[1]) == 1, turn_done)
    else:  # never silent: the store logged the refused transition; a person must look
        raise StepFailedError(run_id, step, tool.name, f"its success was refused: {outcome}")


def _after_success(
    core: Core, run_id: str, step: int, mine: bool, late: bool, turn_done: int | None = None
) -> None:
    """What the recorded success decided (the first time, or again on a repeat): start the
    unwind this step came to own, put a run an effect reopened back on the record, and move
    a hosted run on (``turn_done``: see ``Saga.step_settled``)."""
    if late:
        core.landed_late(run_id)
    if mine:
        core.start_unwind(run_id, f"step:{step}")
    core.step_settled(run_id, step, turn_done)
