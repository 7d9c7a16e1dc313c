"""A token's name is unique among live tokens, in the schema.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

``saga tokens create`` checked "no live token of this name" with a SELECT before its INSERT,
so two creates at once could both pass it. A partial unique index on ``name`` where
``revoked_at IS NULL`` (PostgreSQL and SQLite both have them) makes the database refuse the
second. Before the index is made, a name held by several live tokens keeps its oldest; the
others (made past the check, so an action of theirs could not be told from the first's) are
revoked now, and the migration says which.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

logger = logging.getLogger("saga.records")

_LIVE = sa.text("revoked_at IS NULL")
_TOKENS = sa.table(
    "saga_api_tokens",
    sa.column("token_id", sa.String),
    sa.column("name", sa.String),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("revoked_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    connection = op.get_bind()
    live = connection.execute(
        sa.select(_TOKENS.c.token_id, _TOKENS.c.name)
        .where(_TOKENS.c.revoked_at.is_(None))
        .order_by(_TOKENS.c.name, _TOKENS.c.created_at, _TOKENS.c.token_id)
    ).all()
    kept: set[str] = set()
    for token_id, name in live:
        if name not in kept:
            kept.add(name)
            continue
        logger.warning("token %s revoked: the name %r has an older live token", token_id, name)
        connection.execute(
            sa.update(_TOKENS)
            .where(_TOKENS.c.token_id == token_id)
            .values(revoked_at=datetime.now(UTC))
        )
    op.create_index(
        "ux_saga_api_tokens_live_name",
        "saga_api_tokens",
        ["name"],
        unique=True,
        postgresql_where=_LIVE,
        sqlite_where=_LIVE,
    )


def downgrade() -> None:
    op.drop_index("ux_saga_api_tokens_live_name", table_name="saga_api_tokens")
