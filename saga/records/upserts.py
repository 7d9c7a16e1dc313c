"""Writing a row so that writing it again changes nothing: the records' idempotence.

A conclusion may be delivered twice, and a reaper may record a run a worker already recorded,
so every record is an upsert by primary key (one ``INSERT ... ON CONFLICT`` where the
database has it, an update-or-insert elsewhere), and a run's row is fenced by its version: a
picture older than the one recorded writes nothing. Each statement is built once per dialect
and table and takes its rows as parameters, so SQLAlchemy compiles it once per process.
Text is stored as every database can keep it (no NUL), so a record refused once is not
refused forever.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, or_, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from saga.errors import StaleRecordError
from saga.records.models import Base, RunRecord
from saga.records.rows import Row

__all__ = ["upsert", "upsert_records", "upsert_run"]


def upsert_run(connection: Connection, row: Row) -> None:
    """The run's row, unless a later version of it is recorded already: then
    ``StaleRecordError``, which rolls the caller's whole transaction back."""
    version = row.get("version")
    statement = _run_upsert_statement(connection.dialect.name)
    if statement is not None:
        # RETURNING, not rowcount: psycopg reports no row count for an upsert.
        written = int(connection.execute(statement, _storable_row(row)).first() is not None)
    else:  # no upsert: the row as it is, then insert or update by hand
        stored = connection.execute(
            select(RunRecord.version).where(RunRecord.run_id == row["run_id"])
        ).first()
        written = 0 if _newer(stored, version) else 1
        if written and stored is None:
            connection.execute(_RUNS.insert().values(**_storable_row(row)))
        elif written:
            where = _RUNS.c.run_id == row["run_id"]
            connection.execute(_RUNS.update().where(where).values(**_storable_row(row)))
    if not written:
        raise StaleRecordError(
            f"run {row['run_id']}: a later record than version {version} is written"
        )


def upsert(connection: Connection, table: Table, rows: Sequence[Row]) -> None:
    """Insert or replace by primary key, in one statement where the database has one (a
    redelivered conclusion writes the same rows again, never second ones). The statement
    is built once per table and the rows are its parameters, so SQLAlchemy compiles it
    once rather than on every record."""
    if not rows:
        return
    rows = [_storable_row(row) for row in rows]
    statement = _upsert_statement(connection.dialect.name, table)
    if statement is not None:
        connection.execute(statement, rows)
        return
    # Elsewhere: update, and insert if nothing was there (inside the caller's transaction;
    # a racing insert fails the transaction, and its caller retries).
    keys = [column.name for column in table.primary_key]
    for values in rows:
        where = [table.c[k] == values[k] for k in keys]
        changed = connection.execute(table.update().where(*where).values(**values))
        if changed.rowcount == 0:
            connection.execute(table.insert().values(**values))


def upsert_records(connection: Connection, records: Sequence[Base]) -> None:
    """``upsert`` for ORM records (escalations and actions: the rows others hold)."""
    if records:
        table = cast(Table, records[0].__table__)
        rows = [{c.name: getattr(r, c.name) for c in table.columns} for r in records]
        upsert(connection, table, rows)


@functools.cache
def _upsert_statement(dialect: str, table: Table) -> Any:
    """``INSERT ... ON CONFLICT (primary key) DO UPDATE`` every other column, for the
    databases that have it (None elsewhere)."""
    if dialect not in _UPSERTS:
        return None
    keys = [column.name for column in table.primary_key]
    statement = _UPSERTS[dialect](table)
    return statement.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: statement.excluded[c.name] for c in table.columns if c.name not in keys},
    )


@functools.cache
def _run_upsert_statement(dialect: str) -> Any:
    """The run's upsert, which leaves a row of a later version alone (no row changes: the
    caller learns its picture was stale); a row of no version (recorded before versions were)
    is replaced."""
    if dialect not in _UPSERTS:
        return None
    statement = _UPSERTS[dialect](_RUNS)
    stored = _RUNS.c.version
    return statement.on_conflict_do_update(
        index_elements=["run_id"],
        set_={c.name: statement.excluded[c.name] for c in _RUNS.columns if c.name != "run_id"},
        where=or_(stored.is_(None), statement.excluded.version.is_(None))
        | (stored <= statement.excluded.version),
    ).returning(_RUNS.c.run_id)


def _newer(stored: Any, version: int | None) -> bool:
    """Whether the stored run row is of a later version than ``version``."""
    return (
        stored is not None
        and stored[0] is not None
        and version is not None
        and (stored[0] > version)
    )


def _storable_row(row: Row) -> dict[str, Any]:
    return {name: _storable(value) for name, value in row.items()}


def _storable(value: Any) -> Any:
    """A text column's value as every database keeps it: PostgreSQL refuses NUL in text, and
    a record refused once is refused on every attempt, so the run would never be recorded.
    What people type is checked where it enters (``saga.validation``); this is for what
    tools and models wrote (an error message, a reason built from one)."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


_UPSERTS: dict[str, Any] = {"sqlite": sqlite_insert, "postgresql": postgresql_insert}

_RUNS = cast(Table, RunRecord.__table__)
