"""An effect that happened, as the stack records it: the step's result, and the undo built from
it (the compensation holding the references the result captured, never re-derived later).

The effect already happened, so a result or an undo that cannot be recorded must not make the
step look failed, nor look like a success: the step is recorded as succeeded (its effect is
live) with the problem as its error, and the caller is told at once.

- A result that is not JSON or too large (or holds a lone surrogate) breaks the tool's
  contract: a placeholder is recorded instead, the undo is still built from the real result
  and pushed, and the problem is a ``ToolResultError``, handled as the tool's failure would be
  (fed back, or the run unwinds).
- A compensation function that raises (or returns something unusable) leaves the effect with
  no undo: an undo that cannot run (``broken``) is pushed, so the unwind records it as a
  compensation that could not be built and the run escalates with the effect listed as live.
"""

from __future__ import annotations

from typing import Any

from saga import payload
from saga.constants import compensation_idempotency_key
from saga.errors import CompensationBuildError, PayloadError, SagaError
from saga.tools import Tool, ToolRegistry

#: The error types of a step that succeeded with a problem: the succeeded step's recorded error
#: has one of these, and ``StepHandle.result()`` raises the exception of that name.
RESULT_PROBLEM = "ToolResultError"
UNDO_PROBLEM = "CompensationNotBuiltError"
PROBLEMS = frozenset({RESULT_PROBLEM, UNDO_PROBLEM})


def encode_effect(
    registry: ToolRegistry,
    limit: int,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
) -> tuple[str, str, dict[str, Any] | None]:
    """The result and the undo entry as stored (JSON, within ``limit`` bytes each), and what
    went wrong recording them (``{"type", "message"}``, the undo's problem first), or None."""
    problem: dict[str, Any] | None = None
    try:
        result_json = payload.dumps(result, what=f"result of {tool.name}", limit=limit)
    except PayloadError as exc:
        problem = {"type": RESULT_PROBLEM, "message": str(exc)}
    except Exception as exc:  # a value whose repr raises, ...
        message = f"result of {tool.name} cannot be recorded: {type(exc).__name__}: {exc}"
        problem = {"type": RESULT_PROBLEM, "message": message}
    if problem is not None:
        result_json = payload.dumps({"unrecorded": problem["message"]}, what="result", limit=limit)
    if tool.compensation is None:
        return result_json, "", problem
    entry: dict[str, Any] = {
        "step": step,
        "idempotency_key": compensation_idempotency_key(run_id, step),
    }
    try:
        undo = tool.build_undo(args, result)
        entry.update(tool=undo.tool, args=registry.check_undo(undo))
        entry["description"] = undo.description or f"{undo.tool} for step {step}"
        question = tool.reversal_question(args, result)
        if question:
            entry["ask"] = True  # a person decides before the unwind runs it
            entry["ask_why"] = question
        return result_json, payload.dumps(entry, what="undo", limit=limit), problem
    except Exception as exc:
        message = unbuilt(exc)
        entry.update(tool="", args={}, broken=True, description=message)
        undo_problem: dict[str, Any] = {"type": UNDO_PROBLEM, "message": message}
        return result_json, payload.dumps(entry, what="undo", limit=limit), undo_problem


def unbuilt(exc: BaseException) -> str:
    """Why the undo could not be built, naming the compensation function's own error
    (``KeyError 'creditid'``) rather than saga's wrapper of it."""
    cause = exc.__cause__
    # The function itself raised (not saga's check of what it returned): its error says it all.
    if isinstance(exc, CompensationBuildError) and cause and not isinstance(cause, SagaError):
        return f"the compensation could not be built: {type(cause).__name__} {cause}"
    return f"the compensation could not be built: {exc}"
