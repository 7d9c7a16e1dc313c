"""Reading runs and escalations for the commands: Redis for what is live, SQL for the rest.

A run is in Redis from its start until its keys expire (its retention after it ended), and in
SQL once it ended; where both have it, Redis is the fresher (a requeued run is unwinding in
Redis while SQL still says escalated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Text, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session

from saga.constants import agent_key, run_keys
from saga.escalations import (
    EscalationDoc,
    RunDoc,
    escalation_package,
    run_document,
    run_document_from_records,
)
from saga.picture import RunPicture
from saga.records import EscalationRecord, RecordStore, RunRecord, TranscriptRecord
from saga.stack import RunStore

#: How many SQL rows a listing filtered by tool reads at most (the tool is matched in Python).
_SCAN = 5000


@dataclass(frozen=True)
class RunRow:
    run_id: str
    state: str
    reason: str
    agent: str
    created: float | None
    ended: float | None
    tools: tuple[str, ...]
    #: Where the row was read: "redis" (live keys) or "database".
    source: str
    #: The open escalation of the run, if any.
    escalation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "state": self.state,
            "reason": self.reason,
            "agent": self.agent,
            "created_at": _iso(self.created),
            "ended_at": _iso(self.ended),
            "tools": list(self.tools),
            "open_escalation": self.escalation or None,
            "source": self.source,
        }


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC).isoformat()


def _timestamp(value: datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


@dataclass(frozen=True)
class RunFilter:
    states: tuple[str, ...] = ()
    agent: str | None = None
    tool: str | None = None
    since: float | None = None
    limit: int = 50

    def keeps(self, row: RunRow) -> bool:
        return (
            (not self.states or row.state in self.states)
            and (self.agent is None or row.agent == self.agent)
            and (self.tool is None or self.tool in row.tools)
            and (self.since is None or (row.created or 0) >= self.since)
        )


def list_runs(store: RunStore | None, records: RecordStore, where: RunFilter) -> list[RunRow]:
    """Runs newest first, live ones from Redis (unless ``store`` is None), the others from
    SQL."""
    rows = {row.run_id: row for row in _sql_runs(records, where)}
    if store is not None:
        rows.update({row.run_id: row for row in _redis_runs(store, where)})
    kept = sorted(
        (r for r in rows.values() if where.keeps(r)), key=lambda r: r.created or 0, reverse=True
    )[: where.limit]
    open_ = {e.run_id: e.escalation_id for e in records.escalations(open_only=True)}
    return [replace(r, escalation=open_.get(r.run_id, "")) for r in kept]


def _redis_runs(store: RunStore, where: RunFilter) -> list[RunRow]:
    ids = store.active_runs()
    client = store.client
    with client.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hmget(run_keys(run_id)[0], ["state", "reason", "created", "ended"])
            pipe.hget(agent_key(run_id), "name")
        answers = pipe.execute()
    heads = []
    by_head = replace(where, tool=None)  # the tools are read below, for the runs kept here
    for i, run_id in enumerate(ids):
        (state, reason, created, ended), agent = answers[2 * i], answers[2 * i + 1]
        if state is None:
            continue  # indexed, keys expired: the reaper forgets it
        created_at = float(created) if created else None
        ended_at = float(ended) if ended else None
        row = RunRow(run_id, state, reason or "", agent or "", created_at, ended_at, (), "redis")
        if by_head.keeps(row):
            heads.append(row)
    heads.sort(key=lambda r: r.created or 0, reverse=True)
    found: list[RunRow] = []
    for chunk in _chunks(heads, 200):
        with client.pipeline(transaction=False) as pipe:
            for row in chunk:
                pipe.hgetall(run_keys(row.run_id)[1])
            for row, steps in zip(chunk, pipe.execute(), strict=True):
                found.append(replace(row, tools=_tools(steps)))
        if len([r for r in found if where.keeps(r)]) >= where.limit:
            break
    return found


def _chunks(rows: list[RunRow], size: int) -> list[list[RunRow]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _tools(steps: dict[str, str]) -> tuple[str, ...]:
    numbered = sorted(
        (int(k.split(":")[0]), v)
        for k, v in steps.items()
        if k.endswith(":tool") and k[0].isdigit()
    )
    return tuple(tool for _, tool in numbered)


def _sql_runs(records: RecordStore, where: RunFilter) -> list[RunRow]:
    query = select(RunRecord, TranscriptRecord.agent).outerjoin(
        TranscriptRecord, TranscriptRecord.run_id == RunRecord.run_id
    )
    if where.states:
        query = query.where(RunRecord.state.in_(where.states))
    if where.since is not None:
        query = query.where(RunRecord.created_at >= datetime.fromtimestamp(where.since, UTC))
    if where.agent is not None:
        query = query.where(TranscriptRecord.agent == where.agent)
    if where.tool is not None:
        # A coarse match in SQL (the JSON text), confirmed on the parsed steps below.
        query = query.where(sql_cast(RunRecord.steps, Text).like(f'%"{where.tool}"%'))
    query = query.order_by(RunRecord.created_at.desc())
    query = query.limit(_SCAN if where.tool else where.limit)
    with Session(records.engine) as session:
        result = session.execute(query).all()
    return [
        RunRow(
            run.run_id,
            run.state,
            run.reason,
            agent or "",
            _timestamp(run.created_at),
            _timestamp(run.ended_at),
            tuple(str(s.get("tool", "")) for s in run.steps or []),
            "database",
        )
        for run, agent in result
    ]


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
    run_id = record.run_id if record else escalation_id.rpartition(":")[0]
    picture: RunPicture | None = store.picture(run_id) if store is not None and run_id else None
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


def escalation_rows(
    records: RecordStore, *, open_only: bool, run_id: str | None, since: float | None
) -> Sequence[EscalationRecord]:
    rows = records.escalations(run_id=run_id, open_only=open_only)
    if since is not None:
        rows = [r for r in rows if (_timestamp(r.created_at) or 0) >= since]
    return cast(Sequence[EscalationRecord], sorted(rows, key=lambda r: r.created_at, reverse=True))
