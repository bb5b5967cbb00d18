"""initial schema: federations, clients, rounds, global model, updates, strategy state, metrics

Revision ID: 0001_initial
Revises:
Create Date: 2026-01-01 00:00:00

Written out explicitly (a revision is frozen history: it must not import the current models).
JSON columns are TEXT; timestamps are ``timestamp with time zone`` on PostgreSQL and UTC text on
SQLite; blobs are ``bytea`` / ``BLOB``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite auto-increments INTEGER PRIMARY KEY only
_OPEN = sa.text("state = 'open'")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _fed_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["federation_id"], ["federations.id"], name=op.f(f"fk_{table}_federation_id_federations"), ondelete="CASCADE"
    )


def _round_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["federation_id", "round"],
        ["rounds.federation_id", "rounds.number"],
        name=op.f(f"fk_{table}_federation_id_round_rounds"),
        ondelete="CASCADE",
    )


def _client_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["client_id"], ["clients.id"], name=op.f(f"fk_{table}_client_id_clients"), ondelete="CASCADE"
    )


def upgrade() -> None:
    op.create_table(
        "federations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("current_round", sa.Integer(), nullable=False),
        sa.Column("enrollment_secret_hash", sa.String(length=256), nullable=False),
        sa.Column("strategy_state_json", sa.Text(), nullable=False),
        sa.Column("policy_state_json", sa.Text(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.CheckConstraint("state IN ('running', 'paused', 'done')", name=op.f("ck_federations_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_federations")),
        sa.UniqueConstraint("name", name=op.f("uq_federations_name")),
    )

    op.create_table(
        "clients",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        _ts("revoked_at", nullable=True),
        sa.Column("profile_json", sa.Text(), nullable=False),
        sa.Column("tier", sa.Float(), nullable=False),
        _ts("registered_at"),
        _ts("last_seen"),
        sa.Column("rounds_joined", sa.Integer(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("last_accuracy", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "bytes_up >= 0 AND bytes_down >= 0 AND rounds_joined >= 0", name=op.f("ck_clients_counters")
        ),
        _fed_fk("clients"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_clients")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_clients_token_hash")),
    )
    op.create_index(op.f("ix_clients_federation_id_last_seen"), "clients", ["federation_id", "last_seen"])
    op.create_index(op.f("ix_clients_federation_id_registered_at"), "clients", ["federation_id", "registered_at"])

    op.create_table(
        "rounds",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cohort_json", sa.Text(), nullable=False),
        sa.Column("due_json", sa.Text(), nullable=False),
        sa.Column("continue_unsynced", sa.Boolean(), nullable=False),
        _ts("deadline"),
        sa.Column("extended", sa.Boolean(), nullable=False),
        _ts("opened_at"),
        _ts("closed_at", nullable=True),
        sa.Column("reported", sa.Integer(), nullable=False),
        sa.Column("stragglers", sa.Integer(), nullable=False),
        sa.CheckConstraint("state IN ('open', 'closed', 'abandoned')", name=op.f("ck_rounds_state")),
        sa.CheckConstraint("number >= 1", name=op.f("ck_rounds_number")),
        _fed_fk("rounds"),
        sa.PrimaryKeyConstraint("federation_id", "number", name=op.f("pk_rounds")),
    )
    # At most one open round per federation, whatever the number of replicas.
    op.create_index(
        "uq_rounds_one_open", "rounds", ["federation_id"], unique=True, sqlite_where=_OPEN, postgresql_where=_OPEN
    )

    op.create_table(
        "global_tensors",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("interval", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("shape_json", sa.Text(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.CheckConstraint("interval >= 1", name=op.f("ck_global_tensors_interval")),
        _fed_fk("global_tensors"),
        sa.PrimaryKeyConstraint("federation_id", "name", name=op.f("pk_global_tensors")),
    )

    op.create_table(
        "strategy_tensors",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("shape_json", sa.Text(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        _fed_fk("strategy_tensors"),
        sa.PrimaryKeyConstraint("federation_id", "kind", "name", name=op.f("pk_strategy_tensors")),
    )

    op.create_table(
        "updates",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("client_id", sa.String(length=32), nullable=False),
        sa.Column("update_id", sa.String(length=128), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        _ts("received_at"),
        sa.CheckConstraint("num_samples >= 1", name=op.f("ck_updates_num_samples")),
        _client_fk("updates"),
        _round_fk("updates"),
        _fed_fk("updates"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_updates")),
    )
    op.create_index(
        op.f("ix_updates_federation_id_round_client_id"),
        "updates",
        ["federation_id", "round", "client_id"],
        unique=True,
    )
    op.create_index(op.f("ix_updates_federation_id_update_id"), "updates", ["federation_id", "update_id"], unique=True)

    op.create_table(
        "update_tensors",
        sa.Column("update_pk", _ID, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("shape_json", sa.Text(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.CheckConstraint("kind IN ('model', 'control_delta')", name=op.f("ck_update_tensors_kind")),
        sa.ForeignKeyConstraint(
            ["update_pk"], ["updates.id"], name=op.f("fk_update_tensors_update_pk_updates"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("update_pk", "kind", "name", name=op.f("pk_update_tensors")),
    )

    op.create_table(
        "round_metrics",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("test_accuracy", sa.Float(), nullable=True),
        sa.Column("test_loss", sa.Float(), nullable=True),
        sa.Column("mean_client_accuracy", sa.Float(), nullable=True),
        sa.Column("personalized_accuracy", sa.Float(), nullable=True),
        sa.Column("dispersion", sa.Float(), nullable=True),
        sa.Column("latent_clients", sa.Integer(), nullable=True),
        sa.Column("bytes_up", sa.BigInteger(), nullable=True),
        sa.Column("bytes_down", sa.BigInteger(), nullable=True),
        sa.Column("fedavg_equivalent_bytes", sa.BigInteger(), nullable=True),
        sa.Column("duration_seconds", sa.Float(), nullable=True),
        sa.Column("extra_json", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "(bytes_up IS NULL OR bytes_up >= 0) AND (bytes_down IS NULL OR bytes_down >= 0)",
            name=op.f("ck_round_metrics_bytes"),
        ),
        _round_fk("round_metrics"),
        _fed_fk("round_metrics"),
        sa.PrimaryKeyConstraint("federation_id", "round", name=op.f("pk_round_metrics")),
    )

    op.create_table(
        "tensor_metrics",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=32), nullable=True),
        sa.Column("d_l", sa.Float(), nullable=True),
        sa.Column("dispersion", sa.Float(), nullable=True),
        sa.Column("interval", sa.Integer(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.CheckConstraint("bytes_up >= 0 AND bytes_down >= 0", name=op.f("ck_tensor_metrics_bytes")),
        sa.CheckConstraint("interval >= 1", name=op.f("ck_tensor_metrics_interval")),
        _round_fk("tensor_metrics"),
        _fed_fk("tensor_metrics"),
        sa.PrimaryKeyConstraint("federation_id", "round", "name", name=op.f("pk_tensor_metrics")),
    )
    op.create_index(
        op.f("ix_tensor_metrics_federation_id_name_round"), "tensor_metrics", ["federation_id", "name", "round"]
    )

    op.create_table(
        "transfers",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("client_id", sa.String(length=32), nullable=False),
        sa.Column("direction", sa.String(length=4), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("direction IN ('down', 'up')", name=op.f("ck_transfers_direction")),
        sa.CheckConstraint("bytes >= 0", name=op.f("ck_transfers_bytes")),
        _client_fk("transfers"),
        _round_fk("transfers"),
        _fed_fk("transfers"),
        sa.PrimaryKeyConstraint("federation_id", "round", "client_id", "direction", name=op.f("pk_transfers")),
    )
    op.create_index(op.f("ix_transfers_federation_id_client_id"), "transfers", ["federation_id", "client_id"])

    op.create_table(
        "evaluations",
        sa.Column("federation_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("client_id", sa.String(length=32), nullable=False),
        sa.Column("global_accuracy", sa.Float(), nullable=True),
        sa.Column("global_loss", sa.Float(), nullable=True),
        sa.Column("personalized_accuracy", sa.Float(), nullable=True),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        _ts("reported_at"),
        sa.CheckConstraint("num_samples >= 0", name=op.f("ck_evaluations_num_samples")),
        _client_fk("evaluations"),
        _round_fk("evaluations"),
        _fed_fk("evaluations"),
        sa.PrimaryKeyConstraint("federation_id", "round", "client_id", name=op.f("pk_evaluations")),
    )
    op.create_index(op.f("ix_evaluations_federation_id_client_id"), "evaluations", ["federation_id", "client_id"])


def downgrade() -> None:
    # Dropping a table drops its indexes; children before parents.
    for table in (
        "evaluations",
        "transfers",
        "tensor_metrics",
        "round_metrics",
        "update_tensors",
        "updates",
        "strategy_tensors",
        "global_tensors",
        "rounds",
        "clients",
        "federations",
    ):
        op.drop_table(table)
