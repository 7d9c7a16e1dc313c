"""Calls of hosted runs awaiting a person (class 5 calls of an agent declared with
``approval=[...]``): list them, approve or deny one, bound to the hash of the arguments seen."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from saga.web import actions, problems
from saga.web.api.common import ApprovalId, RunId
from saga.web.api.schemas import Approve, Decided, Deny
from saga.web.auth import Context, Operator, Reader

router = APIRouter(prefix="/api", tags=["approvals"])


@router.get("/approvals")
def list_approvals(ctx: Context, holder: Reader) -> Any:
    """Calls awaiting a decision across the newest running runs."""
    return {"approvals": actions.pending_approvals(ctx)}


@router.get("/runs/{run_id}/approvals")
def run_approvals(run_id: RunId, ctx: Context, holder: Reader) -> Any:
    """The run's calls awaiting a decision: ``id``, ``tool``, ``arguments``, ``args_hash``."""
    return {"approvals": actions.pending_approvals(ctx, run_id)}


@router.post(
    "/runs/{run_id}/approvals/{approval_id}/approve",
    response_model=Decided,
    responses=problems.NOT_SENT,
)
def approve(
    run_id: RunId, approval_id: ApprovalId, body: Approve, ctx: Context, holder: Operator
) -> Any:
    """Let the call go out as shown (409 if the hash is not the one awaiting, or another
    decision was taken; this very one again answers ``repeated``)."""
    now = actions.decide(
        ctx, run_id, approval_id, approve=True, args_hash=body.args_hash, reason="", by=holder.name
    )
    return _decided(run_id, approval_id, "approved", holder.name, now)


@router.post(
    "/runs/{run_id}/approvals/{approval_id}/deny",
    response_model=Decided,
    responses=problems.NOT_SENT,
)
def deny(run_id: RunId, approval_id: ApprovalId, body: Deny, ctx: Context, holder: Operator) -> Any:
    """Refuse the call; the model is told ``reason`` and goes on."""
    now = actions.decide(
        ctx,
        run_id,
        approval_id,
        approve=False,
        args_hash=body.args_hash,
        reason=body.reason,
        by=holder.name,
    )
    return _decided(run_id, approval_id, "denied", holder.name, now)


def _decided(run_id: str, approval_id: str, verdict: str, by: str, now: bool) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "approval_id": approval_id,
        "verdict": verdict,
        "by": by,
        "repeated": not now,
    }
