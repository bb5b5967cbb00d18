"""round_bytes: each round's bytes per category, kept with the transfers ledger; history pruning

Revision ID: 0006_round_bytes
Revises: 0005_transfer_categories
Create Date: 2026-11-30 00:00:00

The dashboard and the simulator's records summed the whole ``transfers`` table (a row per round,
client and category) on every request. ``round_bytes`` holds the same sums per round and
category, added to in the transaction that adds to ``transfers``; upgrading fills it from the
rows already there. ``federations.history_pruned_through`` marks the rounds whose ``transfers``,
``evaluations`` and ``tensor_metrics`` ``history_rounds`` deleted. Downgrading drops both, and is
refused once a federation has pruned: ``transfers`` then no longer holds every byte, and a
re-upgrade would rebuild ``round_bytes`` without them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_round_bytes"
down_revision: str | Sequence[str] | None = "0005_transfer_categories"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("federations") as batch:
        batch.add_column(sa.Column("history_pruned_through", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_table(
        "round_bytes",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("category", sa.String(length=12), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("fedavg_equivalent_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("bytes >= 0", name=op.f("ck_round_bytes_bytes")),
        sa.CheckConstraint("category IN ('train_fetch', 'eval_fetch', 'push')", name=op.f("ck_round_bytes_category")),
        sa.CheckConstraint("fedavg_equivalent_bytes >= 0", name=op.f("ck_round_bytes_fedavg_equivalent_bytes")),
        sa.ForeignKeyConstraint(
            ["federation_id", "round"],
            ["rounds.federation_id", "rounds.number"],
            name=op.f("fk_round_bytes_federation_id_round_rounds"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["federation_id"],
            ["federations.id"],
            name=op.f("fk_round_bytes_federation_id_federations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("federation_id", "round", "category", name=op.f("pk_round_bytes")),
    )
    op.execute(
        "INSERT INTO round_bytes (federation_id, round, category, bytes, fedavg_equivalent_bytes)"
        " SELECT federation_id, round, category, SUM(bytes), SUM(fedavg_equivalent_bytes) FROM transfers"
        " GROUP BY federation_id, round, category"
    )


def downgrade() -> None:
    pruned = op.get_bind().execute(sa.text("SELECT name FROM federations WHERE history_pruned_through > 0")).all()
    if pruned:
        names = ", ".join(repr(n) for (n,) in pruned)
        raise RuntimeError(
            f"cannot downgrade below 0006: federation {names} pruned old rounds' transfers (history_rounds), "
            "whose bytes only round_bytes still holds; restore a backup taken before, or stay at 0006"
        )
    op.drop_table("round_bytes")
    with op.batch_alter_table("federations") as batch:
        batch.drop_column("history_pruned_through")
