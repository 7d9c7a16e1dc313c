"""An effect that happened, as the stack records it: the step's result, and the undo built from
it (the compensation holding the references the result captured, never re-derived later).

The effect already happened, so a result or an undo that cannot be recorded must not make the
step look failed, whatever the reason (not JSON, too large, a lone surrogate, a compensation
function that raises): it becomes an undo that cannot run (``broken``), which the unwind
records as a failed compensation, so the run escalates with the step named on the card.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from saga import payload
from saga.constants import compensation_idempotency_key
from saga.errors import PayloadError

if TYPE_CHECKING:
    from saga.tools import Tool, ToolRegistry


def encode_effect(
    registry: ToolRegistry,
    limit: int,
    tool: Tool,
    run_id: str,
    step: int,
    args: dict[str, Any],
    result: Any,
) -> tuple[str, str, str]:
    """The result and the undo entry as stored (JSON, within ``limit`` bytes each), and what
    went wrong recording them ('' when nothing did)."""
    problem = ""
    try:
        result_json = payload.dumps(result, what=f"result of {tool.name}", limit=limit)
    except PayloadError as exc:
        problem = str(exc)
        result_json = payload.dumps({"unrecorded": problem}, what="result", limit=limit)
    except Exception as exc:  # a lone surrogate, a value whose repr raises, ...
        problem = f"result of {tool.name} cannot be recorded: {type(exc).__name__}: {exc}"
        result_json = payload.dumps({"unrecorded": problem}, what="result", limit=limit)
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
        return result_json, payload.dumps(entry, what="undo", limit=limit), problem
    except Exception as exc:
        entry.update(tool="", args={}, broken=True)
        entry["description"] = f"cannot undo step {step} ({tool.name}): {exc}"
        return result_json, payload.dumps(entry, what="undo", limit=limit), problem or str(exc)
