"""The aggregator's durable state as SQLAlchemy 2 declarative tables.

Everything the service needs to resume after a restart lives here, nowhere else: the
federation's configuration and engine state, enrolled clients (token *hashes* only), rounds
and their cohorts, the global tensors with versions and intervals, acknowledged client
updates awaiting aggregation, SCAFFOLD's server control, and the metrics the dashboard plots.

Conventions
-----------
* Tensors are raw little-endian C-order bytes (:func:`fedcore.codec.encode`) with ``dtype``
  and ``shape_json`` columns; blob columns are *deferred*, so loading a row never pulls its
  blob unless asked (the repository selects blob columns explicitly).
* Columns named ``*_json`` hold JSON text; the ORM attribute drops the suffix and holds the
  decoded value (``Federation.config`` ↔ column ``config_json``). Reassign, don't mutate in
  place: in-place changes to a JSON value are not tracked.
* Timestamps are timezone-aware UTC on every backend (:class:`UTCDateTime`); naive datetimes
  are refused rather than guessed.
* Constraint names follow :data:`NAMING_CONVENTION`, so migrations can address them on
  SQLite (batch mode) and PostgreSQL alike.

The schema is created by the Alembic revisions in ``migrations/`` (see :func:`upgrade`), never
by ``metadata.create_all``; a test checks the two agree.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from aggregator_service.federation_name import FEDERATION_NAME_MAX

__all__ = [
    "FEDERATION_STATES",
    "NAMING_CONVENTION",
    "ROUND_STATES",
    "TENSOR_KINDS",
    "TRANSFER_CATEGORIES",
    "TRANSFER_DIRECTIONS",
    "Base",
    "Client",
    "Evaluation",
    "Federation",
    "GlobalTensor",
    "JSONText",
    "Round",
    "RoundBytes",
    "RoundMetrics",
    "StrategyTensor",
    "TensorMetric",
    "Transfer",
    "UTCDateTime",
    "Update",
    "UpdateTensor",
    "utcnow",
]

FEDERATION_STATES = ("running", "paused", "done")
ROUND_STATES = ("open", "closed", "abandoned")
TENSOR_KINDS = ("model", "control_delta")
TRANSFER_DIRECTIONS = ("down", "up")
#: A transfer's category and its direction: a fetch to train, a fetch of a closed round's model to evaluate, a push.
TRANSFER_CATEGORIES = {"train_fetch": "down", "eval_fetch": "down", "push": "up"}

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


# --------------------------------------------------------------------------- column types


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite stores no offset, so it is implied)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one (e.g. datetime.now(UTC))")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class JSONText(TypeDecorator[Any]):
    """JSON in a TEXT column: standard JSON only (NaN/Infinity are refused so browsers can parse it)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


def _id_type() -> BigInteger:
    # SQLite only auto-increments an INTEGER PRIMARY KEY.
    return BigInteger().with_variant(Integer(), "sqlite")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# --------------------------------------------------------------------------- federation and clients


class Federation(Base):
    """One federation: configuration, lifecycle state and the engine's JSON state."""

    __tablename__ = "federations"
    __table_args__ = (CheckConstraint(_in("state", FEDERATION_STATES), name="state"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(FEDERATION_NAME_MAX), unique=True)
    config: Mapped[dict[str, Any]] = mapped_column("config_json", JSONText)
    state: Mapped[str] = mapped_column(String(16), default="running")
    current_round: Mapped[int] = mapped_column(Integer, default=0)
    # "pbkdf2_sha256$<iterations>$<salt hex>$<digest hex>"; the secret itself is never stored.
    enrollment_secret_hash: Mapped[str] = mapped_column(String(256))
    strategy_state: Mapped[dict[str, Any]] = mapped_column("strategy_state_json", JSONText, default=dict)
    policy_state: Mapped[dict[str, Any]] = mapped_column("policy_state_json", JSONText, default=dict)
    #: rounds up to this one have lost their per-client and per-tensor rows (``history_rounds``): a late
    #: evaluation or transfer for one of them adds to its totals only
    history_pruned_through: Mapped[int] = mapped_column(Integer, server_default=text("0"), deferred=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    def __repr__(self) -> str:
        return f"Federation(id={self.id}, name={self.name!r}, state={self.state!r}, round={self.current_round})"


class Client(Base):
    """An enrolled device; authenticated by the SHA-256 of its bearer token."""

    __tablename__ = "clients"
    # evaluated_through is read and written by Core statements alone: an insert need not return its default
    # (nor so need the column, which a database written before 0009 lacks)
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}
    __table_args__ = (
        Index(None, "federation_id", "last_seen"),
        Index(None, "federation_id", "registered_at"),
        Index(None, "federation_id", "number", unique=True),
        CheckConstraint("bytes_up >= 0 AND bytes_down >= 0 AND rounds_joined >= 0", name="counters"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4 hex
    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    # Registration order within the federation (0, 1, …): the engine samples cohorts, seeds local
    # training and folds updates by it, so a run through gRPC repeats an in-process run exactly.
    number: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the bearer token
    # sha256 hex of the DER client certificate it registered with under mutual TLS: the token is
    # honoured only with that certificate (None: registered without one)
    cert_sha256: Mapped[str | None] = mapped_column(String(64))
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    profile: Mapped[dict[str, Any]] = mapped_column("profile_json", JSONText)
    tier: Mapped[float] = mapped_column(Float)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    rounds_joined: Mapped[int] = mapped_column(Integer, default=0)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    last_accuracy: Mapped[float | None] = mapped_column(Float)
    #: the latest round whose evaluation by this client was counted: clients report rounds in order, so a report
    #: at or below it for a round whose ``evaluations`` rows are pruned (``history_rounds``) is a retry
    evaluated_through: Mapped[int] = mapped_column(Integer, server_default=text("0"), deferred=True)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def __repr__(self) -> str:
        return f"Client(id={self.id!r}, name={self.name!r}, tier={self.tier:g}, revoked={self.revoked})"


# --------------------------------------------------------------------------- rounds and global model


class Round(Base):
    """One round's plan and lifecycle; at most one round per federation is open (partial unique index)."""

    __tablename__ = "rounds"
    __table_args__ = (
        CheckConstraint(_in("state", ROUND_STATES), name="state"),
        CheckConstraint("number >= 1", name="number"),
        Index(
            "uq_rounds_one_open",
            "federation_id",
            unique=True,
            sqlite_where=text("state = 'open'"),
            postgresql_where=text("state = 'open'"),
        ),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    state: Mapped[str] = mapped_column(String(16), default="open")
    cohort: Mapped[list[str]] = mapped_column("cohort_json", JSONText)
    due: Mapped[list[str]] = mapped_column("due_json", JSONText)
    continue_unsynced: Mapped[bool] = mapped_column(Boolean, default=False)
    deadline: Mapped[datetime] = mapped_column(UTCDateTime)
    extended: Mapped[bool] = mapped_column(Boolean, default=False)
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    reported: Mapped[int] = mapped_column(Integer, default=0)
    stragglers: Mapped[int] = mapped_column(Integer, default=0)
    # pushes refused because this round had closed (or was abandoned) before they arrived
    late_pushes: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))

    def __repr__(self) -> str:
        return f"Round(federation_id={self.federation_id}, number={self.number}, state={self.state!r})"


class GlobalTensor(Base):
    """A full-rank global tensor: its value, the round that produced it (version) and its interval τ_l."""

    __tablename__ = "global_tensors"
    __table_args__ = (CheckConstraint("interval >= 1", name="interval"),)

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    interval: Mapped[int] = mapped_column(Integer, default=1)
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[list[int]] = mapped_column("shape_json", JSONText)
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)


class StrategyTensor(Base):
    """Tensor state of the strategy, e.g. SCAFFOLD's server control (``kind = 'server_control'``)."""

    __tablename__ = "strategy_tensors"

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[list[int]] = mapped_column("shape_json", JSONText)
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)


# --------------------------------------------------------------------------- client updates


class Update(Base):
    """An acknowledged client update awaiting aggregation (deleted once its round closes)."""

    __tablename__ = "updates"
    __table_args__ = (
        ForeignKeyConstraint(["federation_id", "round"], ["rounds.federation_id", "rounds.number"], ondelete="CASCADE"),
        Index(None, "federation_id", "client_id", "update_id", unique=True),  # an idempotency key is the client's
        # one update per client per round; also the index iter_round_updates walks in client order
        Index(None, "federation_id", "round", "client_id", unique=True),
        CheckConstraint("num_samples >= 1", name="num_samples"),
    )

    id: Mapped[int] = mapped_column(_id_type(), primary_key=True, autoincrement=True)
    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    client_id: Mapped[str] = mapped_column(ForeignKey("clients.id", ondelete="CASCADE"))
    update_id: Mapped[str] = mapped_column(String(128))
    num_samples: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, float]] = mapped_column("metrics_json", JSONText, default=dict)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: the factor the fold scales this update's move by, as its push was told (``PushReply.move_scale``):
    #: kept so that the fold and a retry after the close answer what the client already followed; NULL
    #: for a row an older version wrote (the fold computes it then)
    move_scale: Mapped[float | None] = mapped_column(Float)

    def __repr__(self) -> str:
        return f"Update(id={self.id}, round={self.round}, client_id={self.client_id!r}, update_id={self.update_id!r})"


class UpdateTensor(Base):
    """One tensor of an update: a model tensor or a SCAFFOLD control delta."""

    __tablename__ = "update_tensors"
    __table_args__ = (CheckConstraint(_in("kind", TENSOR_KINDS), name="kind"),)

    update_pk: Mapped[int] = mapped_column(ForeignKey("updates.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[list[int]] = mapped_column("shape_json", JSONText)
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)


# --------------------------------------------------------------------------- metrics


def _round_fk() -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["federation_id", "round"], ["rounds.federation_id", "rounds.number"], ondelete="CASCADE"
    )


class RoundMetrics(Base):
    """What one closed round achieved and moved (one row per closed round)."""

    __tablename__ = "round_metrics"
    __table_args__ = (
        _round_fk(),
        CheckConstraint(
            "(bytes_up IS NULL OR bytes_up >= 0) AND (bytes_down IS NULL OR bytes_down >= 0)", name="bytes"
        ),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    test_accuracy: Mapped[float | None] = mapped_column(Float)
    test_loss: Mapped[float | None] = mapped_column(Float)
    mean_client_accuracy: Mapped[float | None] = mapped_column(Float)
    personalized_accuracy: Mapped[float | None] = mapped_column(Float)
    dispersion: Mapped[float | None] = mapped_column(Float)
    latent_clients: Mapped[int | None] = mapped_column(Integer)
    bytes_up: Mapped[int | None] = mapped_column(BigInteger)
    bytes_down: Mapped[int | None] = mapped_column(BigInteger)
    fedavg_equivalent_bytes: Mapped[int | None] = mapped_column(BigInteger)
    duration_seconds: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None] = mapped_column("extra_json", JSONText)


class TensorMetric(Base):
    """Per tensor per round: d_l, dispersion, interval in force, bytes moved, version."""

    __tablename__ = "tensor_metrics"
    __table_args__ = (
        _round_fk(),
        Index(None, "federation_id", "name", "round"),  # one tensor's interval / d_l history
        CheckConstraint("bytes_up >= 0 AND bytes_down >= 0", name="bytes"),
        CheckConstraint("interval >= 1", name="interval"),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    ordinal: Mapped[int] = mapped_column(Integer, default=0)  # position in the model (spec order), for plots
    role: Mapped[str | None] = mapped_column(String(32))
    d_l: Mapped[float | None] = mapped_column(Float)
    dispersion: Mapped[float | None] = mapped_column(Float)
    interval: Mapped[int] = mapped_column(Integer, default=1)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    version: Mapped[int | None] = mapped_column(Integer)


class Transfer(Base):
    """Bytes moved per client, per category, per round (summed when recorded twice): the one bandwidth ledger.

    ``category`` is ``train_fetch``, ``eval_fetch`` or ``push`` (``direction`` follows from it:
    down, down, up); ``fedavg_equivalent_bytes`` is what plain FedAvg moves for the same transfers
    (:func:`aggregator_service.metrics.fedavg_equivalent_bytes`). Surfaces read its per-round sums,
    :class:`RoundBytes`; a client's own per-round bytes come from here.
    """

    __tablename__ = "transfers"
    __table_args__ = (
        _round_fk(),
        CheckConstraint(_in("direction", TRANSFER_DIRECTIONS), name="direction"),
        CheckConstraint(_in("category", tuple(TRANSFER_CATEGORIES)), name="category"),
        CheckConstraint("bytes >= 0", name="bytes"),
        CheckConstraint("fedavg_equivalent_bytes >= 0", name="fedavg_equivalent_bytes"),
        Index(None, "federation_id", "client_id"),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    client_id: Mapped[str] = mapped_column(ForeignKey("clients.id", ondelete="CASCADE"), primary_key=True)
    category: Mapped[str] = mapped_column(String(12), primary_key=True)
    direction: Mapped[str] = mapped_column(String(4))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    fedavg_equivalent_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


class RoundBytes(Base):
    """A round's bytes per category, the ``transfers`` ledger summed over its clients as it is written.

    :func:`~aggregator_service.store.record_transfers` adds to both in one transaction; the surfaces
    that sum a federation's bytes read this table, whose size grows with its rounds, not with rounds ×
    cohort, and which keeps a round's sums when ``history_rounds`` deletes its ``transfers`` rows.
    """

    __tablename__ = "round_bytes"
    __table_args__ = (
        _round_fk(),
        CheckConstraint(_in("category", tuple(TRANSFER_CATEGORIES)), name="category"),
        CheckConstraint("bytes >= 0", name="bytes"),
        CheckConstraint("fedavg_equivalent_bytes >= 0", name="fedavg_equivalent_bytes"),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    category: Mapped[str] = mapped_column(String(12), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    fedavg_equivalent_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


class Evaluation(Base):
    """A client's evaluation of the global (and personalized) model after a round; the last report wins."""

    __tablename__ = "evaluations"
    __table_args__ = (
        _round_fk(),
        CheckConstraint("num_samples >= 0", name="num_samples"),
        Index(None, "federation_id", "client_id"),
    )

    federation_id: Mapped[int] = mapped_column(ForeignKey("federations.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    client_id: Mapped[str] = mapped_column(ForeignKey("clients.id", ondelete="CASCADE"), primary_key=True)
    global_accuracy: Mapped[float | None] = mapped_column(Float)
    global_loss: Mapped[float | None] = mapped_column(Float)
    personalized_accuracy: Mapped[float | None] = mapped_column(Float)
    num_samples: Mapped[int] = mapped_column(Integer, default=0)
    reported_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
