"""Runs, escalations and operator actions, recorded for people in a SQL database.

Redis holds the live state; this is where a person (or a dashboard) finds what happened after
the Redis keys have expired, and what a requeue rebuilds a run from then. SQLite by default,
PostgreSQL in production; writes are upserts (``saga.records.upserts``), so a redelivered
conclusion writes the same record again instead of a second one. A run is written once per
ending, in one transaction (a fixed number of statements, each run once or, for the steps, as
one batch), never once per step.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, bindparam, create_engine, event, exists, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from saga.picture import RunPicture
from saga.records.models import (
    ActionRecord,
    EscalationRecord,
    RunCompensationRecord,
    RunRecord,
    RunStepRecord,
    TranscriptRecord,
)
from saga.records.rows import (
    action_rows,
    compensation_rows,
    escalation_row,
    picture_of,
    resolve_action,
    run_row,
    step_rows,
    transcript_row,
)
from saga.records.rows import (
    escalation_id as escalation_id_of,
)
from saga.records.upserts import upsert, upsert_records, upsert_run
from saga.settings import sqlite_file

logger = logging.getLogger("saga.records")


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers and the writer overlap across processes. FULL syncs the WAL at every
    commit: a run's record survives a power cut once written, as the store's writes do with
    ``appendfsync always``. (NORMAL syncs at checkpoints only: a power cut could take the last
    records while the store, told they were written, lets those runs' keys expire, and with
    them the only account of an escalation or an undo that failed.)

    The busy timeout comes first, so every statement after it waits for a lock instead of
    failing at once. The switch to WAL (it stays with the file) is the exception: it needs the
    file to itself, and SQLite refuses it at once, busy timeout or not, while another
    connection reads. Many processes opening their first connection together (every turn
    worker recording its first run) did just that, and all but one failed to record. So the
    switch is only asked for while the file is not in WAL, and a refusal means looking again
    shortly: whichever connection wins, the file ends in WAL."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    deadline = time.monotonic() + _WAL_SWITCH_PATIENCE
    while str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() not in _NO_SWITCH:
        if time.monotonic() > deadline:  # still correct without WAL, only less concurrent
            logger.warning(
                "the records database is not in WAL mode after %.0f s of asking (other "
                "connections kept it busy); this connection goes on without it",
                _WAL_SWITCH_PATIENCE,
            )
            break
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            time.sleep(0.02)
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


#: How long a new connection keeps asking for WAL while other connections hold the file.
_WAL_SWITCH_PATIENCE = 30.0
#: Journal modes left alone: WAL already, or an in-memory database (which has no WAL).
_NO_SWITCH = ("wal", "memory")


class RecordStore:
    """The SQL record of one application's runs; safe to share between threads.

    Opening it brings the schema to this version's head (``migrations.upgrade``: idempotent,
    and locked, so every worker may do it as it starts). With ``upgrade=False`` (a deployment
    that runs ``saga db upgrade`` as a one-shot step) it only checks, and refuses a database
    behind its code with ``DatabaseSchemaError``.
    """

    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        from saga.records import migrations  # alembic: only where a store is opened

        path = sqlite_file(url)
        if path is not None and upgrade:  # SQLite makes the file, not its directory
            path.parent.mkdir(parents=True, exist_ok=True)
        if upgrade:
            migrations.upgrade(url)
        else:
            migrations.check(url)
        self.engine: Engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", sqlite_pragmas)

    def dispose(self) -> None:
        self.engine.dispose()

    # -- writing ---------------------------------------------------------------------------

    def record_run(self, picture: RunPicture, state: str, reason: str) -> None:
        with self.engine.begin() as connection:
            upsert_run(connection, run_row(picture, state, reason))

    def record_escalation(self, picture: RunPicture, reason: str) -> EscalationRecord:
        record = escalation_row(picture, reason)
        with self.engine.begin() as connection:
            upsert_records(connection, [record])
        return record

    def record_outcome(self, picture: RunPicture) -> EscalationRecord | None:
        """Record an ended run as it stands, in one transaction: its run row, steps and
        compensations (what a requeue needs once its keys have expired), the operator
        actions its keys hold and, escalated, its escalation row (which closes any earlier one
        of the run as superseded: one open row at a time); compensated or completed, it
        closes the run's open escalations, saying why.

        Fenced by the run's version: a picture older than the one recorded (a reaper that
        read the run, then paused while a requeue moved it on and recorded it) writes nothing
        (``StaleRecordError``), so SQL never goes back to an earlier story.

        A fixed set of statements, each compiled once per process: the rows are plain dicts
        (``saga.records.rows``), the run's steps and undos one executemany each."""
        state = picture.state.value
        escalation = escalation_row(picture, picture.reason) if state == "escalated" else None
        from saga.agents.turn_state import document as hosted_document  # the hosted loop's

        hosted = hosted_document(picture)
        with self.engine.begin() as connection:
            upsert_run(connection, run_row(picture, state, picture.reason))
            upsert(connection, _STEPS, step_rows(picture))
            upsert(connection, _COMPENSATIONS, compensation_rows(picture))
            upsert_records(connection, action_rows(picture))
            if hosted is not None:
                upsert(connection, _TRANSCRIPTS, [transcript_row(picture.run_id, hosted)])
            if escalation is not None:
                upsert_records(connection, [escalation])
                keep = escalation.escalation_id
                resolution = f"superseded by {keep}"
            else:
                keep = ""  # (no escalation id is empty: every open one is closed)
                requeues = [a for a in picture.actions if a["kind"] == "requeue"]
                by = f" by {requeues[-1]['by']}" if requeues and requeues[-1].get("by") else ""
                resolution = f"{state} after requeue{by}"
            close = {"b_run": picture.run_id, "b_keep": keep, "b_why": resolution, "b_at": _now()}
            connection.execute(_CLOSE_OPEN_ESCALATIONS, close)
        return escalation

    def record_unreadable(
        self, run_id: str, problem: str, reason: str = "the reaper could not handle this run"
    ) -> EscalationRecord:
        """Escalate a run the reaper could not read or resolve (bad data in its keys, a bug, a
        store that went back in time): a person must look, and the other runs go on being
        reaped. Its row is the reaper's own (``<run_id>:reaper``), opened again if closed."""
        record = EscalationRecord(
            escalation_id=escalation_id_of(run_id, None),
            run_id=run_id,
            reason=reason,
            cause=problem,
            created_at=_now(),
            steps_done=[],
            stack=[],
            failed_compensations=[],
            not_undone=[],
            resolved=False,
            resolution="",
            resolved_by="",
            resolved_at=None,
        )
        with self.engine.begin() as connection:
            upsert_records(connection, [record])
        return record

    def record_action(self, action: ActionRecord) -> None:
        """Write an operator's action now (it also reaches SQL with the run's next record)."""
        with self.engine.begin() as connection:
            upsert_records(connection, [action])

    def resolve_escalation(self, escalation_id: str, note: str, by: str) -> bool:
        """Close one escalation by hand in SQL alone (one the saga's scripts cannot fence: the
        reaper's, or a run recorded before it could be rebuilt), with the action saying who.
        False if it was not open."""
        now = _now()
        with self.engine.begin() as connection:
            closed = connection.execute(
                update(EscalationRecord)
                .where(
                    EscalationRecord.escalation_id == escalation_id,
                    EscalationRecord.resolved.is_(False),
                )
                .values(resolved=True, resolution=note, resolved_by=by, resolved_at=now)
            )
            if closed.rowcount == 0:
                return False
            run_id = connection.scalar(
                select(EscalationRecord.run_id).where(
                    EscalationRecord.escalation_id == escalation_id
                )
            )
            resolution = {"by": by, "note": note, "escalation_id": escalation_id}
            action = resolve_action(str(run_id), 0, {**resolution, "at": now.timestamp()})
            upsert_records(connection, [action])
        return True

    def resolve_escalations(self, run_id: str, resolution: str = "resolved") -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(EscalationRecord)
                .where(EscalationRecord.run_id == run_id, EscalationRecord.resolved.is_(False))
                .values(resolved=True, resolution=resolution, resolved_at=_now())
            )

    # -- reading ---------------------------------------------------------------------------

    def run(self, run_id: str) -> RunRecord | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(RunRecord, run_id)

    def recorded_as(self, run_id: str) -> tuple[str, int | None] | None:
        """The state and version the run is recorded at; None if it is not. Two columns, not
        the row: every unwind asks it (``saga.divergence``) before its chain is sent."""
        with self.engine.connect() as connection:
            row = connection.execute(_RECORDED_AS, {"b_run": run_id}).first()
        return None if row is None else (str(row[0]), row[1])

    def runs(
        self,
        state: str | None = None,
        tool: str | None = None,
        agent: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        """Recorded runs, newest first: in ``state``, with a step of ``tool``, of the hosted
        ``agent``, created at or after ``since``."""
        query = select(RunRecord).order_by(RunRecord.created_at.desc(), RunRecord.run_id)
        if state is not None:
            query = query.where(RunRecord.state == state)
        if agent is not None:
            query = query.where(RunRecord.agent == agent)
        if since is not None:
            query = query.where(RunRecord.created_at >= since)
        if tool is not None:
            query = query.where(
                exists().where(RunStepRecord.run_id == RunRecord.run_id, RunStepRecord.tool == tool)
            )
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query.limit(limit)))

    def steps(self, run_id: str) -> list[RunStepRecord]:
        query = select(RunStepRecord).where(RunStepRecord.run_id == run_id)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query.order_by(RunStepRecord.step)))

    def compensations(self, run_id: str) -> list[RunCompensationRecord]:
        query = select(RunCompensationRecord).where(RunCompensationRecord.run_id == run_id)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query.order_by(RunCompensationRecord.step)))

    def picture(self, run_id: str) -> RunPicture | None:
        """The ended run as its record describes it, to rebuild its keys from; None if it was
        never recorded, or recorded before the record held all that takes."""
        with Session(self.engine, expire_on_commit=False) as session:
            run = session.get(RunRecord, run_id)
            if run is None:
                return None
        return picture_of(run, self.steps(run_id), self.compensations(run_id))

    def transcript(self, run_id: str) -> TranscriptRecord | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(TranscriptRecord, run_id)

    def escalation(self, escalation_id: str) -> EscalationRecord | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(EscalationRecord, escalation_id)

    def escalations(
        self,
        run_id: str | None = None,
        open_only: bool = False,
        *,
        since: datetime | None = None,
        newest_first: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[EscalationRecord]:
        """Escalations oldest first (``newest_first``: the other way), ``since`` a moment,
        ``limit`` rows from ``offset``: ordered and cut in SQL, so a short page costs the
        page, not the whole history.

        ``open_only``: those awaiting a person. One a requeue acted on awaits nobody: its run
        unwinds again, and the run's next record closes it (compensated, or superseded by the
        next escalation), so it is not among them meanwhile."""
        order = (EscalationRecord.created_at, EscalationRecord.escalation_id)
        query = select(EscalationRecord).order_by(
            *(column.desc() for column in order) if newest_first else order
        )
        if run_id is not None:
            query = query.where(EscalationRecord.run_id == run_id)
        if open_only:
            requeued = select(ActionRecord.action_id).where(
                ActionRecord.kind == "requeue",
                ActionRecord.escalation_id == EscalationRecord.escalation_id,
            )
            query = query.where(EscalationRecord.resolved.is_(False), ~requeued.exists())
        if since is not None:
            query = query.where(EscalationRecord.created_at >= since)
        query = query.offset(offset).limit(limit)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query))

    def actions(self, run_id: str) -> list[ActionRecord]:
        """What operators did to the run (requeues with their corrections, a resolve), oldest
        first."""
        query = (
            select(ActionRecord)
            .where(ActionRecord.run_id == run_id)
            .order_by(ActionRecord.at, ActionRecord.action_id)
        )
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query))


def _now() -> datetime:
    return datetime.now(UTC)


_RECORDED_AS = select(RunRecord.state, RunRecord.version).where(
    RunRecord.run_id == bindparam("b_run")
)
_STEPS = cast(Table, RunStepRecord.__table__)
_COMPENSATIONS = cast(Table, RunCompensationRecord.__table__)
_TRANSCRIPTS = cast(Table, TranscriptRecord.__table__)
_ESCALATIONS = cast(Table, EscalationRecord.__table__)

#: Close a run's open escalations but ``b_keep`` (the one just written, or ''), saying why: one
#: statement object for every record, so it is compiled once.
_CLOSE_OPEN_ESCALATIONS = (
    update(_ESCALATIONS)
    .where(
        _ESCALATIONS.c.run_id == bindparam("b_run"),
        _ESCALATIONS.c.resolved.is_(False),
        _ESCALATIONS.c.escalation_id != bindparam("b_keep"),
    )
    .values(resolved=True, resolution=bindparam("b_why"), resolved_at=bindparam("b_at"))
)
