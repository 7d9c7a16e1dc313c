"""Alembic's entry point for saga's migrations: always on the connection ``upgrade`` (or the
test comparing models and migrations) hands over, inside its transaction and lock; there is no
offline mode."""

from __future__ import annotations

from alembic import context

from saga.records.migrations import VERSION_TABLE
from saga.records.models import Base

connection = context.config.attributes["connection"]
if connection is None:
    raise RuntimeError("saga's migrations run through saga.records.migrations.upgrade()")
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    compare_type=True,
    # SQLite cannot alter a column in place: such changes copy the table (batch mode).
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
