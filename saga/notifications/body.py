"""What a notice says: the escalation package (``saga.escalations``, ``schema_version`` 1),
the same document ``saga escalation show ID --json`` prints, plus the notice's ``id``; or,
for an undo whose reversal waits for a person, the question and the commands answering it.

One function builds it, so the webhook and the callable sink always agree with the card a
person reads. Its ``id`` is the escalation id, the same on every retry of the notice:
receivers deduplicate on it.
"""

from __future__ import annotations

from typing import Any

from saga.escalations.document import run_document
from saga.escalations.package import escalation_package
from saga.escalations.questions import answer_commands, question_doc
from saga.escalations.schema import SCHEMA_VERSION as SCHEMA_VERSION
from saga.escalations.timeline import plain, timeline
from saga.model import CompensationState
from saga.picture import RunPicture
from saga.records import EscalationRecord, RunRecord

NOTICE_TYPE = "saga.escalation"
QUESTION_TYPE = "saga.reversal_question"
#: The middle of a question's notice id: ``<run>:<generation>:asked:<step>``.
_ASKED = "asked"


def question_notice_id(run_id: str, generation: int, step: int) -> str:
    """The id of the notice telling that the unwind waits for a person at step ``step``'s
    undo: one per question (a requeue that asks again is a new generation, a new notice)."""
    return f"{run_id}:{generation}:{_ASKED}:{step}"


def question_of(notice_id: str) -> tuple[str, int] | None:
    """``(run_id, step)`` of a question's notice id; None for an escalation's."""
    parts = notice_id.split(":")
    if len(parts) != 4 or parts[2] != _ASKED or not parts[3].isdecimal():
        return None
    return parts[0], int(parts[3])


def notification_body(
    record: EscalationRecord,
    picture: RunPicture | None = None,
    run: RunRecord | None = None,
    *,
    command: str = "saga",
) -> dict[str, Any]:
    """The escalation as a person (or a pager) needs it: why, cause, timeline, stack, each
    failed undo's errors, what is live, the commands; ``picture`` or ``run`` give the timeline
    (without either, it is built from what the escalation captured). ``command``: how
    ``saga`` is invoked for this application (``saga --app module:attr``), as the commands
    print it."""
    package = escalation_package(record, picture=picture, run=run, command=command)
    return {**package, "id": record.escalation_id, "type": NOTICE_TYPE}


def question_body(
    notice_id: str, run_id: str, step: int, picture: RunPicture | None, *, command: str = "saga"
) -> dict[str, Any]:
    """The question a person is asked before step ``step``'s effect is reversed: what the undo
    would do, why it asks, until when, the hash an answer carries, the commands answering it
    (``saga reversal`` and the HTTP API), the run's document and its timeline as text. ``open`` is
    False once the question was answered (``decisions`` says how) or the run is gone."""
    undo = next((c for c in picture.compensations if c.step == step), None) if picture else None
    question = question_doc(undo) if undo is not None else None
    open_ = undo is not None and undo.state is CompensationState.ASKED
    run = run_document(picture) if picture is not None else None
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": QUESTION_TYPE,
        "type": QUESTION_TYPE,
        "id": notice_id,
        "run_id": run_id,
        "step": step,
        "open": open_,
        "question": question,
        "commands": answer_commands(run_id, question, command) if question and open_ else None,
        "run": run,
        #: The run drawn as ``saga show`` draws it, for a receiver that posts text (a chat).
        "timeline": plain(timeline(run)) if run is not None else "",
    }
