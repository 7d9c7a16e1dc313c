"""The records' schema, as Alembic migrations shipped in the package.

``upgrade(url)`` brings a database to this version's head and is safe to call from every
worker as it starts: it is idempotent, and serialised (a PostgreSQL advisory lock, a SQLite
``BEGIN IMMEDIATE``), so when several processes start at once one migrates and the others find
the work done. ``status(url)`` says where a database stands (what ``saga db`` and ``doctor``
show). The version lives in ``saga_alembic_version``, not ``alembic_version``, so a database
shared with an application that has migrations of its own keeps the two apart.

A database created before the migrations existed (tables made by ``create_all``, no version
table) holds exactly revision 0001: it is stamped so, then upgraded.

New revisions go in ``versions/`` (``alembic revision`` with ``script_location`` pointing
here, or by hand from ``script.py.mako``); the models in ``saga/records/models.py`` must
match them (a test compares the two).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine

from saga.errors import DatabaseSchemaError

VERSION_TABLE = "saga_alembic_version"
#: The revision a database made by ``create_all`` before the migrations existed holds.
BASELINE = "0001"
#: pg_advisory_xact_lock key: every process migrating the same PostgreSQL database waits here.
_LOCK_KEY = 0x5A6A_0001


def config(connection: Connection | None = None) -> Config:
    """Alembic's configuration for saga's migrations, on ``connection`` (env.py uses it)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("saga.records") / "migrations"))
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head() -> str:
    """The newest revision this version of saga knows (read once: the scripts ship with the
    package, so they do not change under a running process)."""
    revision = ScriptDirectory.from_config(config()).get_current_head()
    assert revision is not None, "saga ships at least one migration"
    return revision


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the database at ``database_url`` to ``revision`` (default: head). Idempotent;
    concurrent callers take turns, and all find the same schema afterwards."""
    with _locked(database_url) as connection:
        if _current(connection) is None and inspect(connection).has_table("saga_runs"):
            command.stamp(config(connection), BASELINE)
        command.upgrade(config(connection), revision)


def status(database_url: str) -> tuple[str | None, str]:
    """(the database's revision, or None if it has none; this version's head)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return _current(connection), head()
    finally:
        engine.dispose()


def current(engine: Engine) -> str | None:
    """The revision the database of ``engine`` holds, over a connection of its pool (what a
    frequent caller, the readiness probe, must use: ``status`` makes an engine of its own)."""
    with engine.connect() as connection:
        return _current(connection)


def check(database_url: str) -> None:
    """Refuse a database behind this version's head (``DatabaseSchemaError``). One ahead of
    it (a newer deploy migrated first) passes: revisions only ever add to the schema, or
    widen it."""
    current, newest = status(database_url)
    if current == newest:
        return
    scripts = ScriptDirectory.from_config(config())
    known = {script.revision for script in scripts.walk_revisions()}
    if current is None or current in known:
        raise DatabaseSchemaError(
            f"the records database is at revision {current or 'none'}, this version of saga "
            f"needs {newest}: run `saga db upgrade` (or let the workers upgrade it, "
            "SAGA_DB_AUTO_UPGRADE=1)"
        )


def _current(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


@contextmanager
def _locked(database_url: str) -> Iterator[Connection]:
    """One connection in one transaction that no other migrating process shares."""
    engine = create_engine(database_url)
    if engine.dialect.name == "sqlite":
        # pysqlite begins transactions lazily and never with IMMEDIATE: take over, so the
        # write lock is held from the first read of the version table to the commit.
        event.listen(engine, "connect", _sqlite_autocommit_driver)
        event.listen(engine, "begin", _sqlite_begin_immediate)
    try:
        with engine.begin() as connection:
            if engine.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
            yield connection
    finally:
        engine.dispose()


def _sqlite_autocommit_driver(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin_immediate(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")
