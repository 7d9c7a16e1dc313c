"""A run's picture as rows of the SQL record, and back.

One way, what a run's conclusion writes: the run, its steps, its compensations, its escalation
and the operator actions kept in its keys. The other way, what a requeue rebuilds a run from
once its Redis keys have expired: the picture those rows describe.

The rows every ending writes (the run, its steps, its undos, a hosted run's transcript) are
plain dicts keyed by column name, handed straight to one compiled upsert per table: no ORM
object is built on the way (a fifth of a caller's CPU per run went there). An escalation and
an operator's action are ORM records, since hooks, notices and the CLI hold them.
"""

from __future__ import annotations

import time
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.picture import CompensationRecord, RunPicture, StepRecord
from saga.records.models import (
    ActionRecord,
    EscalationRecord,
    RunCompensationRecord,
    RunRecord,
    RunStepRecord,
)
from saga.rules import not_undone
from saga.validation import REAPER_ESCALATION
from saga.validation import generation_of as generation_of  # the one reading, re-exported


def when(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC)


def timestamp(moment: datetime | None) -> float | None:
    """SQLite hands back naive datetimes (written as UTC); PostgreSQL aware ones."""
    if moment is None:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def escalation_id(run_id: str, generation: int | None) -> str:
    """The id of the run's escalation of ``generation``; None: the reaper's own."""
    return f"{run_id}:{REAPER_ESCALATION if generation is None else generation}"


#: A step's fields, in order, as its JSON in the run's row holds them.
_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))

#: A row: column name -> value, what the tables' upserts take.
Row = dict[str, Any]


def steps_json(picture: RunPicture) -> list[dict[str, Any]]:
    """Each step as a dict (its arguments and result shared, not copied: they are encoded at
    once and never changed)."""
    return [
        {
            **{name: getattr(s, name) for name in _STEP_FIELDS},
            "tool_class": int(s.tool_class),
            "state": s.state.value,
        }
        for s in picture.steps
    ]


def run_row(picture: RunPicture, state: str, reason: str) -> Row:
    """The row of ``saga_runs`` (``RunRecord``'s columns)."""
    return {
        "run_id": picture.run_id,
        "state": state,
        "reason": reason,
        "created_at": when(picture.created),
        "ended_at": when(picture.ended or time.time()),
        "steps": steps_json(picture),
        "cause": picture.cause,
        "agent": picture.agent.get("name", ""),
        "pivot_step": picture.pivot_step,
        "generation": picture.generation,
        "version": int(picture.version) if picture.version.isdigit() else None,
        "owner": picture.extra.get("owner", ""),
        "deadline_seconds": picture.deadline,
        "doubt": picture.doubt,
        "updated_at": when(picture.updated or None),
    }


def step_rows(picture: RunPicture) -> list[Row]:
    """The rows of ``saga_steps`` (``RunStepRecord``'s columns)."""
    return [
        {
            "run_id": picture.run_id,
            "step": s.step,
            "tool": s.tool,
            "tool_class": int(s.tool_class),
            "state": s.state.value,
            "attempts": s.attempts,
            "args": s.args,
            "result": s.result,
            "error": s.error,
            "reconciled": s.reconciled,
            "landed": s.landed,
            "call": s.call,
            "started_at": when(s.started),
        }
        for s in picture.steps
    ]


def compensation_rows(picture: RunPicture) -> list[Row]:
    """The rows of ``saga_compensations`` (``RunCompensationRecord``'s columns)."""
    positions = {int(entry["step"]): i for i, entry in enumerate(picture.stack)}
    return [
        {
            "run_id": picture.run_id,
            "step": c.step,
            "tool": str(c.entry.get("tool", "")),
            "entry": c.entry,
            "state": c.state.value,
            "attempts": c.attempts,
            "round_start": c.round_start,
            "error": c.error,
            "settled_at": when(c.settled_at),
            "task_id": c.task_id,
            "history": c.history,
            "errors": c.errors,
            "stack_position": positions.get(c.step),
            "decisions": c.decisions,
        }
        for c in picture.compensations
    ]


def transcript_row(run_id: str, hosted: dict[str, Any]) -> Row:
    """The row of ``saga_transcripts`` (``TranscriptRecord``'s columns)."""
    usage = hosted.get("usage") or {}
    return {
        "run_id": run_id,
        "agent": hosted["agent"],
        "input_tokens": int(usage.get("input_tokens", 0)),
        "output_tokens": int(usage.get("output_tokens", 0)),
        "model_calls": int(hosted.get("model_calls", 0)),
        "transcript": hosted,
    }


def escalation_row(picture: RunPicture, reason: str) -> EscalationRecord:
    failed = [
        {
            "step": c.step,
            "undo": c.entry,
            "attempts": c.attempts,
            "error": c.error,
            "state": c.state.value,
            "history": c.history,
            "errors": c.errors,
        }
        for c in picture.compensations
        if c.state is CompensationState.FAILED
    ]
    resolution = picture.resolution or {}
    return EscalationRecord(
        escalation_id=escalation_id(picture.run_id, picture.generation),
        run_id=picture.run_id,
        reason=reason,
        cause=picture.cause or (picture.reason if picture.reason != reason else ""),
        created_at=datetime.now(UTC),
        steps_done=[s for s in steps_json(picture) if s["state"] == "succeeded"],
        stack=picture.stack,
        failed_compensations=failed,
        not_undone=not_undone(picture),
        resolved=bool(resolution),
        resolution=resolution.get("note", ""),
        resolved_by=resolution.get("by", ""),
        resolved_at=when(resolution.get("at")),
    )


def requeue_action(
    run_id: str,
    generation: int,
    by: str,
    corrections: dict[str, Any],
    count: int,
    at: float,
) -> ActionRecord:
    """The requeue that made ``generation``, acting on the escalation before it."""
    acted_on = escalation_id(run_id, generation - 1)
    return ActionRecord(
        action_id=f"{acted_on}:requeue",
        run_id=run_id,
        escalation_id=acted_on,
        kind="requeue",
        by=by,
        at=when(at),
        note=f"requeued {count} compensation(s)",
        corrections=corrections,
        count=count,
    )


def action_rows(picture: RunPicture) -> list[ActionRecord]:
    """The operator actions kept in the run's keys: its requeues, and a person's resolve."""
    rows = [
        requeue_action(
            picture.run_id,
            int(a["generation"]),
            str(a.get("by", "")),
            dict(a.get("corrections") or {}),
            int(a["count"]),
            float(a["at"]),
        )
        for a in picture.actions
    ]
    resolution = picture.resolution
    if resolution is not None:
        rows.append(resolve_action(picture.run_id, picture.generation, resolution))
    return rows


def resolve_action(run_id: str, generation: int, resolution: dict[str, Any]) -> ActionRecord:
    """A person's resolve of the escalation ``resolution`` names (by default the run's at
    ``generation``)."""
    acted_on = str(resolution.get("escalation_id") or escalation_id(run_id, generation))
    return ActionRecord(
        action_id=f"{acted_on}:resolve",
        run_id=run_id,
        escalation_id=acted_on,
        kind="resolve",
        by=str(resolution["by"]),
        at=when(float(resolution["at"])),
        note=str(resolution["note"]),
        corrections={},
        count=0,
    )


def picture_of(
    run: RunRecord, steps: list[RunStepRecord], compensations: list[RunCompensationRecord]
) -> RunPicture | None:
    """The ended run these rows describe, as its keys held it (leases aside: an ended run has
    none that matter); None for a record written before the rows needed for this existed."""
    if run.version is None or run.deadline_seconds is None:
        return None
    created = timestamp(run.created_at) or 0.0
    stack = sorted(
        (c for c in compensations if c.stack_position is not None),
        key=lambda c: int(c.stack_position or 0),
    )
    return RunPicture(
        run_id=run.run_id,
        state=RunState(run.state),
        reason=run.reason,
        pivot_step=run.pivot_step,
        steps=[
            StepRecord(
                step=s.step,
                tool=s.tool,
                tool_class=ToolClass(s.tool_class),
                args=s.args,
                state=StepState(s.state),
                attempts=s.attempts,
                result=s.result,
                error=s.error,
                reconciled=s.reconciled,
                started=timestamp(s.started_at),
                landed=s.landed,
                call=s.call,
            )
            for s in sorted(steps, key=lambda s: s.step)
        ],
        stack=[c.entry for c in stack],
        compensations=[
            CompensationRecord(
                step=c.step,
                entry=c.entry,
                state=CompensationState(c.state),
                attempts=c.attempts,
                error=c.error,
                settled_at=timestamp(c.settled_at),
                task_id=c.task_id,
                round_start=c.round_start,
                history=c.history,
                errors=c.errors,
                decisions=list(c.decisions or []),
            )
            for c in sorted(compensations, key=lambda c: c.step)
        ],
        created=created,
        ended=timestamp(run.ended_at),
        extra={"owner": run.owner, "sent": "1", "generation": str(run.generation)},
        updated=timestamp(run.updated_at) or created,
        deadline=run.deadline_seconds,
        doubt=run.doubt,
        version=str(run.version),
        cause=run.cause,
        recorded=True,
    )
