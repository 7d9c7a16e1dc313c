"""What a person does with an escalated run: requeue its failed compensations (correcting an
undo's arguments first if need be), or resolve the escalation by hand.

Both act through Redis scripts, so they are fenced against each other and against the run's
own moves: of two requeues at once one runs the undos and the other is refused, a resolved
escalation refuses a requeue, and a requeue under way refuses a resolve. Once a run's keys have
expired they are first rebuilt from its SQL record (``restore.lua``, which writes only into
nothing), and the same scripts then decide. Who did what is kept in the run's keys by the same
script that does it, and written to SQL at once and again with the run's record, so it is
never lost to a database that was away for a moment.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from saga import payload
from saga.errors import (
    EscalationResolvedError,
    InvalidArgumentsError,
    InvalidCorrectionError,
    MessageNotSentError,
    NothingToRequeueError,
    OperationRefusedError,
    PayloadError,
    StaleRecordError,
    UnknownEscalationError,
    UnknownRunError,
    UnknownToolError,
)
from saga.model import CompensationState, RunState
from saga.picture import RunPicture
from saga.records import EscalationRecord
from saga.records.rows import action_rows, escalation_id, generation_of
from saga.validation import check_name, check_text

# Types only: ``saga escalations`` reads this module's signatures (``requeue``'s corrections)
# without loading Celery, which the core brings.
if TYPE_CHECKING:
    from saga.core import Core

logger = logging.getLogger("saga.operations")

#: How often a requeue re-reads a run that moved between its reading and its script.
_ATTEMPTS = 5
_CORRECTABLE = (CompensationState.FAILED, CompensationState.PENDING)


def requeue(core: Core, run_id: str, corrections: Mapping[int, Mapping[str, Any]], by: str) -> int:
    """``Saga.requeue_failed_compensations``: how many compensations were sent again."""
    _check_shape(corrections, by)
    picture = _readable(core, run_id)
    for _ in range(_ATTEMPTS):
        entries, changes = _corrected(core, picture, corrections)
        action = json.dumps({"by": by, "corrections": changes}, ensure_ascii=False)
        # Under the reaper's eye first: a chain that is never sent is resumed, not forgotten.
        core.store.schedule(run_id, core.store.now() + picture.deadline)
        version = picture.version if entries else ""
        outcome = core.store.requeue(run_id, entries, version, action)
        if outcome.status == "moved":
            picture = core.picture(run_id)
        elif outcome.status == "unknown":  # expired since it was read: rebuild it
            picture = _readable(core, run_id)
        else:
            break
    else:
        raise OperationRefusedError(f"run {run_id} kept changing; requeue it again", retryable=True)
    if outcome.status == "refused":
        repeated = _repeated(core, run_id, by, changes)
        if repeated is not None:
            owner, count = repeated
            now = core.picture(run_id).extra
            if now.get("owner") == owner and now.get("sent") == "0":
                _send_unwind(core, run_id, owner)  # refused before, still unsent
            logger.warning("run %s: %s asked again; applied already", run_id, owner)
            return count
    if outcome.status == "resolved":
        raise EscalationResolvedError(f"run {run_id} was resolved by hand: {_said(outcome)}")
    if outcome.status == "uncorrectable":
        step, state = outcome.values
        raise InvalidCorrectionError(f"step {step} of run {run_id} has no failed undo ({state})")
    if outcome.status != "ok":
        raise NothingToRequeueError(
            f"run {run_id} is {outcome.values[0]} and has no failed compensation to requeue"
        )
    owner, count = str(outcome.values[0]), int(outcome.values[1])
    _record_now(core, run_id, owner)
    _send_unwind(core, run_id, owner)
    logger.warning("run %s: requeued %d compensation(s) by %r", run_id, count, by)
    return count


def _repeated(
    core: Core, run_id: str, by: str, changes: Mapping[str, Any]
) -> tuple[str, int] | None:
    """The requeue (owner, count) this one repeats: the run unwinds under a requeue whose
    unwind the broker refused, made by the same person with the same corrected arguments.
    That requeue again converges on it (its unwind sent), never a 409; two requeues at once,
    where nothing was refused, stay one requeue and one refusal."""
    picture = core.picture(run_id)
    owner = core.store.refused(run_id)
    if picture.state is not RunState.UNWINDING or not owner.startswith("requeue:"):
        return None
    generation = int(owner.rpartition(":")[2])
    after = {step: fix["after"] for step, fix in changes.items()}
    for action in picture.actions:
        if action["generation"] == generation and action.get("by") == by:
            recorded = action.get("corrections", {})
            if {step: fix["after"] for step, fix in recorded.items()} == after:
                return owner, int(action["count"])
    return None


def _send_unwind(core: Core, run_id: str, owner: str) -> None:
    if core.start_unwind(run_id, owner):
        return
    picture = core.picture(run_id)
    behind = core.behind_records(run_id, picture.state, picture.version, picture.recorded_version)
    if behind:  # not the broker: the keys went back in time, and nothing may be undone from them
        raise OperationRefusedError(
            f"run {run_id}: nothing was undone: {behind}; a person decides "
            f"(escalation {run_id}:reaper)"
        )
    core.store.mark_refused(run_id, owner)
    raise MessageNotSentError(run_id, "requeued", "unwind", "the same requeue again")


def resolve(core: Core, escalation: str, *, note: str, by: str) -> EscalationRecord:
    """``Saga.resolve_escalation``: the escalation as recorded once resolved."""
    check_text("note", note)
    check_name("by", by, required=False)
    if not note.strip() or not by.strip():
        raise OperationRefusedError("a resolve needs a note saying what was done, and by whom")
    row = core.records.escalation(escalation)
    if row is None:
        raise UnknownEscalationError(f"no escalation {escalation}")
    if row.resolved:
        raise EscalationResolvedError(f"escalation {escalation} is closed already: {_closed(row)}")
    generation = generation_of(escalation)
    picture = None if generation is None else _rebuilt_if_expired(core, row.run_id)
    if generation is None or picture is None:
        # The reaper's escalation, or a run recorded before it could be rebuilt: neither can
        # be requeued through the scripts, so closing the row alone is enough.
        if not core.records.resolve_escalation(escalation, note, by):
            raise EscalationResolvedError(f"escalation {escalation} was closed meanwhile")
        return _reread(core, escalation)
    # Under the reaper's eye first: if this process dies after the script, the record follows.
    core.store.schedule(row.run_id, core.store.now() + picture.deadline)
    resolution = json.dumps(
        {"by": by, "note": note, "escalation_id": escalation}, ensure_ascii=False
    )
    outcome = core.store.resolve(row.run_id, generation, resolution)
    if outcome.status == "unknown" and _rebuilt_if_expired(core, row.run_id) is not None:
        outcome = core.store.resolve(row.run_id, generation, resolution)  # expired meanwhile
    if outcome.status == "resolved" and payload.loads(outcome.values[0]) != json.loads(resolution):
        raise EscalationResolvedError(f"escalation {escalation} was resolved: {_said(outcome)}")
    if outcome.status == "state" and outcome.values[0] == RunState.UNWINDING.value:
        raise OperationRefusedError(
            f"run {row.run_id} is unwinding after a requeue: resolve it once that ends",
            retryable=True,
        )
    if outcome.status in ("state", "stale", "unknown"):
        raise EscalationResolvedError(
            f"escalation {escalation} is no longer the run's open one ({outcome.status} "
            f"{' '.join(str(v) for v in outcome.values)})"
        )
    _record(core, row.run_id)
    return _reread(core, escalation)


# -- a person decides before a costly reversal --------------------------------------------

#: What a person may answer when an undo's reversal policy asks (``saga.tools``).
DECISIONS = ("reverse", "keep", "later")


def decide_reversal(
    core: Core, run_id: str, step: int, decision: str, *, args_hash: str, by: str, note: str = ""
) -> RunPicture:
    """``Saga.decide_reversal``: answer the question an undo's reversal policy asked. ``reverse``
    runs it now and the unwind goes on; ``keep`` leaves the effect live on purpose (``note``
    says why; the run ends escalated and resolved by this decision, the effect on its books);
    ``later`` puts the question off (it expires into an escalation, never into a keep).
    ``args_hash``: the hash of the undo the person was shown (``CompensationRecord.ask_hash``):
    an answer binds to that very undo, once. The run as the answer left it."""
    if decision not in DECISIONS:
        raise OperationRefusedError(f"decide {' or '.join(DECISIONS)}, not {decision!r}")
    check_name("by", by, required=True)
    check_text("note", note)
    if decision == "keep" and not note.strip():
        raise OperationRefusedError("keeping an effect needs a note saying why, for the books")
    owner = f"decision:{uuid.uuid4().hex[:8]}"
    later = float(core.settings.reversal_ask_seconds)
    outcome = core.store.decide_reversal(run_id, step, decision, args_hash, by, note, owner, later)
    if outcome.status == "unknown":
        raise UnknownRunError(f"run {run_id} has no undo of step {step} in Redis")
    if outcome.status == "mismatch":
        raise OperationRefusedError(
            f"run {run_id} step {step}: the undo you were shown is not the one asked about "
            "(its hash differs): look at it again"
        )
    if outcome.status == "decided":
        state, decided = str(outcome.values[0]), str(outcome.values[1] or "")
        shown = payload.loads(decided) if decided else {}
        said = f": {shown.get('decision')} by {shown.get('by')}" if shown else ""
        raise OperationRefusedError(f"run {run_id} step {step} is {state} already{said}")
    if outcome.status == "ended":
        raise OperationRefusedError(f"run {run_id} is {outcome.values[0]}: nothing to decide")
    if outcome.status != "ok":
        raise OperationRefusedError(f"run {run_id} step {step}: {outcome.status}")
    if decision != "later" and not core.start_unwind(run_id, owner):
        logger.error("run %s: the unwind after %s was not sent; the reaper will", run_id, decision)
    return core.picture(run_id)


def waiting_for_a_person(picture: RunPicture) -> list[dict[str, Any]]:
    """The undos of ``picture`` a person is asked about: step, tool, what it undoes, why it
    asks, since and until when (Redis clock), and the hash an answer must carry."""
    return [
        {
            "step": c.step,
            "tool": str(c.entry.get("tool", "")),
            "description": str(c.entry.get("description", "")),
            "args": c.entry.get("args", {}),
            "why": str(c.entry.get("ask_why", "")),
            "asked_at": c.asked_at,
            "until": c.ask_expires,
            "args_hash": c.ask_hash,
            "decisions": c.decisions,
        }
        for c in picture.compensations
        if c.state is CompensationState.ASKED
    ]


# -- reading, rebuilding -------------------------------------------------------------------


def _readable(core: Core, run_id: str) -> RunPicture:
    """The run from its keys, rebuilt from its record if they have expired."""
    picture = _rebuilt_if_expired(core, run_id, requeue=True)
    if picture is None and core.records.run(run_id) is None:
        raise UnknownRunError(f"no run {run_id}, in Redis or in the records")
    if picture is None:
        raise OperationRefusedError(
            f"run {run_id}'s keys have expired and its record was written before records held "
            "what rebuilding it takes: undo what is live by hand, then resolve its escalation"
        )
    return picture


def _rebuilt_if_expired(core: Core, run_id: str, *, requeue: bool = False) -> RunPicture | None:
    """The run's picture from Redis; once its keys have expired, rebuilt from its SQL record
    (None if there is no record that can rebuild it). For a requeue, a run the record shows
    resolved, or not escalated, is refused before anything is written."""
    live = core.store.picture(run_id)
    if live is not None:
        return live
    recorded = core.records.picture(run_id)
    if recorded is None:
        return None
    if requeue:
        if recorded.state is not RunState.ESCALATED:
            raise NothingToRequeueError(
                f"run {run_id} is {recorded.state.value} and has no failed compensation to requeue"
            )
        current = core.records.escalation(escalation_id(run_id, recorded.generation))
        if current is not None and current.resolved:
            raise EscalationResolvedError(
                f"escalation {current.escalation_id} is closed: {_closed(current)}"
            )
    if core.store.restore(recorded):
        logger.warning("run %s: keys rebuilt from its record", run_id)
    # Rebuilt by this call or by another at the same moment: the keys are the truth now.
    return core.picture(run_id)


# -- corrections ---------------------------------------------------------------------------


def _check_shape(corrections: Mapping[int, Mapping[str, Any]], by: str) -> None:
    for step, fix in corrections.items():
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidCorrectionError(f"corrections are keyed by step number, not {step!r}")
        if not isinstance(fix, Mapping) or not fix or not all(isinstance(k, str) for k in fix):
            raise InvalidCorrectionError(
                f"the correction of step {step} must map argument names to values"
            )
    check_name("by", by, required=False)
    if corrections and not by.strip():
        raise InvalidCorrectionError("say who corrects the undo's arguments (by=...)")


def _corrected(
    core: Core, picture: RunPicture, corrections: Mapping[int, Mapping[str, Any]]
) -> tuple[dict[int, str], dict[str, Any]]:
    """Each corrected undo entry (JSON, as the script stores it) and what changed, every
    correction checked against its compensation tool before anything is sent."""
    compensations = {c.step: c for c in picture.compensations}
    entries: dict[int, str] = {}
    changes: dict[str, Any] = {}
    for step, fix in corrections.items():
        undo = compensations.get(step)
        if undo is None or undo.state not in _CORRECTABLE:
            what = "no undo" if undo is None else f"its undo is {undo.state.value}"
            raise InvalidCorrectionError(
                f"step {step} of run {picture.run_id} has no failed compensation to correct "
                f"({what})"
            )
        entry = undo.entry
        if entry.get("broken") or not entry.get("tool"):
            raise InvalidCorrectionError(
                f"step {step}'s undo could not be built ({entry.get('description')}): new "
                "arguments cannot fix that; undo it by hand and resolve the escalation"
            )
        try:
            checked = core.registry.get(entry["tool"]).validate({**entry["args"], **fix})
            corrected = {**entry, "args": checked}
            entries[step] = payload.dumps(
                corrected, what=f"undo of step {step}", limit=core.settings.max_payload_bytes
            )
        except (UnknownToolError, InvalidArgumentsError, PayloadError) as exc:
            raise InvalidCorrectionError(f"correction of step {step} refused: {exc}") from None
        changes[str(step)] = {"before": entry["args"], "after": checked}
    return entries, changes


# -- recording -----------------------------------------------------------------------------


def _record_now(core: Core, run_id: str, owner: str) -> None:
    """The requeue (``owner``) is in the run's keys already, as its script wrote it: SQL has it
    now, or with the run's record."""
    acted_on = escalation_id(run_id, int(owner.rpartition(":")[2]) - 1)
    try:
        [action] = [
            a
            for a in action_rows(core.picture(run_id))
            if a.kind == "requeue" and a.escalation_id == acted_on
        ]
        core.records.record_action(action)
    except Exception as exc:  # best effort: the unwind must still be sent
        logger.error("run %s: %s not recorded yet (%s); it comes with the run", run_id, owner, exc)


def _record(core: Core, run_id: str) -> None:
    """Write the run's record as its keys now stand (a resolve changed its escalation), then
    let them expire; if the database is away, the reaper writes it (the run is scheduled)."""
    picture = core.picture(run_id)
    try:
        core.records.record_outcome(picture)
    except StaleRecordError:  # the run moved on since it was read: its newer record stands
        return
    core.store.mark_recorded(run_id, picture.version)


def _reread(core: Core, escalation: str) -> EscalationRecord:
    row = core.records.escalation(escalation)
    assert row is not None, "an escalation row is never deleted"
    return row


def _closed(row: EscalationRecord) -> str:
    by = f" by {row.resolved_by}" if row.resolved_by else ""
    at = f" at {row.resolved_at:%Y-%m-%d %H:%M:%S}" if row.resolved_at else ""
    return f"{row.resolution or 'resolved'}{by}{at}"


def _said(outcome: Any) -> str:
    said = payload.loads(outcome.values[0]) if outcome.values and outcome.values[0] else {}
    return f"{said.get('note', '')!r} by {said.get('by', '?')}"
