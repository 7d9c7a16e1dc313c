"""Undos a person is asked about before they run (a tool's ``reversal`` policy): list a run's,
and answer one: reverse it now, keep the effect with a note, or decide later, bound to the
hash of the undo the person was shown (``saga.operations.decide_reversal``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from saga.web import actions
from saga.web.api.common import RunId
from saga.web.api.schemas import ReversalAnswer
from saga.web.auth import Context, Operator, Reader

router = APIRouter(prefix="/api", tags=["reversals"])


@router.get("/runs/{run_id}/reversals")
def run_reversals(run_id: RunId, ctx: Context, holder: Reader) -> Any:
    """The run's undos waiting for a person: ``step``, ``tool``, ``description``, ``args``,
    ``why`` it asks, ``asked_at`` and ``until`` (Redis clock), ``args_hash`` (what an answer
    carries), earlier ``decisions``."""
    return {"reversals": actions.reversal_questions(ctx, run_id)}


@router.post("/runs/{run_id}/reversals/{step}")
def answer_reversal(
    run_id: RunId, step: int, body: ReversalAnswer, ctx: Context, holder: Operator
) -> Any:
    """Answer for the undo of step ``step`` (409 if the hash is not the one asked about, if it
    was answered already, or a keep comes without a note)."""
    after = actions.decide_reversal(
        ctx, run_id, step, body.decision, args_hash=body.args_hash, note=body.note, by=holder.name
    )
    return {
        "run_id": run_id,
        "step": step,
        "decision": body.decision,
        "by": holder.name,
        "state": after.state.value,
    }
