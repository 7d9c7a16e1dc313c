"""``/api/escalations``: the escalation packages, requeue (with corrections) and resolve."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from saga.queries import escalation_rows, escalation_summary
from saga.validation import parse_escalation_id
from saga.web import actions, problems
from saga.web.api.common import EscalationId, Since
from saga.web.api.schemas import EscalationList, Requeue, Requeued, Resolve
from saga.web.auth import Context, Operator, Reader

router = APIRouter(prefix="/api/escalations", tags=["escalations"])


@router.get("", response_model=EscalationList)
def list_escalations(
    ctx: Context,
    holder: Reader,
    all: Annotated[bool, Query(description="resolved ones too")] = False,
    run_id: Annotated[str | None, Query(max_length=128)] = None,
    since: Annotated[Since, Query(description="escalated at or after: ISO 8601, 2h")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Any:
    """Escalations newest first (open ones unless ``all``)."""
    rows = escalation_rows(
        ctx.records,
        open_only=not all,
        run_id=run_id,
        since=since,
        limit=limit,
    )
    return {"escalations": [escalation_summary(r) for r in rows]}


@router.get("/{escalation_id}")
def get_escalation(escalation_id: EscalationId, ctx: Context, holder: Reader) -> Any:
    """The escalation package (``saga escalation show ID --json``): why, the run, the stack,
    each failed undo with every attempt's error, what is still live."""
    return actions.the_escalation(ctx, escalation_id)


@router.post("/{escalation_id}/requeue", response_model=Requeued, responses=problems.NOT_SENT)
def requeue(
    escalation_id: EscalationId, ctx: Context, holder: Operator, body: Requeue | None = None
) -> Any:
    """Run the failed undos again (each corrected first where ``corrections`` says), once the
    cause is fixed. 409 if the escalation is closed or another requeue got there first; 503
    if the server has no ``SAGA_APP`` (the undos need the application's tools)."""
    count = actions.requeue(ctx, escalation_id, (body or Requeue()).steps(), holder.name)
    run_id = parse_escalation_id(escalation_id)[0]
    return {"escalation_id": escalation_id, "run_id": run_id, "requeued": count, "by": holder.name}


@router.post("/{escalation_id}/resolve")
def resolve(escalation_id: EscalationId, body: Resolve, ctx: Context, holder: Operator) -> Any:
    """Close the escalation by hand, saying what was done; the run then refuses a requeue."""
    record = actions.resolve(ctx, escalation_id, body.note, holder.name)
    return {
        "escalation_id": record.escalation_id,
        "resolved": record.resolved,
        "resolution": record.resolution,
        "resolved_by": record.resolved_by,
    }
