"""Runs and escalations, recorded for people in a SQL database.

Redis holds the live state; this is where a person (or a dashboard) finds what happened after
the Redis keys have expired. SQLite by default, PostgreSQL in production; writes are upserts,
so a redelivered conclusion writes the same record again instead of a second one.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Integer,
    String,
    Table,
    Text,
    create_engine,
    event,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from saga.agents.turn_state import document as hosted_document
from saga.model import CompensationState
from saga.picture import RunPicture
from saga.rules import not_undone
from saga.validation import RUN_ID_MAX_LENGTH

#: ``<run_id>:<generation>``: a generation is a requeue counter, 31 digits is plenty.
_ESCALATION_ID_LENGTH = RUN_ID_MAX_LENGTH + 32


class _Base(DeclarativeBase):
    pass


class RunRecord(_Base):
    __tablename__ = "saga_runs"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


class TranscriptRecord(_Base):
    """A hosted agent's conversation: its input, each turn's answer (raw response and usage
    included) and what its calls returned; written with the run's record, in one transaction."""

    __tablename__ = "saga_transcripts"

    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), primary_key=True)
    agent: Mapped[str] = mapped_column(String(100), index=True)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    model_calls: Mapped[int] = mapped_column(Integer, default=0)
    transcript: Mapped[dict[str, Any]] = mapped_column(JSON)


class EscalationRecord(_Base):
    """The whole picture handed to a person: not "the run failed", but what is live and why.

    One row per escalation of a run (``escalation_id`` is ``<run_id>:<generation>``; each
    requeue that escalates again is a new generation). The JSON fields, as written when the
    run concluded:

    - ``steps_done``: the steps that succeeded, each a ``StepRecord`` as a dict (``step``,
      ``tool``, ``tool_class`` as 1-5, ``args``, ``state``, ``attempts``, ``result``,
      ``error``, ``reconciled``, ``started``).
    - ``stack``: the undo entries still on the stack, oldest first (``step``, ``tool``,
      ``args``, ``idempotency_key``, ``description``; ``broken`` if it could not be built).
    - ``failed_compensations``: each undo that gave up (``step``, ``undo`` its entry,
      ``attempts``, ``error`` as ``{"type", "message", ...}``, ``state``, ``history`` its
      earlier rounds, ``errors`` every failed attempt's ``{"error", "at"}``).
    - ``not_undone``: every effect still live in the world (``step``, ``tool``, ``result``,
      ``why``: irreversible, past the pivot, its compensation failed, in doubt, ...).

    ``resolved`` turns true when a requeued unwind ends compensated (every escalation of the
    run), or when a person sets it after dealing with the run by hand.
    """

    __tablename__ = "saga_escalations"

    escalation_id: Mapped[str] = mapped_column(String(_ESCALATION_ID_LENGTH), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), index=True)
    #: The verdict ("compensation failed", "failed after an irreversible step", ...).
    reason: Mapped[str] = mapped_column(Text)
    #: What set the run failing ("step 5 failed", "aborted: ...").
    cause: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    steps_done: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    stack: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    failed_compensations: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    not_undone: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    resolved: Mapped[bool] = mapped_column(Boolean, default=False)
    #: Why it was closed: superseded by a later escalation of the same run, compensated after
    #: a requeue, ... ('' while open).
    resolution: Mapped[str] = mapped_column(Text, default="")


def _when(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC)


def _steps_json(picture: RunPicture) -> list[dict[str, Any]]:
    return [
        {**asdict(s), "tool_class": int(s.tool_class), "state": s.state.value}
        for s in picture.steps
    ]


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers and the writer overlap across processes; NORMAL syncs at checkpoints,
    not every commit, which is safe in WAL mode against a crash of the process."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


class RecordStore:
    def __init__(self, url: str) -> None:
        self.engine: Engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        _create_tables(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    def record_run(self, picture: RunPicture, state: str, reason: str) -> None:
        with self.engine.begin() as connection:
            self._upsert(connection, _run(picture, state, reason))

    def record_escalation(self, picture: RunPicture, reason: str) -> EscalationRecord:
        record = _escalation(picture, reason)
        with self.engine.begin() as connection:
            self._upsert(connection, record)
        return record

    def record_outcome(self, picture: RunPicture) -> EscalationRecord | None:
        """Record an ended run as it stands, in one transaction: its run row and, escalated,
        its escalation row (which closes any earlier one of the run as superseded: one open
        row at a time); compensated or completed, it closes the run's open escalations."""
        reason = picture.reason
        run = _run(picture, picture.state.value, reason)
        escalation = _escalation(picture, reason) if picture.state.value == "escalated" else None
        hosted = hosted_document(picture)
        with self.engine.begin() as connection:
            self._upsert(connection, run)
            if hosted is not None:
                self._upsert(connection, _transcript(picture.run_id, hosted))
            if escalation is not None:
                self._upsert(connection, escalation)
                resolution = f"superseded by {escalation.escalation_id}"
            else:
                resolution = f"{picture.state.value} after requeue"
            open_rows = update(EscalationRecord).where(
                EscalationRecord.run_id == picture.run_id,
                EscalationRecord.resolved.is_(False),
            )
            if escalation is not None:
                open_rows = open_rows.where(
                    EscalationRecord.escalation_id != escalation.escalation_id
                )
            connection.execute(open_rows.values(resolved=True, resolution=resolution))
        return escalation

    def record_unreadable(self, run_id: str, problem: str) -> None:
        """Escalate a run the reaper could not read or resolve (bad data in its keys, a bug):
        a person must look, and the other runs go on being reaped."""
        record = EscalationRecord(
            escalation_id=f"{run_id}:reaper",
            run_id=run_id,
            reason="the reaper could not handle this run",
            cause=problem,
            created_at=datetime.now(UTC),
            steps_done=[],
            stack=[],
            failed_compensations=[],
            not_undone=[],
            resolved=False,
            resolution="",
        )
        with self.engine.begin() as connection:
            self._upsert(connection, record)

    def transcript(self, run_id: str) -> TranscriptRecord | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(TranscriptRecord, run_id)

    def resolve_escalations(self, run_id: str, resolution: str = "resolved") -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(EscalationRecord)
                .where(EscalationRecord.run_id == run_id, EscalationRecord.resolved.is_(False))
                .values(resolved=True, resolution=resolution)
            )

    def run(self, run_id: str) -> RunRecord | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(RunRecord, run_id)

    def escalations(
        self, run_id: str | None = None, open_only: bool = False
    ) -> list[EscalationRecord]:
        query = select(EscalationRecord).order_by(EscalationRecord.created_at)
        if run_id is not None:
            query = query.where(EscalationRecord.run_id == run_id)
        if open_only:
            query = query.where(EscalationRecord.resolved.is_(False))
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query))

    def _upsert(self, connection: Connection, record: _Base) -> None:
        """Insert or replace by primary key, in one statement where the database has one
        (a redelivered conclusion writes the same row again, never a second one)."""
        table = cast(Table, record.__table__)
        values = {column.name: getattr(record, column.name) for column in table.columns}
        keys = [column.name for column in table.primary_key]
        dialect = self.engine.dialect.name
        if dialect not in _UPSERTS:
            # Elsewhere: update, and insert if nothing was there (inside the caller's
            # transaction; a racing insert fails the transaction, and its caller retries).
            where = [table.c[k] == values[k] for k in keys]
            changed = connection.execute(table.update().where(*where).values(**values))
            if changed.rowcount == 0:
                connection.execute(table.insert().values(**values))
            return
        statement = _UPSERTS[dialect](table).values(**values)
        statement = statement.on_conflict_do_update(
            index_elements=keys,
            set_={name: statement.excluded[name] for name in values if name not in keys},
        )
        connection.execute(statement)


def _create_tables(engine: Engine) -> None:
    """Create the tables if missing. Several worker processes start at once and each checks
    first: the losers of that race see "already exists", and a second look finds them."""
    for attempt in (1, 2, 3):
        try:
            _Base.metadata.create_all(engine)
            return
        except DBAPIError:
            if attempt == 3:
                raise


def _run(picture: RunPicture, state: str, reason: str) -> RunRecord:
    return RunRecord(
        run_id=picture.run_id,
        state=state,
        reason=reason,
        created_at=_when(picture.created),
        ended_at=_when(picture.ended or time.time()),
        steps=_steps_json(picture),
    )


def _transcript(run_id: str, hosted: dict[str, Any]) -> TranscriptRecord:
    usage = hosted.get("usage") or {}
    return TranscriptRecord(
        run_id=run_id,
        agent=hosted["agent"],
        input_tokens=int(usage.get("input_tokens", 0)),
        output_tokens=int(usage.get("output_tokens", 0)),
        model_calls=int(hosted.get("model_calls", 0)),
        transcript=hosted,
    )


def _escalation(picture: RunPicture, reason: str) -> EscalationRecord:
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
    return EscalationRecord(
        escalation_id=f"{picture.run_id}:{picture.generation}",
        run_id=picture.run_id,
        reason=reason,
        cause=picture.cause or (picture.reason if picture.reason != reason else ""),
        created_at=datetime.now(UTC),
        steps_done=[s for s in _steps_json(picture) if s["state"] == "succeeded"],
        stack=picture.stack,
        failed_compensations=failed,
        not_undone=not_undone(picture),
        resolved=False,
        resolution="",
    )


_UPSERTS: dict[str, Any] = {"sqlite": sqlite_insert, "postgresql": postgresql_insert}
