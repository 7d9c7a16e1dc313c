"""Steps, compensations and operator actions; what a run needs to be rebuilt; who resolved.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

- ``saga_steps``, ``saga_compensations``: a run's steps and undos as rows (queryable, and what
  a requeue rebuilds the run's Redis keys from once they have expired).
- ``saga_actions``: requeues (with corrections) and resolves, with who and when.
- ``saga_runs`` gains the run's fields a rebuild needs, and its hosted agent's name.
- ``saga_escalations`` gains who resolved it, and when.
- ``saga_transcripts.run_id`` grows to the 128 characters a run id may have (it was 64).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

RUN_ID = sa.String(128)
NAME = sa.String(200)


def upgrade() -> None:
    with op.batch_alter_table("saga_runs") as runs:
        runs.add_column(sa.Column("cause", sa.Text(), server_default="", nullable=False))
        runs.add_column(sa.Column("agent", NAME, server_default="", nullable=False))
        runs.add_column(sa.Column("pivot_step", sa.Integer(), nullable=True))
        runs.add_column(
            sa.Column("generation", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        runs.add_column(sa.Column("version", sa.Integer(), nullable=True))
        runs.add_column(sa.Column("owner", NAME, server_default="", nullable=False))
        runs.add_column(sa.Column("deadline_seconds", sa.Float(), nullable=True))
        runs.add_column(sa.Column("doubt", sa.Text(), server_default="", nullable=False))
        runs.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
        runs.create_index("ix_saga_runs_agent", ["agent"])
    with op.batch_alter_table("saga_escalations") as escalations:
        escalations.add_column(sa.Column("resolved_by", NAME, server_default="", nullable=False))
        escalations.add_column(sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("saga_transcripts") as transcripts:
        transcripts.alter_column("run_id", type_=RUN_ID, existing_type=sa.String(64))
    op.create_table(
        "saga_steps",
        sa.Column("run_id", RUN_ID, nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("tool", NAME, nullable=False),
        sa.Column("tool_class", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("reconciled", sa.String(16), nullable=False),
        sa.Column("landed", sa.String(16), nullable=False),
        sa.Column("call", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "step"),
    )
    op.create_index("ix_saga_steps_tool", "saga_steps", ["tool"])
    op.create_table(
        "saga_compensations",
        sa.Column("run_id", RUN_ID, nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("tool", NAME, nullable=False),
        sa.Column("entry", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("round_start", sa.Integer(), nullable=False),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("settled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("task_id", sa.String(328), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=False),
        sa.Column("stack_position", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "step"),
    )
    op.create_table(
        "saga_actions",
        sa.Column("action_id", sa.String(176), nullable=False),
        sa.Column("run_id", RUN_ID, nullable=False),
        sa.Column("escalation_id", sa.String(160), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("by", NAME, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("corrections", sa.JSON(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("action_id"),
    )
    op.create_index("ix_saga_actions_run_id", "saga_actions", ["run_id"])


def downgrade() -> None:
    op.drop_table("saga_actions")
    op.drop_table("saga_compensations")
    op.drop_table("saga_steps")
    with op.batch_alter_table("saga_transcripts") as transcripts:
        transcripts.alter_column("run_id", type_=sa.String(64), existing_type=RUN_ID)
    with op.batch_alter_table("saga_escalations") as escalations:
        escalations.drop_column("resolved_at")
        escalations.drop_column("resolved_by")
    with op.batch_alter_table("saga_runs") as runs:
        runs.drop_index("ix_saga_runs_agent")
        for column in (
            "updated_at",
            "doubt",
            "deadline_seconds",
            "owner",
            "version",
            "generation",
            "pivot_step",
            "agent",
            "cause",
        ):
            runs.drop_column(column)
