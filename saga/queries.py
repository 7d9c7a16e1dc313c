"""Reading one run or escalation, for every surface (the ``saga`` command, the HTTP API, the
console): Redis for what is live, SQL for the rest. Listing runs is ``saga.listing``.

A run is in Redis from its start until its keys expire (its retention after it ended), and in
SQL once it ended; where both have it, Redis is the fresher (a requeued run is unwinding in
Redis while SQL still says escalated).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from saga.escalations import (
    EscalationDoc,
    RunDoc,
    escalation_package,
    run_document,
    run_document_from_records,
)
from saga.escalations.document import iso_datetime
from saga.picture import RunPicture
from saga.records import EscalationRecord, RecordStore
from saga.stack import RunStore
from saga.validation import generation_of, parse_escalation_id

logger = logging.getLogger("saga.queries")


# -- one run, one escalation -------------------------------------------------------------------


def run_doc(store: RunStore | None, records: RecordStore, run_id: str) -> RunDoc | None:
    """The run from its live keys, else from its records; None if neither knows it."""
    picture = store.picture(run_id) if store is not None else None
    if picture is not None:
        return run_document(picture)
    run = records.run(run_id)
    escalations = records.escalations(run_id)
    if run is None and not escalations:
        return None
    doc = run_document_from_records(run, escalations)
    if store is None:
        doc["redis_unreachable"] = True
    return doc


def find_escalation(records: RecordStore, escalation_id: str) -> EscalationRecord | None:
    with Session(records.engine, expire_on_commit=False) as session:
        return session.get(EscalationRecord, escalation_id)


def escalation_doc(
    store: RunStore | None,
    records: RecordStore,
    escalation_id: str,
    *,
    command: str,
    corrections: bool,
) -> EscalationDoc | None:
    """The package of ``escalation_id``: from its record, or from the run's picture when the
    run escalated and its record is not written yet. ``store`` None: Redis is not read."""
    record = find_escalation(records, escalation_id)
    run_id = record.run_id if record else parse_escalation_id(escalation_id)[0]
    picture = _readable_picture(store, run_id, reaper=generation_of(escalation_id) is None)
    if record is None:
        matches = (
            picture is not None
            and picture.state.value == "escalated"
            and f"{picture.run_id}:{picture.generation}" == escalation_id
        )
        if not matches:
            return None
        return escalation_package(None, picture, command=command, corrections=corrections)
    run = records.run(run_id) if picture is None else None
    package = escalation_package(record, picture, run, command=command, corrections=corrections)
    if store is None:
        package["run"]["redis_unreachable"] = True
    return package


def _readable_picture(store: RunStore | None, run_id: str, *, reaper: bool) -> RunPicture | None:
    """The run's picture; for the reaper's escalation, None when its keys cannot be read:
    that is what the reaper escalated, and its record says why (the keys are for a person)."""
    if store is None:
        return None
    try:
        return store.picture(run_id)
    except (ValueError, KeyError, TypeError) as exc:
        if not reaper:
            raise
        logger.warning("run %s: keys unreadable (%s): its escalation from the records", run_id, exc)
        return None


def escalation_rows(
    records: RecordStore,
    *,
    open_only: bool,
    run_id: str | None,
    since: float | None,
    limit: int | None = None,
    offset: int = 0,
) -> Sequence[EscalationRecord]:
    """Escalations newest first, ``limit`` of them from ``offset`` (the database cuts)."""
    moment = None if since is None else datetime.fromtimestamp(since, UTC)
    return records.escalations(
        run_id=run_id,
        open_only=open_only,
        since=moment,
        newest_first=True,
        limit=limit,
        offset=offset,
    )


def escalation_summary(row: EscalationRecord) -> dict[str, Any]:
    """One escalation as a listing shows it (``saga escalations --json``, the API)."""
    return {
        "escalation_id": row.escalation_id,
        "run_id": row.run_id,
        "reason": row.reason,
        "cause": row.cause,
        "created_at": iso_datetime(row.created_at),
        "open": not row.resolved,
        "resolution": row.resolution,
        "live": len(row.not_undone),
        "failed_compensations": len(row.failed_compensations),
    }


def hosted_doc(store: RunStore | None, records: RecordStore, run_id: str) -> dict[str, Any] | None:
    """A hosted run's input, turns, usage and pending approvals (``saga.agents``' document):
    from its live keys, else as its record kept it; None for a run no agent drove."""
    from saga.agents.turn_state import document  # the hosted loop, only for a hosted run

    picture = store.picture(run_id) if store is not None else None
    if picture is not None:
        return document(picture)
    recorded = records.transcript(run_id)
    return dict(recorded.transcript) if recorded is not None else None
