"""Build the documents: a run (for its timeline) and an escalation package (for a person).

A run is read from its live Redis keys when they are still there (``run_document``); once they
have expired, from its SQL records (``run_document_from_records``), which know every step but
only what the escalations captured of the unwind. An escalation package puts the escalation as
captured (why, the stack, the undos that gave up with each attempt's error, what is live)
beside the run as it is now, and the commands that deal with it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from saga.escalations.schema import (
    SCHEMA_VERSION,
    AttemptErrorDoc,
    CommandsDoc,
    CompensationDoc,
    EscalationDoc,
    LiveDoc,
    RunDoc,
    RunJsonDoc,
    StackEntryDoc,
    StepDoc,
    UndoDoc,
    WhyDoc,
    WhyKind,
)
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.picture import CompensationRecord, RunPicture
from saga.rules import REASON_AFTER_PIVOT, REASON_COMPENSATION_FAILED, not_undone

if TYPE_CHECKING:
    from saga.records import EscalationRecord, RunRecord

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
    "other": "The run escalated: read the cause and the timeline.",
}


def iso(timestamp: float | None) -> str | None:
    """Seconds since the epoch (Redis clock) as ISO 8601 UTC, to the second."""
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def iso_datetime(value: datetime | None) -> str | None:
    """SQLite hands datetimes back without their zone: they were written in UTC."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="seconds")


def class_name(tool_class: int) -> str:
    try:
        return ToolClass(tool_class).name.lower().replace("_", " ")
    except ValueError:
        return f"class {tool_class}"


# -- pieces ------------------------------------------------------------------------------------


def undo_doc(entry: dict[str, Any] | None) -> UndoDoc | None:
    if not entry:
        return None
    return {
        "tool": str(entry.get("tool", "")),
        "args": dict(entry.get("args") or {}),
        "description": str(entry.get("description", "")),
        "idempotency_key": str(entry.get("idempotency_key", "")),
        "broken": bool(entry.get("broken", False)),
    }


def stack_doc(entries: Iterable[dict[str, Any]]) -> list[StackEntryDoc]:
    stack: list[StackEntryDoc] = []
    for entry in entries:
        undo = undo_doc(entry)
        if undo is not None:
            stack.append(cast(StackEntryDoc, {"step": int(entry.get("step", 0)), **undo}))
    return stack


def _error_fields(error: Any) -> tuple[str, str, int | None]:
    """An error as recorded (a dict, its JSON text, or anything else) → type, message, attempt."""
    if isinstance(error, str):
        try:
            error = json.loads(error)
        except ValueError:
            return "", error, None
    if not isinstance(error, dict):
        return "", "" if error is None else str(error), None
    attempt = error.get("attempt")
    return (
        str(error.get("type", "")),
        str(error.get("message", "")),
        attempt if isinstance(attempt, int) else None,
    )


def _at(value: Any) -> str | None:
    try:
        return iso(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return str(value)


def _attempt(error: Any, at: Any) -> AttemptErrorDoc:
    kind, message, attempt = _error_fields(error)
    return {"attempt": attempt, "at": _at(at), "type": kind, "message": message}


def attempt_errors(
    errors: Sequence[dict[str, Any]],
    history: Sequence[dict[str, Any]] = (),
    last: Any = None,
    settled_at: Any = None,
) -> list[AttemptErrorDoc]:
    """Every failed attempt's error, oldest first. Undos recorded before each attempt's error
    was kept have only each round's last error (``history``) and the latest (``last``)."""
    if errors:
        return [_attempt(item.get("error"), item.get("at")) for item in errors]
    found = [_attempt(round_.get("error"), round_.get("at")) for round_ in history]
    if last:
        found.append(_attempt(last, settled_at))
    return found


def _compensation(record: CompensationRecord) -> CompensationDoc:
    return {
        "step": record.step,
        "undo": undo_doc(record.entry),
        "state": record.state.value,
        "attempts": record.attempts,
        "settled_at": iso(record.settled_at),
        "task_id": record.task_id,
        "errors": attempt_errors(record.errors, record.history, record.error, record.settled_at),
        "rounds": len(record.history) + 1,
        "recorded": True,
    }


def _failed_from_record(item: dict[str, Any]) -> CompensationDoc:
    """One of ``EscalationRecord.failed_compensations``."""
    history = list(item.get("history") or [])
    return {
        "step": int(item.get("step", 0)),
        "undo": undo_doc(item.get("undo")),
        "state": str(item.get("state", "failed")),
        "attempts": int(item.get("attempts", 0)),
        "settled_at": None,
        "task_id": "",
        "errors": attempt_errors(item.get("errors") or [], history, item.get("error")),
        "rounds": len(history) + 1,
        "recorded": True,
    }


def _step_doc(raw: dict[str, Any], undo: UndoDoc | None) -> StepDoc:
    """A step as ``StepRecord``'s fields (a picture's, or a run record's JSON)."""
    tool_class = int(raw.get("tool_class", 0))
    state = raw.get("state", "")
    return {
        "step": int(raw["step"]),
        "tool": str(raw["tool"]),
        "tool_class": tool_class,
        "class_name": class_name(tool_class),
        "args": dict(raw.get("args") or {}),
        "state": state.value if isinstance(state, StepState) else str(state),
        "attempts": int(raw.get("attempts") or 0),
        "result": raw.get("result"),
        "error": raw.get("error"),
        "reconciled": str(raw.get("reconciled") or ""),
        "landed_late": raw.get("landed") == "late",
        "undo": undo,
    }


def _live(items: Iterable[dict[str, Any]]) -> list[LiveDoc]:
    return [
        {
            "step": int(i.get("step", 0)),
            "tool": str(i.get("tool", "")),
            "result": i.get("result"),
            "why": str(i.get("why", "")),
        }
        for i in items
    ]


# -- runs ----------------------------------------------------------------------------------


def run_document(picture: RunPicture) -> RunDoc:
    """The run as its live keys hold it: every step, every undo and what became of it."""
    undos = {c.step: undo_doc(c.entry) for c in picture.compensations}
    steps = [_step_doc(asdict(s), undos.get(s.step)) for s in picture.steps]
    ended_with_undo = picture.state in (RunState.ESCALATED, RunState.COMPENSATED)
    return {
        "run_id": picture.run_id,
        "state": picture.state.value,
        "reason": picture.reason,
        "cause": picture.cause,
        "pivot_step": picture.pivot_step,
        "generation": picture.generation,
        "created_at": iso(picture.created),
        "ended_at": iso(picture.ended),
        "agent": picture.agent.get("name", ""),
        "steps": steps,
        "stack": stack_doc(picture.stack),
        "compensations": [
            _compensation(c) for c in sorted(picture.compensations, key=lambda c: -c.step)
        ],
        "live": _live(not_undone(picture)) if ended_with_undo else [],
        "source": "redis",
    }


def run_document_from_records(
    run: RunRecord | None, escalations: Sequence[EscalationRecord] = ()
) -> RunDoc:
    """The run as its SQL records tell it, once its Redis keys have expired.

    The run record holds every step; the undos are known from what the escalations captured.
    A compensation no escalation saw fail or wait is taken as done when the run ended
    compensated, or left the stack before it escalated (``recorded`` is False for those).
    """
    latest = max(escalations, key=lambda e: e.created_at, default=None)
    if run is None and latest is None:
        raise ValueError("a run document needs the run's record or one of its escalations")
    undos: dict[int, UndoDoc] = {}
    failed: dict[int, CompensationDoc] = {}
    waiting: set[int] = set()
    for escalation in sorted(escalations, key=lambda e: e.created_at):
        for entry in stack_doc(escalation.stack):
            undos[entry["step"]] = cast(UndoDoc, {k: v for k, v in entry.items() if k != "step"})
        failed = {int(f["step"]): _failed_from_record(f) for f in escalation.failed_compensations}
        for comp in failed.values():
            if comp["undo"] is not None:
                undos[comp["step"]] = comp["undo"]
    if latest is not None:
        waiting = {int(e.get("step", 0)) for e in latest.stack} - set(failed)
    raw_steps = run.steps if run is not None else (latest.steps_done if latest else [])
    steps = [_step_doc(s, undos.get(int(s["step"]))) for s in raw_steps]
    state = run.state if run is not None else RunState.ESCALATED.value
    pivot = next(
        (s["step"] for s in steps if s["tool_class"] == 5 and s["state"] == "succeeded"), None
    )
    compensations: list[CompensationDoc] = []
    for step in sorted(steps, key=lambda s: -s["step"]):
        n = step["step"]
        if step["state"] != "succeeded" or step["tool_class"] not in (3, 4):
            continue
        if state == RunState.COMPENSATED.value:
            compensations.append(_inferred(n, step["undo"], done=True))
        elif n in failed:
            compensations.append(failed[n])
        elif latest is not None:  # past the pivot nothing ran; before it, off the stack = done
            done = pivot is None and n not in waiting
            compensations.append(_inferred(n, step["undo"], done=done))
    stack = stack_doc(latest.stack) if latest is not None and state != "compensated" else []
    live = _live(latest.not_undone) if latest is not None and state == "escalated" else []
    return {
        "run_id": run.run_id if run is not None else latest.run_id if latest else "",
        "state": state,
        "reason": run.reason if run is not None else latest.reason if latest else "",
        "cause": latest.cause if latest is not None else "",
        "pivot_step": pivot,
        "generation": (_generation(latest.escalation_id) or 0) if latest is not None else 0,
        "created_at": iso_datetime(run.created_at) if run is not None else None,
        "ended_at": iso_datetime(run.ended_at) if run is not None else None,
        "agent": "",
        "steps": steps,
        "stack": stack,
        "compensations": compensations,
        "live": live,
        "source": "database",
    }


def _inferred(step: int, undo: UndoDoc | None, done: bool) -> CompensationDoc:
    return {
        "step": step,
        "undo": undo,
        "state": CompensationState.DONE.value if done else CompensationState.PENDING.value,
        "attempts": 0,
        "settled_at": None,
        "task_id": "",
        "errors": [],
        "rounds": 1,
        "recorded": False,
    }


def run_json(doc: RunDoc) -> RunJsonDoc:
    """A run document as ``saga show RUN --json`` prints it: versioned like the package."""
    return cast(RunJsonDoc, {"schema_version": SCHEMA_VERSION, "kind": "saga.run", **doc})


def _generation(escalation_id: str) -> int | None:
    suffix = escalation_id.rpartition(":")[2]
    return int(suffix) if suffix.isdigit() else None


# -- escalations ---------------------------------------------------------------------------


def classify(reason: str, cause: str, steps: Sequence[StepDoc] = ()) -> WhyDoc:
    """Why a person has the run: the verdict it ended with first, then what else applies."""
    if reason == REASON_COMPENSATION_FAILED:
        kind: WhyKind = "compensation_failed"
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
) -> CommandsDoc:
    """The exact commands that deal with the escalation (``command``: how ``saga`` is invoked
    here, e.g. with its ``--app``)."""
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
    generation = _generation(escalation_id)
    failed = [_failed_from_record(f) for f in escalation.failed_compensations]
    stack = stack_doc(escalation.stack)
    open_ = not escalation.resolved
    requeueable = open_ and run_doc["pivot_step"] is None and bool(stack)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "saga.escalation",
        "escalation_id": escalation_id,
        "run_id": escalation.run_id,
        "generation": generation,
        "created_at": iso_datetime(escalation.created_at),
        "open": open_,
        "resolution": escalation.resolution,
        "why": classify(escalation.reason, escalation.cause, run_doc["steps"]),
        "cause": escalation.cause,
        "run": run_doc,
        "moved_on": _moved_on(run_doc, generation),
        "stack": stack,
        "failed_compensations": failed,
        "live": _live(escalation.not_undone),
        "requeueable": requeueable,
        "commands": commands(
            escalation.run_id,
            escalation_id,
            requeueable=requeueable,
            open_=open_,
            failed=failed,
            command=command,
            corrections=corrections,
        ),
    }


def _package_from_picture(picture: RunPicture, command: str, corrections: bool) -> EscalationDoc:
    run_doc = run_document(picture)
    escalation_id = f"{picture.run_id}:{picture.generation}"
    failed = [c for c in run_doc["compensations"] if c["state"] == "failed"]
    requeueable = picture.pivot_step is None and bool(run_doc["stack"])
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "saga.escalation",
        "escalation_id": escalation_id,
        "run_id": picture.run_id,
        "generation": picture.generation,
        "created_at": iso(picture.ended),
        "open": True,
        "resolution": "",
        "why": classify(picture.reason, picture.cause, run_doc["steps"]),
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
        ),
    }


def _moved_on(run_doc: RunDoc, generation: int | None) -> str:
    """Say so when the run is no longer where the escalation left it (requeued since...)."""
    if run_doc["state"] == RunState.ESCALATED.value and (
        generation is None or run_doc["generation"] == generation
    ):
        return ""
    if run_doc["state"] == RunState.ESCALATED.value:
        return f"escalated again since (generation {run_doc['generation']})"
    return f"the run is {run_doc['state']} now"
