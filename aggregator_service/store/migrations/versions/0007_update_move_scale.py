"""updates.move_scale: the scale a push was told, kept for the fold and for a retry after the close

Revision ID: 0007_update_move_scale
Revises: 0006_round_bytes
Create Date: 2026-11-30 00:00:00

In clip mode the fold scales a long update's move, and the push's reply tells the client by how
much (``PushReply.move_scale``) so that its FedDyn or FedDC state follows the move folded. The
scale was computed again at the fold, under the settings the aggregator then ran with, and a retry
whose round had closed could no longer be told it. Rows written before this revision hold NULL:
the fold computes their scale as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_update_move_scale"
down_revision: str | Sequence[str] | None = "0006_round_bytes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("updates") as batch:
        batch.add_column(sa.Column("move_scale", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("updates") as batch:
        batch.drop_column("move_scale")
