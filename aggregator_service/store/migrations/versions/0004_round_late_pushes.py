"""rounds.late_pushes: pushes refused because their round had closed

Revision ID: 0004_round_late_pushes
Revises: 0003_client_certificate
Create Date: 2026-11-24 00:00:00

Rounds closed before this revision count none.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_round_late_pushes"
down_revision: str | Sequence[str] | None = "0003_client_certificate"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("late_pushes", sa.Integer(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("late_pushes")
