"""Who decided a reversal a person was asked about, and why.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

A tool whose reversal policy asks (``reversal="ask"`` or a predicate) stops the unwind at its
undo until a person answers: reverse it now, keep the effect with a note, or decide later.
``saga_compensations`` gains ``decisions``: every answer (``decision``, ``by``, ``note``,
``at``), the last one standing, so the books show who kept a credit on purpose and why.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("saga_compensations") as compensations:
        compensations.add_column(
            sa.Column("decisions", sa.JSON(), server_default=sa.text("'[]'"), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("saga_compensations") as compensations:
        compensations.drop_column("decisions")
