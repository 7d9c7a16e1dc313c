"""The records as they were before migrations: runs, transcripts and escalations.

Revision ID: 0001
Revises:
Create Date: 2026-12-01

A database whose tables ``create_all`` made holds exactly this; ``upgrade`` stamps it so.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "saga_runs",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_index("ix_saga_runs_state", "saga_runs", ["state"])
    op.create_table(
        "saga_transcripts",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("agent", sa.String(100), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("model_calls", sa.Integer(), nullable=False),
        sa.Column("transcript", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_index("ix_saga_transcripts_agent", "saga_transcripts", ["agent"])
    op.create_table(
        "saga_escalations",
        sa.Column("escalation_id", sa.String(160), nullable=False),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("steps_done", sa.JSON(), nullable=False),
        sa.Column("stack", sa.JSON(), nullable=False),
        sa.Column("failed_compensations", sa.JSON(), nullable=False),
        sa.Column("not_undone", sa.JSON(), nullable=False),
        sa.Column("resolved", sa.Boolean(), nullable=False),
        sa.Column("resolution", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("escalation_id"),
    )
    op.create_index("ix_saga_escalations_run_id", "saga_escalations", ["run_id"])


def downgrade() -> None:
    op.drop_table("saga_escalations")
    op.drop_table("saga_transcripts")
    op.drop_table("saga_runs")
