"""``/api/runs``: start a hosted run, list, read, abort."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from saga.listing import RunFilter, page_of_runs
from saga.model import RunState
from saga.web import actions, problems
from saga.web.api.common import RunId, Since
from saga.web.api.schemas import Abort, CreateRun, RunList
from saga.web.auth import Context, Operator, Reader

router = APIRouter(prefix="/api/runs", tags=["runs"])


@router.post(
    "",
    status_code=201,
    responses={200: {"description": "the run existed already"}, **problems.NOT_SENT},
)
def create_run(body: CreateRun, ctx: Context, holder: Operator, response: Response) -> Any:
    """Start a hosted agent run (201). With ``run_id``, idempotent: the same body again
    answers the existing run (200); another body under that id is a 409."""
    doc, created = actions.start_run(ctx, body.agent, body.input, body.run_id)
    if not created:
        response.status_code = 200
    return doc


@router.get("", response_model=RunList)
def list_runs(
    ctx: Context,
    holder: Reader,
    state: Annotated[list[RunState] | None, Query(description="repeatable")] = None,
    agent: Annotated[str | None, Query(max_length=200)] = None,
    tool: Annotated[str | None, Query(max_length=200)] = None,
    since: Annotated[Since, Query(description="created at or after: ISO 8601, 2h")] = None,
    until: Annotated[datetime | None, Query(description="created before (ISO 8601)")] = None,
    escalated: Annotated[bool | None, Query(description="with an open escalation")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=400)] = None,
) -> Any:
    """Runs newest first, live ones from Redis and ended ones from the records, a page at a
    time: follow ``next_cursor`` until it is null (a page may be short and still have one)."""
    where = RunFilter(
        states=tuple(s.value for s in state or ()),
        agent=agent,
        tool=tool,
        since=since,
        until=until.timestamp() if until else None,
        escalated=escalated,
        limit=limit,
    )
    page = page_of_runs(ctx.store, ctx.records, where, cursor)
    return {"runs": [r.to_dict() for r in page.rows], "next_cursor": page.next_cursor}


@router.get("/{run_id}")
def get_run(run_id: RunId, ctx: Context, holder: Reader) -> Any:
    """The run document (``saga show RUN --json``): steps with classes and results, the stack,
    the unwind, what is live."""
    return actions.the_run(ctx, run_id)


@router.get("/{run_id}/agent")
def get_agent(run_id: RunId, ctx: Context, holder: Reader) -> Any:
    """A hosted run's agent side: input, turns (the transcript), usage, pending approvals."""
    return actions.the_agent(ctx, run_id)


@router.post("/{run_id}/abort", responses=problems.NOT_SENT)
def abort_run(run_id: RunId, ctx: Context, holder: Operator, body: Abort | None = None) -> Any:
    """Stop the run: no more turns; what it did is unwound (or escalated past its pivot) once
    its steps in flight settle. 409 if it already ended."""
    return actions.abort(ctx, run_id, (body or Abort()).reason, holder.name)


__all__ = ["router"]
