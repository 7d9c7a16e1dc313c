"""The records' schema is the migrations': an empty SQLite file and an empty PostgreSQL schema
are upgraded to head, and the models match what that made (no autogenerate diff).

PostgreSQL gets a schema of its own per test (``search_path``), dropped afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select, text

from saga.errors import DatabaseSchemaError
from saga.guard import records_schema_problems
from saga.records import RecordStore, RunRecord, migrations
from saga.records.models import Base
from saga.settings import Settings
from saga.testing import free_port
from tests.conftest import postgres_schema

TABLES = {
    "saga_runs",
    "saga_steps",
    "saga_compensations",
    "saga_escalations",
    "saga_actions",
    "saga_transcripts",
    "saga_api_tokens",
    "saga_alembic_version",
}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of this test's own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'records.db'}"
        return
    with postgres_schema("m") as (_, url):
        yield url


def differences(url: str) -> list[object]:
    """What Alembic's autogenerate would change to make the database match the models."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection,
                opts={"compare_type": True, "version_table": migrations.VERSION_TABLE},
            )
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_an_empty_database_is_upgraded_to_head_and_matches_the_models(database_url: str) -> None:
    """Upgrade makes every table, records head, and leaves nothing for autogenerate to do."""
    # Given an empty database
    assert migrations.status(database_url) == (None, migrations.head())

    # When it is upgraded
    migrations.upgrade(database_url)

    # Then it is at head, with the models' tables exactly
    assert migrations.status(database_url) == (migrations.head(), migrations.head())
    assert tables(database_url) == TABLES
    assert differences(database_url) == []


def test_upgrade_is_idempotent_and_safe_when_workers_start_at_once(database_url: str) -> None:
    """Six callers at once (as six workers starting): one migrates, all end at head."""
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def worker_starts() -> None:
        try:
            start.wait(timeout=30)
            migrations.upgrade(database_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker_starts) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)

    assert errors == []
    migrations.upgrade(database_url)  # and once more, with nothing to do
    assert migrations.status(database_url)[0] == migrations.head()
    assert differences(database_url) == []


def test_a_database_from_before_the_migrations_is_adopted(database_url: str) -> None:
    """Tables ``create_all`` made (no version table) are stamped 0001, then upgraded, rows kept
    and new columns filled with their defaults."""
    # Given the tables as they were, without a version table, holding a run
    migrations.upgrade(database_url, revision=migrations.BASELINE)
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text(f"DROP TABLE {migrations.VERSION_TABLE}"))
        connection.execute(
            text(
                "INSERT INTO saga_runs (run_id, state, reason, created_at, steps) "
                "VALUES ('old', 'completed', '', :at, '[]')"
            ),
            {"at": datetime(2026, 1, 2, tzinfo=UTC)},
        )
    assert migrations.status(database_url)[0] is None

    # When it is upgraded
    migrations.upgrade(database_url)

    # Then it is at head, and the old run reads back with the new columns' defaults
    assert migrations.status(database_url)[0] == migrations.head()
    assert differences(database_url) == []
    with engine.connect() as connection:
        row = connection.execute(select(RunRecord.__table__)).one()
    engine.dispose()
    assert (row.run_id, row.generation, row.cause, row.agent, row.version) == (
        "old",
        0,
        "",
        "",
        None,
    )


def test_every_revision_downgrades_and_upgrades_again(database_url: str) -> None:
    """The downgrades work too: head -> nothing -> head."""
    migrations.upgrade(database_url)
    engine = create_engine(database_url)
    with engine.begin() as connection:
        command.downgrade(migrations.config(connection), "base")
    engine.dispose()
    assert tables(database_url) == {migrations.VERSION_TABLE}
    migrations.upgrade(database_url)
    assert differences(database_url) == []


def test_a_store_that_may_not_upgrade_refuses_a_database_behind(database_url: str) -> None:
    """``SAGA_DB_AUTO_UPGRADE=0``: the store checks only, and says what to run."""
    with pytest.raises(DatabaseSchemaError, match="saga db upgrade"):
        RecordStore(database_url, upgrade=False)
    migrations.upgrade(database_url, revision=migrations.BASELINE)
    with pytest.raises(DatabaseSchemaError, match="revision 0001"):
        RecordStore(database_url, upgrade=False)

    migrations.upgrade(database_url)
    store = RecordStore(database_url, upgrade=False)
    assert store.runs() == []
    store.dispose()


def test_the_worker_guard_upgrades_or_refuses_a_schema_behind(tmp_path: Path) -> None:
    """At start-up the worker brings the schema to head, or (auto-upgrade off) refuses one
    behind; a database that does not answer is no reason to refuse."""
    url = f"sqlite:///{tmp_path / 'records.db'}"
    [problem] = records_schema_problems(Settings(database_url=url, database_auto_upgrade=False))
    assert "saga db upgrade" in problem

    assert records_schema_problems(Settings(database_url=url)) == []
    assert migrations.status(url)[0] == migrations.head()
    assert records_schema_problems(Settings(database_url=url, database_auto_upgrade=False)) == []

    away = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=2"
    assert records_schema_problems(Settings(database_url=away)) == []


def test_saga_db_upgrade_and_status(database_url: str) -> None:
    """The one-shot step a deployment runs: status says behind (exit 1), upgrade brings the
    database to head, status then says so (exit 0), and doctor's check agrees."""
    from click.testing import CliRunner

    from saga.cli.doctor import _migrations
    from saga.cli.main import cli

    env = {"SAGA_DATABASE_URL": database_url}
    behind = CliRunner().invoke(cli, ["db", "status", "--json"], env=env)
    assert behind.exit_code == 1, behind.output
    assert '"current": null' in behind.output
    assert _migrations(database_url).status == "fail"

    upgraded = CliRunner().invoke(cli, ["db", "upgrade"], env=env)
    assert upgraded.exit_code == 0, upgraded.output
    assert f"empty -> {migrations.head()}" in upgraded.output
    again = CliRunner().invoke(cli, ["db", "upgrade"], env=env)
    assert f"already at {migrations.head()}" in again.output

    current = CliRunner().invoke(cli, ["db", "status"], env=env)
    assert current.exit_code == 0, current.output
    assert _migrations(database_url).status == "ok"
