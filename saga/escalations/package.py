"""Build the escalation package: the escalation as captured (why, the stack, the undos that
gave up with each attempt's error, what is still live) beside the run as it is now (its
timeline), and the exact commands that deal with it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from saga.escalations.document import (
    failed_from_record,
    iso,
    iso_datetime,
    live_docs,
    run_document,
    run_document_from_records,
    stack_doc,
)
from saga.escalations.questions import answer_commands, unanswered
from saga.escalations.schema import (
    SCHEMA_VERSION,
    CommandsDoc,
    CompensationDoc,
    EscalationDoc,
    QuestionDoc,
    RunDoc,
    StackEntryDoc,
    StepDoc,
    WhyDoc,
    WhyKind,
)
from saga.model import RunState, StepState
from saga.picture import RunPicture
from saga.records import EscalationRecord, RunRecord
from saga.rules import (
    REASON_AFTER_PIVOT,
    REASON_COMPENSATION_FAILED,
    REASON_COMPENSATION_NOT_BUILT,
)
from saga.validation import generation_of

#: Verdicts written elsewhere: by ``record_success.lua`` (an effect landed on a judged step of
#: an ended run) and by ``RecordStore.record_unreadable`` (the reaper's own escalation).
REASON_LATE_LANDING = "an effect landed after the run ended"
REASON_UNHANDLED = "the reaper could not handle this run"
#: Errors the reaper records on steps it judged at the run's deadline.
_DEADLINE_ERRORS = frozenset({"NeverStarted", "NoOutcome"})

SUMMARIES: dict[WhyKind, str] = {
    "compensation_failed": (
        "An undo gave up after its retries, so the effects listed as live are still in the "
        "world. Fix what made it fail, then requeue it (or undo them by hand and resolve)."
    ),
    "compensation_not_built": (
        "A step's effect happened but its compensation could not be built (the cause says "
        "why), so saga has no undo for it: it is listed as live and not undoable, and a "
        "requeue cannot run it. Undo it by hand, then resolve."
    ),
    "after_pivot": (
        "A step failed after an irreversible one had succeeded, so nothing was unwound: the "
        "stack shows what could still be undone. Decide what the customer should end up with."
    ),
    "in_doubt": (
        "Nothing could tell whether a step's effect happened. Look it up in its system by "
        "its idempotency key (<run>:<step>), then undo it by hand or resolve."
    ),
    "deadline": (
        "The run made no progress before its deadline and the reaper ended it: a worker "
        "died, a message was lost, or the agent stopped calling."
    ),
    "late_landing": (
        "An effect landed after its step had been judged failed, when the run could no "
        "longer unwind it: it is live, and its undo is on the stack."
    ),
    "unhandled": (
        "The reaper could not read or resolve this run (see the cause): look at its Redis "
        "keys and the workers' logs before anything else."
    ),
    "unanswered": (
        "A person was asked whether to reverse an effect (its tool's reversal policy) and "
        "nobody answered in time, so its undo did not run: the effect is still live. Requeue "
        "to ask again, or decide by hand and resolve saying what was decided."
    ),
    "other": "The run escalated: read the cause and the timeline.",
}


def classify(
    reason: str,
    cause: str,
    steps: Sequence[StepDoc] = (),
    failed: Sequence[CompensationDoc] = (),
) -> WhyDoc:
    """Why a person has the run: the verdict it ended with first, then what else applies
    (``failed``: the undos that gave up, of which a question nobody answered is named)."""
    if reason == REASON_COMPENSATION_FAILED:
        kind: WhyKind = "compensation_failed"
    elif reason == REASON_COMPENSATION_NOT_BUILT:
        kind = "compensation_not_built"
    elif reason == REASON_AFTER_PIVOT:
        kind = "after_pivot"
    elif reason == REASON_LATE_LANDING:
        kind = "late_landing"
    elif "in doubt" in reason:
        kind = "in_doubt"
    elif reason == REASON_UNHANDLED:
        kind = "unhandled"
    else:
        kind = "other"
    also: list[WhyKind] = []
    if "landed after the run ended" in cause or any(s["landed_late"] for s in steps):
        also.append("late_landing")
    if any(s["state"] == StepState.IN_DOUBT.value for s in steps):
        also.append("in_doubt")
    errors = {str((s["error"] or {}).get("type", "")) for s in steps}
    if cause.startswith("aborted: abandoned") or errors & _DEADLINE_ERRORS:
        also.append("deadline")
    if unanswered(failed):
        also.append("unanswered")
    also = [k for k in dict.fromkeys(also) if k != kind]
    return {"kind": kind, "also": also, "reason": reason, "summary": SUMMARIES[kind]}


def commands(
    run_id: str,
    escalation_id: str,
    *,
    requeueable: bool,
    open_: bool,
    failed: Sequence[CompensationDoc] = (),
    command: str = "saga",
    corrections: bool = False,
    questions: Sequence[QuestionDoc] = (),
) -> CommandsDoc:
    """The exact commands that deal with the escalation (``command``: how ``saga`` is invoked
    here, e.g. with its ``--app``), and those answering the ``questions`` the run asks now."""
    run, escalation = shlex.quote(run_id), shlex.quote(escalation_id)
    correction = None
    if requeueable and corrections:
        example = next((f for f in failed if f["undo"] and f["undo"]["args"]), None)
        if example is not None and example["undo"] is not None:
            arg = next(iter(example["undo"]["args"]))
            correction = f"{command} requeue {run} --set {example['step']}.{arg}=VALUE"
    return {
        "show": f"{command} show {run}",
        "requeue": f"{command} requeue {run}" if requeueable else None,
        "requeue_with_correction": correction,
        "resolve": (
            f"{command} resolve {escalation} --note {shlex.quote('what was done, and by whom')}"
            if open_
            else None
        ),
        "answer_reversal": [answer_commands(run_id, q, command) for q in questions],
    }


def escalation_package(
    escalation: EscalationRecord | None = None,
    picture: RunPicture | None = None,
    run: RunRecord | None = None,
    *,
    command: str = "saga",
    corrections: bool = False,
) -> EscalationDoc:
    """One document per escalation: from its record, or from the picture of a run that
    escalated before its record could be written; the run's timeline from the best source at
    hand (its live picture, else its run record).

    ``command`` is how the ``saga`` command is invoked here; ``corrections`` whether this
    version's requeue takes ``--set``.
    """
    if escalation is None:
        if picture is None or picture.state is not RunState.ESCALATED:
            raise ValueError("an escalation package needs an escalation or an escalated run")
        return _package_from_picture(picture, command, corrections)
    if picture is not None:
        run_doc = run_document(picture)
    else:
        run_doc = run_document_from_records(run, [escalation])
    escalation_id = escalation.escalation_id
    generation = generation_of(escalation_id)
    failed = [failed_from_record(f) for f in escalation.failed_compensations]
    stack = stack_doc(escalation.stack)
    open_ = not escalation.resolved
    requeueable = open_ and run_doc["pivot_step"] is None and _runnable(stack)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "saga.escalation",
        "escalation_id": escalation_id,
        "run_id": escalation.run_id,
        "generation": generation,
        "created_at": iso_datetime(escalation.created_at),
        "open": open_,
        "resolution": escalation.resolution,
        "why": classify(escalation.reason, escalation.cause, run_doc["steps"], failed),
        "cause": escalation.cause,
        "run": run_doc,
        "moved_on": _moved_on(run_doc, generation),
        "stack": stack,
        "failed_compensations": failed,
        "live": live_docs(escalation.not_undone),
        "requeueable": requeueable,
        "commands": commands(
            escalation.run_id,
            escalation_id,
            requeueable=requeueable,
            open_=open_,
            failed=failed,
            command=command,
            corrections=corrections,
            questions=run_doc["questions"],
        ),
    }


def _package_from_picture(picture: RunPicture, command: str, corrections: bool) -> EscalationDoc:
    run_doc = run_document(picture)
    escalation_id = f"{picture.run_id}:{picture.generation}"
    failed = [c for c in run_doc["compensations"] if c["state"] == "failed"]
    requeueable = picture.pivot_step is None and _runnable(run_doc["stack"])
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "saga.escalation",
        "escalation_id": escalation_id,
        "run_id": picture.run_id,
        "generation": picture.generation,
        "created_at": iso(picture.ended),
        "open": True,
        "resolution": "",
        "why": classify(picture.reason, picture.cause, run_doc["steps"], failed),
        "cause": picture.cause,
        "run": run_doc,
        "moved_on": "",
        "stack": run_doc["stack"],
        "failed_compensations": failed,
        "live": run_doc["live"],
        "requeueable": requeueable,
        "commands": commands(
            picture.run_id,
            escalation_id,
            requeueable=requeueable,
            open_=True,
            failed=failed,
            command=command,
            corrections=corrections,
            questions=run_doc["questions"],
        ),
    }


def _runnable(stack: Sequence[StackEntryDoc]) -> bool:
    """A requeue runs the undos on the stack again; one never built cannot run."""
    return any(not entry["broken"] for entry in stack)


def _moved_on(run_doc: RunDoc, generation: int | None) -> str:
    """Say so when the run is no longer where the escalation left it (requeued since...)."""
    if run_doc["state"] == RunState.ESCALATED.value and (
        generation is None or run_doc["generation"] == generation
    ):
        return ""
    if run_doc["state"] == RunState.ESCALATED.value:
        return f"escalated again since (generation {run_doc['generation']})"
    return f"the run is {run_doc['state']} now"
