"""Notices in SQL, one row per escalation and sink: the outbox the reaper sweeps.

A row is written (pending) before the run counts as recorded, so a crash before the notice
went out leaves either no record at all (the run is recorded again, and the row written then)
or a pending row that the reaper sends again once it is due. A delivery claims the row under a
lease (one UPDATE, so two deliveries never send at once) and counts its attempts there, across
redeliveries. ``failed`` is the durable mark that a sink never took the notice.

Times are on the Redis clock (``RunStore.now``), shared by every process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import (
    DateTime,
    Float,
    Index,
    Integer,
    String,
    Table,
    Text,
    and_,
    func,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from saga.records import EscalationRecord
from saga.validation import RUN_ID_MAX_LENGTH


class NoticeState(StrEnum):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"


class _Base(DeclarativeBase):
    pass


class NoticeRecord(_Base):
    """One escalation's notice to one sink, and what became of it."""

    __tablename__ = "saga_notices"
    __table_args__ = (Index("ix_saga_notices_state_due", "state", "due_at"),)

    #: The escalation's id: also the notice's id, sent with every attempt for deduplication.
    escalation_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH + 32), primary_key=True)
    #: ``callable`` or ``webhook``.
    sink: Mapped[str] = mapped_column(String(16), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(RUN_ID_MAX_LENGTH), index=True)
    state: Mapped[str] = mapped_column(String(16))
    #: Deliveries begun so far (a redelivery after a crash counts too).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: When the reaper sends it again if nothing else happened (Redis clock, seconds).
    due_at: Mapped[float] = mapped_column(Float)
    #: Until when the delivery holding it may still be sending (Redis clock; 0: none).
    lease_until: Mapped[float] = mapped_column(Float, default=0.0)
    #: What the last attempt got: ``HTTP 200``, or the error.
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


@dataclass(frozen=True)
class Claim:
    """Whether a delivery may send (``run``) and which attempt it is; else why not:
    ``sent``, ``failed``, ``busy`` (another delivery holds the lease) or ``missing``."""

    status: str
    attempt: int = 0


_INSERTS: dict[str, Any] = {"sqlite": sqlite_insert, "postgresql": postgresql_insert}


def _utcnow() -> datetime:
    return datetime.now(UTC)


class NoticeStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        for attempt in (1, 2, 3):  # several processes may create the table at once
            try:
                _Base.metadata.create_all(engine)
                break
            except DBAPIError:
                if attempt == 3:
                    raise

    def open(
        self, escalation_id: str, run_id: str, sinks: tuple[str, ...], due: float
    ) -> list[str]:
        """Write a pending notice for each sink that has none; return the sinks whose notice
        is still pending (new, or left by a recording that did not finish), to be sent."""
        now = _utcnow()
        with self.engine.begin() as connection:
            for sink in sinks:
                values = {
                    "escalation_id": escalation_id,
                    "sink": sink,
                    "run_id": run_id,
                    "state": NoticeState.PENDING.value,
                    "attempts": 0,
                    "due_at": due,
                    "lease_until": 0.0,
                    "detail": "",
                    "created_at": now,
                    "updated_at": now,
                }
                table = cast(Table, NoticeRecord.__table__)
                insert = _INSERTS.get(self.engine.dialect.name)
                if insert is not None:
                    connection.execute(insert(table).values(**values).on_conflict_do_nothing())
                    continue
                # Elsewhere: insert, and let a duplicate be (the savepoint undoes only it).
                with contextlib.suppress(IntegrityError), connection.begin_nested():
                    connection.execute(table.insert().values(**values))
            rows = connection.execute(
                select(NoticeRecord.sink).where(
                    NoticeRecord.escalation_id == escalation_id,
                    NoticeRecord.sink.in_(sinks),
                    NoticeRecord.state == NoticeState.PENDING.value,
                )
            )
            pending = {row.sink for row in rows}
        return [sink for sink in sinks if sink in pending]

    def claim(self, escalation_id: str, sink: str, now: float, lease: float, grace: float) -> Claim:
        """Take the notice for one delivery, if it is pending and no other holds it."""
        key = _key(escalation_id, sink)
        with self.engine.begin() as connection:
            claimed = connection.execute(
                update(NoticeRecord)
                .where(
                    key,
                    NoticeRecord.state == NoticeState.PENDING.value,
                    NoticeRecord.lease_until <= now,
                )
                .values(
                    attempts=NoticeRecord.attempts + 1,
                    lease_until=now + lease,
                    due_at=now + lease + grace,
                    updated_at=_utcnow(),
                )
            )
            row = connection.execute(
                select(NoticeRecord.state, NoticeRecord.attempts).where(key)
            ).first()
        if row is None:
            return Claim("missing")
        if claimed.rowcount == 1:
            return Claim("run", int(row.attempts))
        if row.state == NoticeState.PENDING.value:
            return Claim("busy", int(row.attempts))
        return Claim(str(row.state), int(row.attempts))

    def sent(self, escalation_id: str, sink: str, detail: str) -> None:
        self._set(
            escalation_id, sink, state=NoticeState.SENT.value, detail=detail, sent_at=_utcnow()
        )

    def retry(self, escalation_id: str, sink: str, error: str, due: float) -> None:
        """Release the lease; the retry is on its way, and the reaper waits for it until
        ``due``."""
        self._set(escalation_id, sink, detail=error, due_at=due)

    def failed(self, escalation_id: str, sink: str, error: str) -> None:
        self._set(escalation_id, sink, state=NoticeState.FAILED.value, detail=error)

    def postpone(self, escalation_id: str, sink: str, due: float) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(NoticeRecord)
                .where(_key(escalation_id, sink))
                .values(due_at=due, updated_at=_utcnow())
            )

    def reopen(self, escalation_id: str, now: float) -> list[str]:
        """Give an escalation's failed notices a fresh budget (the receiver is fixed); return
        their sinks, to be sent."""
        with self.engine.begin() as connection:
            rows = connection.execute(
                select(NoticeRecord.sink).where(
                    NoticeRecord.escalation_id == escalation_id,
                    NoticeRecord.state == NoticeState.FAILED.value,
                )
            )
            sinks = [row.sink for row in rows]
            connection.execute(
                update(NoticeRecord)
                .where(
                    NoticeRecord.escalation_id == escalation_id,
                    NoticeRecord.state == NoticeState.FAILED.value,
                )
                .values(
                    state=NoticeState.PENDING.value,
                    attempts=0,
                    lease_until=0.0,
                    due_at=now,
                    updated_at=_utcnow(),
                )
            )
        return sinks

    def due(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        """Pending notices nobody is expected to act on any more: sent again by the reaper."""
        query = (
            select(NoticeRecord.escalation_id, NoticeRecord.sink)
            .where(
                NoticeRecord.state == NoticeState.PENDING.value,
                NoticeRecord.due_at <= now,
                NoticeRecord.lease_until <= now,
            )
            .order_by(NoticeRecord.due_at)
            .limit(limit)
        )
        with self.engine.connect() as connection:
            return [(row.escalation_id, row.sink) for row in connection.execute(query)]

    def unannounced(self, sinks: tuple[str, ...], limit: int = 100) -> list[tuple[str, str]]:
        """Open escalations without a notice for one of ``sinks`` (recorded by a process where
        the sinks were not set, or before they were): ``(escalation id, run id)``."""
        announced = (
            select(func.count())
            .where(
                NoticeRecord.escalation_id == EscalationRecord.escalation_id,
                NoticeRecord.sink.in_(sinks),
            )
            .scalar_subquery()
        )
        query = (
            select(EscalationRecord.escalation_id, EscalationRecord.run_id)
            .where(EscalationRecord.resolved.is_(False), announced < len(sinks))
            .order_by(EscalationRecord.created_at)
            .limit(limit)
        )
        with self.engine.connect() as connection:
            return [(row.escalation_id, row.run_id) for row in connection.execute(query)]

    def notices(
        self, escalation_id: str | None = None, state: NoticeState | None = None
    ) -> list[NoticeRecord]:
        """For operators and dashboards: every notice, or an escalation's, or by state."""
        query = select(NoticeRecord).order_by(NoticeRecord.created_at, NoticeRecord.sink)
        if escalation_id is not None:
            query = query.where(NoticeRecord.escalation_id == escalation_id)
        if state is not None:
            query = query.where(NoticeRecord.state == state.value)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.scalars(query))

    def _set(self, escalation_id: str, sink: str, **values: Any) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(NoticeRecord)
                .where(_key(escalation_id, sink))
                .values(lease_until=0.0, updated_at=_utcnow(), **values)
            )


def _key(escalation_id: str, sink: str) -> Any:
    return and_(NoticeRecord.escalation_id == escalation_id, NoticeRecord.sink == sink)
