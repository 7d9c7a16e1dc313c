"""A compensation: one delivery of ``tools.<name>`` undoing a step, and the unwind's chain
carried on from it, so that the older undos and the conclusion still run however this one
ends (done, replayed, or failed for good).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from celery import Celery, Task
from celery.canvas import Signature, signature
from celery.exceptions import Ignore

from saga import metrics, payload, rules
from saga.celery_amqp import broker_countdown
from saga.constants import CONCLUDE_UNWIND_TASK
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
from saga.errors import StepInDoubtError
from saga.model import StepContext
from saga.picture import RunPicture
from saga.soft_limit import call_time
from saga.stack import Conclusion, Outcome
from saga.tools import Tool

# The workers' logger, whichever of their modules logs: operators and tests match its name.
logger = logging.getLogger("saga.worker")


def compensate(core: Core, task: Task, tool: Tool, run_id: str, step: int, unwind: str) -> Any:
    store = core.store
    claim = claim_of(task)
    task_id = str(task.request.id or "")
    begin = patiently(
        core,
        f"run {run_id} undo {step}: begin",
        store.begin_compensation,
        run_id,
        step,
        claim,
        task_id,
        unwind,
        core.lease_seconds,
        core.settings.reversal_ask_seconds,
    )
    if begin.status in ("ask", "asked"):  # a person decides first: the unwind waits here
        return _ask(core, task, run_id, step, tool, begin.status, str(begin.values[0]))
    if begin.status in ("done", "failed", "kept"):  # settled already: pass the chain on
        logger.info("run %s: compensation of step %d already %s", run_id, step, begin.status)
        _conclude_here(core, task, run_id)
        _pass_on(core, task)
        return {"compensated": step, "replayed": True}
    if begin.status == "busy":  # another execution (or a newer undo) still runs: wait for it
        raise task.retry(
            countdown=broker_countdown(
                task.app.conf, min(float(begin.values[0]), BUSY_WAIT.backoff_max)
            )
        )
    if begin.status != "run":  # a stale chain, or the run is gone: stop this chain here
        logger.warning("run %s: compensation of step %d not run: %s", run_id, step, begin)
        raise Ignore()
    attempt, entry = int(begin.values[0]), payload.loads(begin.values[1])
    if attempt > tool.retry.attempts + core.settings.max_redeliveries:
        message = f"started {attempt - 1} times without an outcome (a crash loop?)"
        error = {"type": "AttemptsExceeded", "message": message}
        _record_compensation(core, run_id, step, "fail", error, claim)
        metrics.compensation(tool.name, "failed")
        _continue_chain(core, task, run_id)
        raise StepInDoubtError(f"run {run_id}: compensation of step {step}: {message}")
    ctx = StepContext(run_id, step, entry["idempotency_key"], attempt, compensating=True)
    try:
        with call_time():
            strike(core, "before_compensation", tool)
            call_tool(tool, ctx, entry["args"])
            strike(core, "after_compensation", tool)
    except Exception as exc:
        strike(core, "after_compensation_failed", tool)
        if retryable(exc) and tool.retry.allows_another(attempt):
            _record_compensation(core, run_id, step, "retry", error_of(exc, attempt), claim)
            metrics.compensation(tool.name, "retried")
            countdown = broker_countdown(task.app.conf, tool.retry.delay(attempt))
            raise task.retry(exc=exc, countdown=countdown) from exc
        last = _recorded_last(core, task, run_id, step, "fail", error_of(exc, attempt), claim)
        metrics.compensation(tool.name, "failed")
        logger.error(
            "run %s: compensation %s of step %d failed for good after %d attempt(s): %s",
            run_id,
            tool.name,
            step,
            attempt,
            exc,
        )
        _continue_chain(core, task, run_id, last)
        raise
    following = None if _conclusion_left(task, run_id) is not None else _prepared_rest(core, task)
    if following is not None:  # the next undo's message goes with the record, in its script
        recorded = _record_compensation(core, run_id, step, "done", None, claim, following[1])
        metrics.compensation(tool.name, "done")
        if recorded.status == "ok":
            core.prepared.pushed_from_here(following[0])
            task.request.chain = None  # passed on: Celery's tracer has nothing left to send
        else:  # recorded before (a repeat whose first reply was lost): passed on apart
            _pass_on(core, task)
        return {"compensated": step}
    concluded, last = _recorded_done_last(core, task, tool, run_id, step, claim)
    if not concluded:
        _conclude_here(core, task, run_id, last)
    _pass_on(core, task)
    return {"compensated": step}


def _ask(
    core: Core, task: Task, run_id: str, step: int, tool: Tool, status: str, until: str
) -> dict[str, Any]:
    """The undo's reversal policy asks a person first: the chain stops here (the newer undos
    have run, the older ones wait their turn) and no worker is held. A person's answer starts
    the unwind again (``saga.operations.decide_reversal``); the reaper looks at the question
    when it expires, and expires it into an escalation if nobody answered. The listeners are
    told (the notification sinks get a notice)."""
    task.request.chain = None  # nothing after this undo is sent until a person answers
    expires = float(until) if until else core.store.now()
    core.store.schedule(run_id, expires)
    if status == "ask":
        logger.warning(
            "run %s: a person is asked whether to reverse step %d (%s) before %s: "
            "saga reversal %s %d --reverse | --keep --note ... | --later",
            run_id,
            step,
            tool.name,
            until,
            run_id,
            step,
        )
    # Each delivery that finds the question open (a redelivery of one killed before it told
    # anyone too): the listeners act once per question (the notifier's notice is keyed by it).
    core.reversal_asked(run_id, step)
    return {"asked": step, "until": expires}


def _record_compensation(
    core: Core,
    run_id: str,
    step: int,
    outcome: str,
    error: dict[str, Any] | None,
    claim: str,
    push: tuple[str, str] | None = None,
) -> Outcome:
    """An undo's outcome, kept however briefly the stack's Redis is away (a repeat whose first
    call landed is answered as a duplicate). ``push``: the next undo's message (its queue and
    the message), pushed by the script that records this one done."""
    return patiently(
        core,
        f"run {run_id} undo {step}: {outcome}",
        core.store.record_compensation,
        run_id,
        step,
        outcome,
        error,
        claim,
        "",  # (no owner: not a revoke)
        push,
    )


def _recorded_last(
    core: Core,
    task: Task,
    run_id: str,
    step: int,
    outcome: str,
    error: dict[str, Any] | None,
    claim: str,
) -> RunPicture | None:
    """``_record_compensation``; when all that is left of the chain is its conclusion, with
    the run read back in the same transaction: the picture ``_conclude_here`` judges, without
    a round trip of its own. None when it was not read."""
    if _conclusion_left(task, run_id) is None:
        _record_compensation(core, run_id, step, outcome, error, claim)
        return None
    what = f"run {run_id} undo {step}: {outcome}"
    record = core.store.record_last_compensation
    return patiently(core, what, record, run_id, step, outcome, error, claim)[1]


def _recorded_done_last(
    core: Core, task: Task, tool: Tool, run_id: str, step: int, claim: str
) -> tuple[bool, RunPicture | None]:
    """``_recorded_last`` of an undo done and, when all that is left of the chain is its
    conclusion, that conclusion made by the same script: one wait for the disk where the
    record and the conclusion apart make two. The verdict is judged on the run as read just
    before (a read waits for no disk), as the record will leave it (``rules.once_undone``);
    the script concludes only if the record leaves the run at that reading's version, and
    the ended run, known from that reading and what the script wrote, is recorded in SQL.
    True once concluded here; else False and the picture ``_conclude_here`` concludes on
    (None: read it again)."""
    left = _conclusion_left(task, run_id)
    owner = str((left or {}).get("owner") or "")
    undone = None
    if left is not None and owner:
        read = patiently(core, f"run {run_id} undo {step}: the run", core.store.picture, run_id)
        undone = None if read is None else rules.once_undone(read, step)
    if left is None or undone is None or not undone.version.isdigit():
        recorded = _recorded_last(core, task, run_id, step, "done", None, claim)
        metrics.compensation(tool.name, "done")  # counted before the run's end, as it came
        return False, recorded
    state, reason = rules.conclusion(undone)
    judged = Conclusion(state, reason or undone.reason, owner, str(int(undone.version) + 1))
    record = core.store.record_done_and_conclude
    what = f"run {run_id} undo {step}: done"
    outcome = patiently(core, what, record, run_id, step, claim, judged)
    metrics.compensation(tool.name, "done")
    if outcome.status != "ok" or outcome.values[:1] != ("ok",):
        return False, None  # recorded (or a repeat): concluded the usual way, read again
    answer = outcome.values[1:]
    at = float(answer[1])  # the record's time: the same script's clock as the end's
    settled = [replace(c, settled_at=at) if c.step == step else c for c in undone.compensations]
    ended = replace(undone, compensations=settled).concluded(state, answer)
    try:
        core.concluded(ended, left.get("sent_at"))
    except Exception as exc:  # concluded: the conclusion's message records it, as it retries
        logger.warning("run %s: recording its conclusion failed (%r): sent", run_id, exc)
        return True, None
    task.request.chain = None  # concluded: Celery's tracer has nothing left to send
    return True, ended


def _conclusion_left(task: Task, run_id: str) -> dict[str, Any] | None:
    """The arguments of the unwind's conclusion (``saga.conclude_unwind`` of ``run_id``), when
    it is all that is left of this task's chain; None otherwise."""
    chain = task.request.chain
    if not chain or len(chain) != 1:
        return None
    following = chain[0]
    kwargs = following.get("kwargs") or {}
    if following.get("task") != CONCLUDE_UNWIND_TASK or kwargs.get("run_id") != run_id:
        return None
    return dict(kwargs)


def _conclude_here(core: Core, task: Task, run_id: str, picture: RunPicture | None = None) -> None:
    """When all that is left of this unwind's chain is its conclusion, conclude here rather
    than send it: the call ``saga.conclude_unwind`` would make, one Celery message fewer per
    unwind. The compensation's outcome is recorded already, as it is when the tracer sends
    that message, and a redelivery of this task replays its outcome and comes here again.
    If the conclusion raises (the stack's Redis or the records database away), the message is
    sent as before and retries on its own. ``picture``: the run as read with the undo's
    outcome (``_recorded_last``)."""
    kwargs = _conclusion_left(task, run_id)
    if kwargs is None:
        return
    try:
        core.conclude(run_id, str(kwargs.get("owner") or ""), kwargs.get("sent_at"), picture)
    except Exception as exc:
        logger.warning("run %s: concluding after its last undo failed (%r): sent", run_id, exc)
        return
    task.request.chain = None  # concluded: Celery's tracer has nothing left to send


def _prepared_rest(core: Core, task: Task) -> tuple[Signature, tuple[str, str]] | None:
    """The rest of the unwind's chain as Celery's tracer would send it once this task returns,
    prepared (``saga.prepared_publish``): its first signature, and the queue and the message.
    None when nothing is left, and where Celery's publish sends it."""
    remaining = task.request.chain
    if not remaining:
        return None
    following = signature(remaining[-1], app=task.app)
    made = core.prepared.chain_message(following, remaining[:-1])
    return None if made is None else (following, made)


def _pass_on(core: Core, task: Task) -> None:
    """Send the rest of the unwind now, as Celery's tracer would once this task returns, where
    its message is prepared: one push, without Celery's publish in Python. Anywhere else, or
    if the push fails, the tracer sends it, as it always did."""
    prepared = _prepared_rest(core, task)
    if prepared is None:
        return
    following, (queue, message) = prepared
    try:
        core.prepared.push(queue, message)
    except Exception as exc:
        logger.warning("the rest of the unwind was not pushed (%r): Celery's publish sends it", exc)
        return
    core.prepared.pushed_from_here(following)
    task.request.chain = None


def _continue_chain(core: Core, task: Task, run_id: str, picture: RunPicture | None = None) -> None:
    """Send the rest of the unwind although this compensation failed.

    The seed's rule: a failed compensation is recorded and the older ones still run. Celery
    stops a chain at a failed task, so the task hands the chain on itself, as Celery's tracer
    does on success (concluding here when nothing else is left), and then fails visibly
    (Flower shows it red). ``picture``: as ``_conclude_here`` takes it.
    """
    _conclude_here(core, task, run_id, picture)
    remaining = list(task.request.chain or [])
    task.request.chain = None
    try:
        send_rest(task.app, remaining, task.request.id, task.request.root_id)
    except Exception:
        # The failure is recorded; the run stays unwinding and the reaper takes the unwind
        # over at its deadline. The task still fails with the compensation's own error.
        logger.exception("run %s: the rest of the unwind could not be sent", task.request.id)


def send_rest(app: Celery, remaining: list[Any], parent_id: Any, root_id: Any) -> None:
    if not remaining:
        return
    following = signature(remaining[-1], app=app)
    following.apply_async(chain=remaining[:-1], parent_id=parent_id, root_id=root_id)
