"""Runs newest first, from Redis and SQL together, a page at a time.

A run is in Redis from its start until its keys expire (its retention after it ended), indexed
by creation time (``saga:created``, or its shards, merged by ``RunStore.newest``; written in the
round trip that creates the run), and in SQL once it ended; where both have it, Redis is the
fresher (a requeued run is unwinding in Redis while SQL still says escalated). One function
answers ``saga runs``, ``Client.list_runs``, the HTTP API and the console.

Order and cursor: (created, run_id), both descending, as ``saga.run_rows`` (the rows, their
order and the filter) has them. A cursor names the last row of a page, and the next page starts
strictly after it, so runs created meanwhile (newer) never shift a page and a run whose keys
expire between two pages (it moves to SQL, at the same place) is neither lost nor shown twice.

Work per page: the index is read a batch at a time (at most ``_SCAN`` entries a page, so a
filter that matches little costs a bounded scan and a shorter page with a cursor to go on), one
pipeline per batch; SQL is one query of ``limit`` rows, then one pipeline to see whether Redis
has a fresher state for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.orm import Session

from saga.constants import agent_key, run_keys
from saga.records import RecordStore
from saga.records.models import EscalationRecord, RunRecord, RunStepRecord
from saga.run_rows import (
    ROW_FIELDS,
    RunFilter,
    RunPage,
    RunRow,
    datetime_of,
    index_score,
    micros,
    micros_of,
    row_of_head,
)
from saga.run_rows import Position as Position  # where the listing's callers find them
from saga.run_rows import parse_since as parse_since
from saga.stack import RunStore, reachable

__all__ = ["RunFilter", "RunPage", "RunRow", "list_runs", "page_of_runs"]

#: Index entries read at most for one page (a selective filter returns a short page then).
_SCAN = 2000
#: Index entries read at most in one round trip.
_BATCH = 500


@dataclass
class _Source:
    rows: list[RunRow] = field(default_factory=list)
    #: Every row of this source at or after it (in listing order) is in ``rows``; None: all.
    horizon: Position | None = None


def page_of_runs(
    store: RunStore | None,
    records: RecordStore | None,
    where: RunFilter,
    cursor: str | None = None,
) -> RunPage:
    """One page of runs, newest first, strictly after ``cursor``. Either store may be None
    (Redis is not read, or SQL is not): the page is then of the other alone. A page may hold
    fewer than ``limit`` rows and still have a next cursor (a selective filter over many runs)."""
    after = Position.decode(cursor) if cursor else None
    live = _redis_rows(store, where, after) if store is not None else _Source()
    recorded = _sql_rows(records, store, where, after) if records is not None else _Source()
    horizons = [s.horizon for s in (live, recorded) if s.horizon is not None]
    floor = max(horizons) if horizons else None
    merged = {row.run_id: row for row in recorded.rows}
    merged.update({row.run_id: row for row in live.rows})  # the fresher
    rows = sorted(
        (r for r in merged.values() if floor is None or r.position >= floor),
        key=lambda r: r.position,
        reverse=True,
    )[: where.limit]
    if len(rows) == where.limit:
        return RunPage(rows, rows[-1].position.encode())
    return RunPage(rows, floor.encode() if floor is not None else None)


def list_runs(
    store: RunStore | None, records: RecordStore | None, where: RunFilter
) -> list[RunRow]:
    """Up to ``where.limit`` runs, newest first (pages followed until full or exhausted)."""
    found: list[RunRow] = []
    cursor: str | None = None
    while len(found) < where.limit:
        page = page_of_runs(store, records, replace(where, limit=where.limit - len(found)), cursor)
        found += page.rows
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    return found


# -- Redis ---------------------------------------------------------------------------------


def _redis_rows(store: RunStore, where: RunFilter, after: Position | None) -> _Source:
    """Index entries newest first from ``after``, read a batch at a time until ``limit`` are
    kept or ``_SCAN`` were read. Each batch starts where the last ended, by score (not by
    offset), so runs created or forgotten meanwhile shift nothing."""
    by_head = replace(where, tool=None)
    bottom = "-inf" if where.since is None else index_score(micros(where.since))
    source = _Source()
    bound, scanned, batch = after, 0, where.limit + 1
    while scanned < _SCAN:
        if bound is not None:
            top = index_score(bound.created_us)
        else:
            top = "+inf" if where.until is None else "(" + index_score(micros(where.until))
        raw = store.newest(top, bottom, batch)
        entries = [Position(micros(score), run_id) for run_id, score in raw]
        fresh = [p for p in entries if bound is None or p < bound]
        if not fresh and len(entries) == batch:
            batch *= 2  # a batch of runs created in the same microsecond as the bound
            continue
        scanned += len(entries)
        kept = [r for r in _heads(store, fresh) if by_head.keeps(r)]
        if where.tool is not None:  # the steps are read for the runs kept so far only
            kept = [r for r in with_tools(store, kept) if where.keeps(r)]
        source.rows += kept
        if len(entries) < batch:
            source.horizon = None  # the index is exhausted: every entry was seen
            return source
        bound = source.horizon = fresh[-1]
        if len(source.rows) >= where.limit:
            break
        batch = min(batch * 2, _BATCH)  # a filter that keeps few: read more at a time
    return source


def _heads(store: RunStore, candidates: Sequence[Position]) -> list[RunRow]:
    """The rows of runs whose keys are still there (an entry whose keys expired is skipped:
    SQL has the run)."""
    with reachable("list_runs"), store.client.pipeline(transaction=False) as pipe:
        for position in candidates:
            pipe.hmget(run_keys(position.run_id)[0], ROW_FIELDS)
            pipe.hget(agent_key(position.run_id), "name")
        answers = pipe.execute()
    rows = []
    for i, position in enumerate(candidates):
        head, agent = answers[2 * i], answers[2 * i + 1]
        row = row_of_head(position.run_id, head, agent, position.created_us)
        if row is not None:
            rows.append(row)
    return rows


def with_tools(store: RunStore, rows: list[RunRow]) -> list[RunRow]:
    """``rows`` with the tools of their steps, read from Redis for the live ones (a page
    reads them only to filter by tool; ``saga runs`` shows them). Rows from the records
    have theirs already."""
    rows = list(rows)
    live = [i for i, row in enumerate(rows) if row.source == "redis" and not row.tools]
    if not live:
        return rows
    with reachable("list_runs"), store.client.pipeline(transaction=False) as pipe:
        for i in live:
            pipe.hgetall(run_keys(rows[i].run_id)[1])
        steps = pipe.execute()
    for i, found in zip(live, steps, strict=True):
        rows[i] = replace(rows[i], tools=_tools(found))
    return rows


def _tools(steps: dict[str, str]) -> tuple[str, ...]:
    numbered = sorted(
        (int(k.split(":")[0]), v)
        for k, v in steps.items()
        if k.endswith(":tool") and k[0].isdigit()
    )
    return tuple(tool for _, tool in numbered)


# -- SQL -----------------------------------------------------------------------------------


def _sql_rows(
    records: RecordStore, store: RunStore | None, where: RunFilter, after: Position | None
) -> _Source:
    """``limit`` recorded runs after ``after``, each replaced by its live keys where Redis
    still has them (and dropped if the live state no longer matches)."""
    query = select(RunRecord).order_by(RunRecord.created_at.desc(), RunRecord.run_id.desc())
    open_escalation = exists().where(
        EscalationRecord.run_id == RunRecord.run_id, EscalationRecord.resolved.is_(False)
    )
    for condition in _conditions(where, after):
        query = query.where(condition)
    if where.escalated is not None:
        query = query.where(open_escalation if where.escalated else ~open_escalation)
    with Session(records.engine) as session:
        runs = list(session.scalars(query.limit(where.limit)))
        open_ids = _open_escalations(session, [r.run_id for r in runs])
    rows = [
        RunRow(
            run.run_id,
            run.state,
            run.reason,
            run.agent or "",
            _timestamp(run.created_at),
            _timestamp(run.ended_at) if run.ended_at is not None else None,
            tuple(str(s.get("tool", "")) for s in run.steps or []),
            "database",
            open_ids.get(run.run_id, ""),
            micros_of(run.created_at),
        )
        for run in runs
    ]
    if store is not None:
        rows = _fresher(store, rows, where)
    full = len(runs) == where.limit
    horizon = Position(micros_of(runs[-1].created_at), runs[-1].run_id) if full else None
    return _Source(rows, horizon)


def _conditions(where: RunFilter, after: Position | None) -> Iterable[Any]:
    if where.states:
        yield RunRecord.state.in_(where.states)
    if where.agent is not None:
        yield RunRecord.agent == where.agent
    if where.since is not None:
        yield RunRecord.created_at >= datetime_of(micros(where.since))
    if where.until is not None:
        yield RunRecord.created_at < datetime_of(micros(where.until))
    if where.tool is not None:
        yield exists().where(
            RunStepRecord.run_id == RunRecord.run_id, RunStepRecord.tool == where.tool
        )
    if after is not None:
        moment = datetime_of(after.created_us)
        yield or_(
            RunRecord.created_at < moment,
            and_(RunRecord.created_at == moment, RunRecord.run_id < after.run_id),
        )


def _open_escalations(session: Session, run_ids: list[str]) -> dict[str, str]:
    if not run_ids:
        return {}
    query = (
        select(EscalationRecord.run_id, EscalationRecord.escalation_id)
        .where(EscalationRecord.run_id.in_(run_ids), EscalationRecord.resolved.is_(False))
        .order_by(EscalationRecord.created_at)
    )
    return {run_id: escalation for run_id, escalation in session.execute(query)}


def _fresher(store: RunStore, rows: list[RunRow], where: RunFilter) -> list[RunRow]:
    """Each row as Redis has it now, where it still has the run's keys."""
    live = {r.run_id: r for r in _heads(store, [row.position for row in rows])}
    fresh = []
    for row in rows:
        now = live.get(row.run_id)
        if now is None:
            fresh.append(row)
        elif where.keeps(replace(now, tools=row.tools)):
            fresh.append(replace(now, tools=row.tools, agent=now.agent or row.agent))
    return fresh


def _timestamp(value: datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
