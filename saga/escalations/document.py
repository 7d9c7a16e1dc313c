"""Build a run's document, what its timeline is drawn from.

A run is read from its live Redis keys when they are still there (``run_document``); once they
have expired, from its SQL records (``run_document_from_records``), which know every step but
only what the escalations captured of the unwind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, cast

from saga.escalations.questions import question_docs
from saga.escalations.schema import (
    SCHEMA_VERSION,
    AttemptErrorDoc,
    CompensationDoc,
    LiveDoc,
    RunDoc,
    RunJsonDoc,
    StackEntryDoc,
    StepDoc,
    UndoDoc,
)
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.picture import CompensationRecord, RunPicture
from saga.records import EscalationRecord, RunRecord
from saga.rules import not_undone
from saga.validation import generation_of


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


def failed_from_record(item: dict[str, Any]) -> CompensationDoc:
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


def live_docs(items: Iterable[dict[str, Any]]) -> list[LiveDoc]:
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
        "live": live_docs(not_undone(picture)) if ended_with_undo else [],
        "questions": question_docs(picture),
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
        failed = {int(f["step"]): failed_from_record(f) for f in escalation.failed_compensations}
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
    live = live_docs(latest.not_undone) if latest is not None and state == "escalated" else []
    return {
        "run_id": run.run_id if run is not None else latest.run_id if latest else "",
        "state": state,
        "reason": run.reason if run is not None else latest.reason if latest else "",
        "cause": latest.cause if latest is not None else "",
        "pivot_step": pivot,
        "generation": (generation_of(latest.escalation_id) or 0) if latest is not None else 0,
        "created_at": iso_datetime(run.created_at) if run is not None else None,
        "ended_at": iso_datetime(run.ended_at) if run is not None else None,
        "agent": "",
        "steps": steps,
        "stack": stack,
        "compensations": compensations,
        "live": live,
        "questions": [],
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
