"""What the API and the console do, once, over the functions the ``saga`` command calls
(``saga.client``, ``saga.operations`` through the ``Saga``, ``saga.queries``,
``saga.listing``). Both surfaces render what these return; neither decides anything itself.

Every operator action takes ``by``, the name of the token that asked, and records it the way
that action records a person (``saga.operations``' action rows, the approval's decision, the
abort's reason).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from saga.client import status_of
from saga.errors import (
    EscalationResolvedError,
    NothingToRequeueError,
    PayloadError,
    RunExistsError,
    UnknownEscalationError,
    UnknownRunError,
)
from saga.escalations import EscalationDoc, RunDoc, run_json
from saga.escalations.questions import question_docs
from saga.escalations.schema import RunJsonDoc
from saga.listing import RunFilter, page_of_runs
from saga.model import RunState
from saga.picture import RunPicture
from saga.queries import escalation_doc, find_escalation, hosted_doc, run_doc
from saga.records import EscalationRecord
from saga.validation import REASON_MAX_LENGTH, parse_escalation_id
from saga.web.context import WebContext

logger = logging.getLogger("saga.web")

#: The newest running runs also read for calls awaiting approval (those asked before
#: ``RunStore.awaiting_approval`` indexed them).
_NEWEST = 200
#: The commands an escalation package suggests, as the server would run them.
_COMMAND = "saga"


def the_run(ctx: WebContext, run_id: str) -> RunJsonDoc:
    """``saga show RUN --json``: from the live keys, else the records."""
    doc = run_doc(ctx.store, ctx.records, run_id)
    if doc is None:
        raise UnknownRunError(f"no run {run_id} (never started, or expired and never recorded)")
    return run_json(doc)


def the_run_doc(ctx: WebContext, run_id: str) -> RunDoc:
    doc = run_doc(ctx.store, ctx.records, run_id)
    if doc is None:
        raise UnknownRunError(f"no run {run_id} (never started, or expired and never recorded)")
    return doc


def the_agent(ctx: WebContext, run_id: str) -> dict[str, Any]:
    """The hosted agent's side of a run: input, turns, usage, pending approvals."""
    picture = ctx.store.picture(run_id)
    if picture is not None and picture.agent:
        return status_of(picture).to_dict()
    hosted = hosted_doc(None, ctx.records, run_id)
    if hosted is None:
        raise UnknownRunError(f"run {run_id} has no hosted agent (or is unknown)")
    return {"run_id": run_id, **hosted, "pending_approvals": []}


def start_run(
    ctx: WebContext, agent: str, input: str, run_id: str | None
) -> tuple[RunJsonDoc, bool]:
    """Start a hosted run, idempotently by ``run_id``: the same agent and input again answer
    the existing run (False: not created now); another body under that id is a conflict."""
    if len(input.encode()) > ctx.client.settings.max_payload_bytes:
        raise PayloadError(f"input is over the limit of {ctx.client.settings.max_payload_bytes}")
    if run_id is not None:
        _same_body(ctx, run_id, agent, input)
        if ctx.store.head(run_id) is None and ctx.records.run(run_id) is not None:
            return the_run(ctx, run_id), False  # ended, its keys expired: the record answers
    # Created or not is the create script's word: of two requests at once, one is told so.
    launched = ctx.client.launch(agent, input, run_id)
    _same_body(ctx, launched.run_id, agent, input)  # another request may have created it
    return the_run(ctx, launched.run_id), launched.created


def _same_body(ctx: WebContext, run_id: str, agent: str, input: str) -> None:
    # The run first, its agent then: the create script writes both at once, so a run seen
    # here has its agent below, even when another request creates it between the two reads.
    exists = ctx.store.head(run_id) is not None or ctx.records.run(run_id) is not None
    hosted = hosted_doc(ctx.store, ctx.records, run_id)
    if hosted is None:
        if exists:
            raise RunExistsError(f"run {run_id} exists and no agent drives it")
        return
    if hosted.get("agent") != agent or hosted.get("input") != input:
        raise RunExistsError(
            f"run {run_id} exists with another agent or input: pick a new run id, or send the "
            "same body to get the existing run"
        )


def abort(ctx: WebContext, run_id: str, reason: str, by: str) -> RunJsonDoc:
    """Stop the run: its reason says who (``aborted: <reason> (by <name>)``)."""
    ctx.client.abort_run(run_id, signed(reason, by))
    logger.warning("run %s: aborted by %r: %s", run_id, by, reason)
    return the_run(ctx, run_id)


def signed(reason: str, by: str, limit: int = REASON_MAX_LENGTH) -> str:
    """``<reason> (by <name>)`` within ``limit``: a reason the API accepted is never refused
    for the name added to it; one too long for both is cut short, with "…" to say so."""
    suffix = f" (by {by})"
    if len(reason) + len(suffix) <= limit:
        return reason + suffix
    return reason[: max(0, limit - len(suffix) - 1)] + "…" + suffix


def decide(
    ctx: WebContext,
    run_id: str,
    approval_id: str,
    *,
    approve: bool,
    args_hash: str,
    reason: str,
    by: str,
) -> bool:
    """Approve or deny a call awaiting a person, bound to the arguments' hash they saw; False
    when this very decision was taken already (a retry: its turn is sent again)."""
    if approve:
        now = ctx.client.approve(run_id, approval_id, args_hash=args_hash, by=by)
    else:
        now = ctx.client.deny(run_id, approval_id, reason, args_hash=args_hash, by=by)
    logger.warning(
        "run %s: call %s %s by %r", run_id, approval_id, "approved" if approve else "denied", by
    )
    return now


def pending_approvals(ctx: WebContext, run_id: str | None = None) -> list[dict[str, Any]]:
    """Calls awaiting a person, of one run or of every running run, longest waiting first:
    read off the index of runs that asked (``RunStore.awaiting_approval``), however many
    runs are newer; a run of the index that no longer runs leaves it here. The newest
    running runs are read too, for requests made before the index existed."""
    if run_id is not None:
        return [{"run_id": run_id, **a} for a in the_agent(ctx, run_id)["pending_approvals"]]
    asked = ctx.store.awaiting_approval()
    newest = page_of_runs(ctx.store, None, RunFilter(states=("running",), limit=_NEWEST))
    indexed = set(asked)
    asked += [row.run_id for row in newest.rows if row.agent and row.run_id not in indexed]
    found = []
    for one in asked:
        picture = ctx.store.picture(one)
        if picture is None or picture.state is not RunState.RUNNING:
            if one in indexed:
                ctx.store.done_awaiting(one)  # an ended run never runs again
            continue
        status = status_of(picture)
        for approval in status.pending_approvals:
            found.append({"run_id": one, "agent": status.agent, **approval})
    return found


def reversal_questions(ctx: WebContext, run_id: str) -> list[dict[str, Any]]:
    """The run's undos waiting for a person before they run (``saga reversal RUN``)."""
    # Imported on use: a web process loads no operator module it does not serve.
    from saga.operations import waiting_for_a_person

    picture = ctx.store.picture(run_id)
    return [] if picture is None else waiting_for_a_person(picture)


def waiting_reversals(ctx: WebContext) -> list[dict[str, Any]]:
    """The questions about reversing an effect across the newest unwinding runs (a run
    asking one waits, unwinding, until someone answers), longest waiting first."""
    unwinding = page_of_runs(ctx.store, None, RunFilter(states=("unwinding",), limit=_NEWEST))
    found = []
    for row in unwinding.rows:
        picture = ctx.store.picture(row.run_id)
        if picture is not None:
            found += [{"run_id": row.run_id, **q} for q in question_docs(picture)]
    return sorted(found, key=lambda q: q["asked_at"] or "")


def decide_reversal(
    ctx: WebContext, run_id: str, step: int, decision: str, *, args_hash: str, note: str, by: str
) -> RunPicture:
    """Answer the question about reversing step ``step``'s effect (``saga reversal RUN STEP``):
    reverse it now, keep it (``note`` says why, for the books) or later; bound to the hash
    of the undo the person was shown, taken once (``saga.operations.decide_reversal``)."""
    after = ctx.saga().decide_reversal(
        run_id, step, decision, args_hash=args_hash, by=by, note=note
    )
    logger.warning("run %s: reversal of step %d: %s by %r", run_id, step, decision, by)
    return after


def the_escalation(ctx: WebContext, escalation_id: str) -> EscalationDoc:
    doc = escalation_doc(ctx.store, ctx.records, escalation_id, command=_COMMAND, corrections=True)
    if doc is None:
        raise UnknownEscalationError(f"no escalation {escalation_id}")
    return doc


def requeue(
    ctx: WebContext, escalation_id: str, corrections: Mapping[int, Mapping[str, Any]], by: str
) -> int:
    """Run the escalation's failed undos again (corrected first): ``saga requeue``. Refused
    (409) unless it is the run's open escalation, the one its keys (or, expired, its record)
    stand at: a requeue under an older id must not act on a newer generation's undos. Of
    two at once, one runs and the other is refused by ``saga.operations``' fence."""
    run_id, generation = parse_escalation_id(escalation_id)
    if generation is None:
        raise NothingToRequeueError(
            f"escalation {escalation_id} is the reaper's: it could not read or resolve the run, "
            "so no unwind concluded and there is no failed compensation to requeue; look at the "
            "run's keys, then resolve it saying what was done"
        )
    doc = the_escalation(ctx, escalation_id)
    if not doc["open"]:
        raise EscalationResolvedError(f"escalation {escalation_id} is closed: {doc['resolution']}")
    current = ctx.store.picture(run_id) or ctx.records.picture(run_id)
    if (
        current is not None
        and (current.state is not RunState.ESCALATED or current.generation != generation)
        and not _requeue_not_sent(ctx, current, generation)
    ):
        raise EscalationResolvedError(
            f"escalation {escalation_id} is not the run's current one: run {run_id} is "
            f"{current.state.value} at generation {current.generation}"
        )
    saga = ctx.saga()
    return saga.requeue_failed_compensations(run_id, corrections=corrections, by=by)


def _requeue_not_sent(ctx: WebContext, current: RunPicture, generation: int) -> bool:
    """The run unwinds under this very escalation's requeue, whose unwind the broker refused
    (202 ``not_sent``): the same requeue again goes on to ``saga.operations``, which converges
    on it when it is the same one (same person, same corrections)."""
    return (
        current.state is RunState.UNWINDING
        and current.generation == generation + 1
        and ctx.store.refused(current.run_id).startswith("requeue:")
    )


def resolve(ctx: WebContext, escalation_id: str, note: str, by: str) -> EscalationRecord:
    """Close the escalation by hand, saying what was done: ``saga resolve``."""
    saga = ctx.saga()
    if find_escalation(ctx.records, escalation_id) is None:
        raise UnknownEscalationError(f"no escalation {escalation_id} (not recorded yet?)")
    return saga.resolve_escalation(escalation_id, note=note, by=by)
