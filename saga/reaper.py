"""Runs whose outcome nobody is going to report: steps in doubt, and the periodic reaper.

A step is *in doubt* when its worker died, it timed out or it was revoked: its effect may or
may not have happened. It is reconciled before any unwind, by asking the tool's ``lookup``
(by idempotency key) whether the effect exists. The reaper (Celery beat, ``saga.reap``) finds
runs with no progress past their deadline (a lost errback, a worker that died between effect
and push, a run the agent abandoned) and resolves them with the same moves the worker makes.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.constants import step_idempotency_key
from saga.errors import RunEndedError
from saga.model import RunState, StepState, ToolClass
from saga.stack import RunPicture

if TYPE_CHECKING:
    from saga.engine import Saga

logger = logging.getLogger("saga.reaper")

#: Seconds past the task time limit before a started step is taken for lost.
_TIME_LIMIT_MARGIN = 5.0


@dataclass
class ReapReport:
    """What one pass of the reaper did, for logs and tests."""

    examined: int = 0
    forgotten: int = 0
    abandoned: list[str] = field(default_factory=list)
    never_started: list[tuple[str, int]] = field(default_factory=list)
    in_doubt: list[tuple[str, int, str]] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)


def mark_in_doubt(saga: Saga, run_id: str, step: int, error: dict[str, Any]) -> str:
    """Mark a step in doubt and reconcile it at once; returns the lookup's verdict."""
    saga.store.mark_in_doubt(run_id, step, error)
    return reconcile(saga, run_id, step)


def reconcile(saga: Saga, run_id: str, step: int) -> str:
    """Settle an in-doubt step by what its lookup finds: ``happened`` (its undo is pushed),
    ``not_happened`` (nothing to undo) or ``unknown`` (no lookup: a person must look)."""
    record = saga.picture(run_id).step(step)
    if record.state is not StepState.IN_DOUBT:
        return "settled"
    tool = saga.registry.get(record.tool)
    verdict, result = "unknown", None
    if tool.tool_class is ToolClass.READ:
        verdict = "not_happened"  # a read has no effect to find, nor to undo
    elif tool.lookup is not None:
        try:
            result = tool.lookup(step_idempotency_key(run_id, step), record.args)
            verdict = "not_happened" if result is None else "happened"
        except Exception:
            logger.exception("run %s: lookup of step %d (%s) failed", run_id, step, tool.name)
    result_json = entry_json = ""
    if verdict == "happened":
        result_json, entry_json, _ = saga.encode_effect(tool, run_id, step, record.args, result)
    irreversible = tool.tool_class is ToolClass.IRREVERSIBLE_WRITE
    doubt = ""
    if irreversible:
        doubt = f"irreversible step {step} ({tool.name}) in doubt (lookup: {verdict})"
    elif verdict == "unknown":
        doubt = f"step {step} ({tool.name}) in doubt: nothing could tell whether it happened"
    outcome = saga.store.resolve_in_doubt(
        run_id, step, verdict, result_json, entry_json, irreversible, doubt
    )
    logger.warning("run %s: step %d (%s) was in doubt: %s", run_id, step, tool.name, verdict)
    if outcome.owns_unwind:
        saga.start_unwind(run_id, f"step:{step}")
    return verdict


def reap(saga: Saga, now: float | None = None) -> ReapReport:
    """One pass over the runs not yet ended; resolves those idle past their deadline."""
    report = ReapReport()
    now = now or time.time()
    for run_id in saga.store.active_runs():
        report.examined += 1
        picture = saga.store.picture(run_id)
        if picture is None or picture.state.ended:
            saga.store.forget(run_id)
            report.forgotten += 1
            continue
        if now - picture.updated < picture.deadline:
            continue
        try:
            _resolve(saga, picture, now, report)
        except Exception:
            logger.exception("reaper could not resolve run %s; next pass tries again", run_id)
    return report


def _may_still_run(saga: Saga, picture: RunPicture, step: int, now: float) -> bool:
    """A step whose delivery started within the task time limit may still be running: calling
    it lost now would reconcile it before its effect lands."""
    started = picture.step(step).started
    limit = float(saga.app.conf.get("task_time_limit") or 0)
    return started is not None and now - started < limit + _TIME_LIMIT_MARGIN


def _resolve(saga: Saga, picture: RunPicture, now: float, report: ReapReport) -> None:
    run_id, idle = picture.run_id, int(now - picture.updated)
    if picture.in_flight:
        for step in picture.in_flight:
            state = picture.step(step).state
            if state is StepState.DISPATCHED:
                # Never started: no effect can exist, so it simply failed.
                error = {"type": "NeverStarted", "message": f"not picked up in {idle}s"}
                if saga.store.record_failure(run_id, step, error).owns_unwind:
                    saga.start_unwind(run_id, f"step:{step}")
                report.never_started.append((run_id, step))
            elif state is StepState.RUNNING and _may_still_run(saga, picture, step, now):
                continue
            elif state in (StepState.RUNNING, StepState.IN_DOUBT):
                error = {"type": "NoOutcome", "message": f"no outcome after {idle}s"}
                report.in_doubt.append((run_id, step, mark_in_doubt(saga, run_id, step, error)))
        return
    if picture.state is RunState.RUNNING:
        try:
            saga.abort(run_id, f"abandoned: no progress for {idle}s")
            report.abandoned.append(run_id)
        except RunEndedError:
            pass
    elif picture.state is RunState.UNWINDING:
        # The owner died before sending the chain, or the chain was lost: send it again.
        owner = f"reaper:{uuid.uuid4().hex[:8]}"
        if saga.store.take_over(run_id, picture.version, owner):
            saga.start_unwind(run_id, owner)
            report.resumed.append(run_id)
