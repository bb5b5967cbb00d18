"""clients.evaluated_through: the latest round whose evaluation by the client was counted

Revision ID: 0009_client_evaluated_through
Revises: 0008_update_id_per_client
Create Date: 2026-12-01 00:00:00

An evaluation reported for a round whose ``evaluations`` rows ``history_rounds`` deleted was dropped,
so a report arriving after the next close was lost on the dashboard. It now adds to the round's kept
sums; ``evaluated_through`` tells a retry of a report already counted from a first one (clients report
rounds in order). Upgrading sets it to the client's latest evaluated round, and at least to its
federation's ``history_pruned_through``: rounds pruned before kept no sums, so reports for them stay
refused. Downgrading drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_client_evaluated_through"
down_revision: str | Sequence[str] | None = "0008_update_id_per_client"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.add_column(sa.Column("evaluated_through", sa.Integer(), server_default=sa.text("0"), nullable=False))
    latest = "COALESCE((SELECT MAX(e.round) FROM evaluations e WHERE e.client_id = clients.id), 0)"
    pruned = "(SELECT f.history_pruned_through FROM federations f WHERE f.id = clients.federation_id)"
    op.execute(f"UPDATE clients SET evaluated_through = CASE WHEN {latest} > {pruned} THEN {latest} ELSE {pruned} END")


def downgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.drop_column("evaluated_through")
