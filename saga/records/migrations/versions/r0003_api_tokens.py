"""The HTTP API's bearer tokens (``saga tokens create|revoke|list``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

- ``saga_api_tokens``: one row per token ever made: its public id, the SHA-256 of the whole
  token (never the token itself), its name (the ``by`` of every action taken with it), its
  scope (``read`` or ``operate``), when it was made and, once revoked, when.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "saga_api_tokens",
        sa.Column("token_id", sa.String(32), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("token_id"),
    )
    op.create_index("ix_saga_api_tokens_name", "saga_api_tokens", ["name"])


def downgrade() -> None:
    op.drop_index("ix_saga_api_tokens_name", table_name="saga_api_tokens")
    op.drop_table("saga_api_tokens")
