"""updates: ``update_id`` unique per client, as ``PushHeader.update_id`` is scoped to the client

Revision ID: 0008_update_id_per_client
Revises: 0007_update_move_scale
Create Date: 2026-12-01 00:00:00

The unique index held one key across the federation, so a client choosing its keys its own way
(``round-12``) was refused for another client's, and could learn which keys others had used.
Every row an earlier revision stored is unique under the new index too (a key unique across the
federation is unique per client); a downgrade meets rows two clients share and
is refused, naming one.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_update_id_per_client"
down_revision: str | Sequence[str] | None = "0007_update_move_scale"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("updates") as batch:
        batch.drop_index(op.f("ix_updates_federation_id_update_id"))
        batch.create_index(
            op.f("ix_updates_federation_id_client_id_update_id"),
            ["federation_id", "client_id", "update_id"],
            unique=True,
        )


def downgrade() -> None:
    shared = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT f.name, u.update_id FROM updates u JOIN federations f ON f.id = u.federation_id"
                " GROUP BY f.name, u.update_id HAVING COUNT(DISTINCT u.client_id) > 1 ORDER BY f.name, u.update_id"
            )
        )
        .first()
    )
    if shared is not None:
        name, update_id = shared
        raise RuntimeError(
            f"cannot downgrade below 0008: in federation {name!r} several clients pushed updates with the id "
            f"{update_id!r}, which the older schema holds once per federation; restore a backup taken before, "
            "or stay at 0008"
        )
    with op.batch_alter_table("updates") as batch:
        batch.drop_index(op.f("ix_updates_federation_id_client_id_update_id"))
        batch.create_index(op.f("ix_updates_federation_id_update_id"), ["federation_id", "update_id"], unique=True)
