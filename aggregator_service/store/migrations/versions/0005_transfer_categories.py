"""transfers.category and transfers.fedavg_equivalent_bytes: one ledger, by category

Revision ID: 0005_transfer_categories
Revises: 0004_round_late_pushes
Create Date: 2026-11-25 00:00:00

A transfer row is now per (round, client, category): ``train_fetch``, ``eval_fetch`` or ``push``
(``direction`` stays, following from the category), with the FedAvg-equivalent of its
transfers. Existing rows map as ``down`` → ``train_fetch`` (they could not tell a training fetch
from an evaluation fetch) and ``up`` → ``push``; their FedAvg-equivalent is the old definition's
share, one full plain model per row (the round's ``round_metrics.fedavg_equivalent_bytes`` was
``2 × cohort × model bytes``), so an old round keeps its old baseline. Rows of a round without
metrics take the model bytes of another round of their federation, else 0.
Downgrading adds a round's two fetch categories back into one ``down`` row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_transfer_categories"
down_revision: str | Sequence[str] | None = "0004_round_late_pushes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PK = ["federation_id", "round", "client_id"]


def upgrade() -> None:
    with op.batch_alter_table("transfers") as batch:
        batch.add_column(sa.Column("category", sa.String(length=12), nullable=True))
        batch.add_column(
            sa.Column("fedavg_equivalent_bytes", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
        )
    conn = op.get_bind()
    conn.execute(sa.text("UPDATE transfers SET category = CASE direction WHEN 'up' THEN 'push' ELSE 'train_fetch' END"))
    model_bytes = _old_model_bytes(conn)
    if model_bytes:
        conn.execute(
            sa.text("UPDATE transfers SET fedavg_equivalent_bytes = :b WHERE federation_id = :f AND round = :r"),
            [{"f": f, "r": r, "b": b} for (f, r), b in model_bytes.items()],
        )
    with op.batch_alter_table("transfers") as batch:
        batch.alter_column("category", existing_type=sa.String(length=12), nullable=False)
        batch.drop_constraint("pk_transfers", type_="primary")
        batch.create_primary_key("pk_transfers", [*PK, "category"])
        batch.create_check_constraint(
            op.f("ck_transfers_category"), "category IN ('train_fetch', 'eval_fetch', 'push')"
        )
        batch.create_check_constraint(op.f("ck_transfers_fedavg_equivalent_bytes"), "fedavg_equivalent_bytes >= 0")


def _old_model_bytes(conn: sa.Connection) -> dict[tuple[int, int], int]:
    """(federation, round) → one plain model's bytes, from the old per-round baseline ``2 × cohort × model``."""
    per_round: dict[tuple[int, int], int] = {}
    rows = conn.execute(
        sa.text(
            "SELECT m.federation_id, m.round, m.fedavg_equivalent_bytes, r.cohort_json FROM round_metrics m"
            " JOIN rounds r ON r.federation_id = m.federation_id AND r.number = m.round"
            " WHERE m.fedavg_equivalent_bytes IS NOT NULL"
        )
    ).all()
    for fed, rnd, fedavg, cohort in rows:
        members = len(json.loads(cohort) if isinstance(cohort, str) else cohort or [])
        if members and fedavg:
            per_round[(fed, rnd)] = int(fedavg) // (2 * members)
    by_fed = {fed: b for (fed, _), b in sorted(per_round.items())}
    out = dict(per_round)
    for fed, rnd in conn.execute(sa.text("SELECT DISTINCT federation_id, round FROM transfers")).all():
        if (fed, rnd) not in out and fed in by_fed:
            out[(fed, rnd)] = by_fed[fed]
    return out


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT federation_id, round, client_id, direction, SUM(bytes) FROM transfers"
            " GROUP BY federation_id, round, client_id, direction"
        )
    ).all()
    conn.execute(sa.text("DELETE FROM transfers"))
    with op.batch_alter_table("transfers") as batch:
        batch.drop_constraint(op.f("ck_transfers_category"), type_="check")
        batch.drop_constraint(op.f("ck_transfers_fedavg_equivalent_bytes"), type_="check")
        batch.drop_constraint("pk_transfers", type_="primary")
        batch.create_primary_key("pk_transfers", [*PK, "direction"])
        batch.drop_column("fedavg_equivalent_bytes")
        batch.drop_column("category")
    if rows:
        conn.execute(
            sa.text(
                "INSERT INTO transfers (federation_id, round, client_id, direction, bytes) VALUES (:f, :r, :c, :d, :b)"
            ),
            [{"f": f, "r": r, "c": c, "d": d, "b": int(b)} for f, r, c, d, b in rows],
        )
