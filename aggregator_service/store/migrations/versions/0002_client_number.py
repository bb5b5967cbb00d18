"""clients.number: registration order within the federation

Revision ID: 0002_client_number
Revises: 0001_initial
Create Date: 2026-11-23 00:00:00

The round engine keys cohort sampling, local-training seeds and fold order by it (see
``fedcore.keys.client_key``). Existing clients are numbered by registration time.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_client_number"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.add_column(sa.Column("number", sa.Integer(), nullable=True))
    conn = op.get_bind()
    clients = sa.table(
        "clients", sa.column("id"), sa.column("federation_id"), sa.column("registered_at"), sa.column("number")
    )
    rows = conn.execute(
        sa.select(clients.c.id, clients.c.federation_id).order_by(clients.c.registered_at, clients.c.id)
    )
    counters: dict[int, int] = {}
    for client_id, federation_id in rows.all():
        number = counters.get(federation_id, 0)
        counters[federation_id] = number + 1
        conn.execute(sa.update(clients).where(clients.c.id == client_id).values(number=number))
    with op.batch_alter_table("clients") as batch:
        batch.alter_column("number", existing_type=sa.Integer(), nullable=False)
    op.create_index(op.f("ix_clients_federation_id_number"), "clients", ["federation_id", "number"], unique=True)


def downgrade() -> None:
    op.drop_index(op.f("ix_clients_federation_id_number"), table_name="clients")
    with op.batch_alter_table("clients") as batch:
        batch.drop_column("number")
