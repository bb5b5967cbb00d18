"""clients.cert_sha256: the client certificate a token is bound to under mutual TLS

Revision ID: 0003_client_certificate
Revises: 0002_client_number
Create Date: 2026-11-23 00:00:00

Clients registered before have none: their tokens keep working with any certificate of the CA.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_client_certificate"
down_revision: str | Sequence[str] | None = "0002_client_number"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.add_column(sa.Column("cert_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.drop_column("cert_sha256")
