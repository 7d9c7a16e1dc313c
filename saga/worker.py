"""The Celery side: one task per tool (``tools.<name>``), run forward as a step or backward as
a compensation, plus ``saga.conclude_unwind``.

The compensation is pushed inside the step's own task, before the message is acknowledged
(``task_acks_late``): a ``link`` callback would be a separate message sent before the result is
stored and the message acked, so a crash could lose the push or make it twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from celery.canvas import signature
from celery.exceptions import Ignore

from saga import payload
from saga.constants import (
    CONCLUDE_UNWIND_TASK,
    compensation_idempotency_key,
    step_idempotency_key,
    tool_task_name,
)
from saga.errors import (
    CompensationBuildError,
    InvalidArgumentsError,
    PayloadError,
    StepFailedError,
)
from saga.model import StepContext, ToolClass
from saga.retry import RetryPolicy

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.tools import Tool

logger = logging.getLogger("saga.worker")

_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "max_retries": None,  # the tool's RetryPolicy decides, counted in Redis across redeliveries
    "ignore_result": True,  # outcomes live in the saga store, where the agent reads them
    "shared": False,
}


def install(app: Celery, saga: Saga) -> None:
    """Register every tool of ``saga.registry`` and the conclude task on ``app``."""
    for tool in saga.registry:
        _install_tool(app, saga, tool)

    @app.task(name=CONCLUDE_UNWIND_TASK, **{**_TASK_OPTIONS, "max_retries": 20})
    def conclude_unwind(self: Task, run_id: str) -> str:
        try:
            return saga.conclude(run_id).value
        except Exception as exc:
            # The records database may be down: keep the run unwinding and try again.
            attempt = self.request.retries + 1
            raise self.retry(exc=exc, countdown=RetryPolicy().delay(attempt)) from exc


def _install_tool(app: Celery, saga: Saga, tool: Tool) -> None:
    @app.task(name=tool_task_name(tool.name), **_TASK_OPTIONS)
    def run_tool(
        self: Task,
        run_id: str,
        step: int | None = None,
        args: dict[str, Any] | None = None,
        compensates: int | None = None,
    ) -> Any:
        if compensates is not None:
            return _compensate(saga, self, tool, run_id, compensates)
        if step is None:
            raise InvalidArgumentsError(f"{tool.name} task needs a step or a compensation")
        return _forward(saga, self, tool, run_id, step, args or {})


def _error(exc: BaseException, attempt: int) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "attempt": attempt}


def _retryable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retryable", True)) and not isinstance(exc, InvalidArgumentsError)


def _call(tool: Tool, ctx: StepContext, args: dict[str, Any]) -> Any:
    kwargs = tool.python_args(args)
    if tool.wants_context:
        kwargs["ctx"] = ctx
    return tool.func(**kwargs)


def _forward(
    saga: Saga, task: Task, tool: Tool, run_id: str, step: int, args: dict[str, Any]
) -> Any:
    store = saga.store
    begin = store.begin_step(run_id, step)
    if begin.status == "succeeded":  # a redelivery: replay, never re-apply
        return payload.loads(begin.values[0])
    if begin.status == "failed":
        _settle_failure(saga, run_id, step, payload.loads(begin.values[0]) or {})
        raise StepFailedError(run_id, step, tool.name, "already failed (redelivered)")
    if begin.status != "run":
        if begin.owns_unwind:
            saga.start_unwind(run_id, f"step:{step}")
        logger.warning("run %s step %d (%s) not run: %s", run_id, step, tool.name, begin.status)
        raise Ignore()
    attempt = int(begin.values[0])
    if attempt > tool.retry.attempts:
        # Only redeliveries push past the policy (the worker died mid-step each time).
        error = {"type": "AttemptsExceeded", "message": f"{attempt - 1} deliveries, none settled"}
        _settle_failure(saga, run_id, step, error)
        raise StepFailedError(run_id, step, tool.name, error["message"])
    ctx = StepContext(run_id, step, step_idempotency_key(run_id, step), attempt)
    try:
        result = _call(tool, ctx, args)
    except Exception as exc:
        if _retryable(exc) and tool.retry.allows_another(attempt):
            raise task.retry(exc=exc, countdown=tool.retry.delay(attempt)) from exc
        _settle_failure(saga, run_id, step, _error(exc, attempt))
        raise
    _settle_success(saga, tool, run_id, step, args, result)
    return result


def _settle_failure(saga: Saga, run_id: str, step: int, error: dict[str, Any]) -> None:
    outcome = saga.store.record_failure(run_id, step, error)
    if outcome.owns_unwind:
        saga.start_unwind(run_id, f"step:{step}")


def _settle_success(
    saga: Saga, tool: Tool, run_id: str, step: int, args: dict[str, Any], result: Any
) -> None:
    """Record the result, push the undo and mark the pivot in one script.

    The effect already happened, so a result or undo that cannot be recorded does not fail the
    step: it is recorded as an undo that cannot run, and the run is aborted, which escalates.
    """
    limit = saga.settings.max_payload_bytes
    problem = ""
    try:
        result_json = payload.dumps(result, what=f"result of {tool.name}", limit=limit)
    except PayloadError as exc:
        problem = str(exc)
        result_json = payload.dumps({"unrecorded": problem}, what="result", limit=limit)
    entry_json = ""
    if tool.compensation is not None:
        entry: dict[str, Any] = {
            "step": step,
            "idempotency_key": compensation_idempotency_key(run_id, step),
        }
        try:
            undo = tool.build_undo(args, result)
            entry.update(tool=undo.tool, args=saga.registry.check_undo(undo))
            entry["description"] = undo.description or f"{undo.tool} for step {step}"
            entry_json = payload.dumps(entry, what=f"undo of {tool.name}", limit=limit)
        except (CompensationBuildError, PayloadError) as exc:
            problem = problem or str(exc)
            entry.update(tool="", args={}, broken=True)
            entry["description"] = f"cannot undo step {step} ({tool.name}): {exc}"
            entry_json = payload.dumps(entry, what="undo", limit=limit)
    irreversible = tool.tool_class is ToolClass.IRREVERSIBLE_WRITE
    outcome = saga.store.record_success(run_id, step, result_json, entry_json, irreversible)
    if outcome.owns_unwind:
        saga.start_unwind(run_id, f"step:{step}")
    if problem:
        logger.error("run %s step %d (%s): %s; aborting the run", run_id, step, tool.name, problem)
        saga.abort(run_id, f"step {step} ({tool.name}): {problem}")


def _compensate(saga: Saga, task: Task, tool: Tool, run_id: str, step: int) -> Any:
    store = saga.store
    begin = store.begin_compensation(run_id, step)
    if begin.status != "run":  # done already (a redelivery), or the run is gone
        logger.info("run %s: compensation of step %d not run: %s", run_id, step, begin.status)
        return {"compensated": step, "replayed": True}
    attempt, entry = int(begin.values[0]), payload.loads(begin.values[1])
    ctx = StepContext(run_id, step, entry["idempotency_key"], attempt, compensating=True)
    try:
        _call(tool, ctx, entry["args"])
    except Exception as exc:
        if _retryable(exc) and tool.retry.allows_another(attempt):
            store.record_compensation(run_id, step, "retrying", _error(exc, attempt))
            raise task.retry(exc=exc, countdown=tool.retry.delay(attempt)) from exc
        store.record_compensation(run_id, step, "failed", _error(exc, attempt))
        logger.error(
            "run %s: compensation %s of step %d failed for good after %d attempt(s): %s",
            run_id,
            tool.name,
            step,
            attempt,
            exc,
        )
        _continue_chain(task)
        raise
    store.record_compensation(run_id, step, "done")
    return {"compensated": step}


def _continue_chain(task: Task) -> None:
    """Send the rest of the unwind although this compensation failed.

    The seed's rule: a failed compensation is recorded and the older ones still run. Celery
    stops a chain at a failed task, so the task hands the chain on itself, as Celery's tracer
    does on success, and then fails visibly (Flower shows it red).
    """
    remaining = list(task.request.chain or [])
    task.request.chain = None
    if not remaining:
        return
    following = signature(remaining[-1], app=task.app)
    following.apply_async(
        chain=remaining[:-1], parent_id=task.request.id, root_id=task.request.root_id
    )
