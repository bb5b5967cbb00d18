"""Bandwidth accounting and :func:`close_round`: everything a round's close writes, in one transaction."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from ..models import (
    TRANSFER_CATEGORIES,
    TRANSFER_DIRECTIONS,
    Client,
    Federation,
    Round,
    RoundBytes,
    RoundMetrics,
    TensorMetric,
    Transfer,
)
from ._common import _attached, _count, _finite, _json, _now, _upsert
from .rounds import _open, consume_round_updates, reported_clients
from .tensors import SERVER_CONTROL, _set_intervals, save_global_tensors, save_strategy_tensors, tensor_versions

__all__ = [
    "ROUND_METRIC_FIELDS",
    "TENSOR_METRIC_FIELDS",
    "close_round",
    "record_transfer",
    "record_transfers",
    "round_transfers",
]

ROUND_METRIC_FIELDS = frozenset(
    {
        "test_accuracy",
        "test_loss",
        "mean_client_accuracy",
        "personalized_accuracy",
        "dispersion",
        "latent_clients",
        "bytes_up",
        "bytes_down",
        "fedavg_equivalent_bytes",
        "duration_seconds",
        "extra",
    }
)
TENSOR_METRIC_FIELDS = frozenset(
    {"name", "ordinal", "role", "d_l", "dispersion", "interval", "bytes_down", "bytes_up", "version"}
)
_TRANSFER_FIELDS = frozenset({"client_id", "direction", "bytes"})


# --------------------------------------------------------------------------- transfers


def record_transfer(
    session: Session,
    fed: Federation,
    round: int,
    client_id: str,
    direction: str,
    nbytes: int,
    per_tensor: Mapping[str, int] | None = None,
    fedavg_equivalent_bytes: int = 0,
) -> None:
    """Add ``nbytes`` to the client's transfer row for (round, category) and to its lifetime counters.

    ``direction`` is a category (``train_fetch``, ``eval_fetch``, ``push``) or a bare direction
    (``down``: a training fetch, ``up``: a push); ``fedavg_equivalent_bytes`` is added to the row's.

    An atomic ``INSERT … ON CONFLICT DO UPDATE SET bytes = bytes + …``, so replicas serving
    fetches at the same time never lose an increment. Call it as bytes move (FetchModel,
    PushUpdate), or pass the round's totals to :func:`close_round`. ``per_tensor`` (full-rank
    tensor name → bytes) is added to the round's ``tensor_metrics`` rows the same way.
    """
    record_transfers(session, fed, [(round, client_id, direction, nbytes, per_tensor or {}, fedavg_equivalent_bytes)])


def transfer_category(kind: str) -> str:
    """A category of :data:`TRANSFER_CATEGORIES`, or a bare direction: ``down`` → ``train_fetch``, ``up`` → ``push``."""
    category = {"down": "train_fetch", "up": "push"}.get(kind, kind)
    if category not in TRANSFER_CATEGORIES:
        raise ValueError(f"direction must be 'down', 'up' or one of {', '.join(TRANSFER_CATEGORIES)}; got {kind!r}")
    return category


def record_transfers(
    session: Session,
    fed: Federation,
    transfers: Iterable[tuple[Any, ...]],
    *,
    pruned_through: int | None = None,
) -> None:
    """:func:`record_transfer` for many ``(round, client id, category, bytes, per_tensor[, fedavg_equivalent_bytes])``.

    A few statements in all, each run with many parameter sets, however many transfers: the
    service counts bytes in memory and writes them here about once a second. Each round's sums
    per category (``round_bytes``) are added first (their rows are the ones every writer shares,
    so taking them first keeps concurrent writers in one lock order), then the clients' counters,
    and, for rounds whose history is kept (:func:`prune_history`), the per-client and per-tensor rows.

    ``pruned_through`` is ``federations.history_pruned_through`` as the caller knows it: the
    coordinator keeps it in memory (only its closes move it), so its writes read nothing; without
    it, it is read in ``session``.
    """
    if pruned_through is None:
        pruned_through = session.scalar(select(Federation.history_pruned_through).where(Federation.id == fed.id))
    pruned = int(pruned_through or 0)
    moves: list[dict[str, Any]] = []
    per_tensor_totals: dict[tuple[int, str, str], int] = {}
    per_client: dict[tuple[str, str], int] = {}
    for round, client_id, kind, nbytes, per_tensor, *rest in transfers:
        category = transfer_category(kind)
        direction = TRANSFER_CATEGORIES[category]
        nbytes = _count(nbytes, "bytes")
        fedavg = _count(rest[0] if rest else 0, "fedavg_equivalent_bytes")
        for n, b in per_tensor.items():
            key = (round, n, direction)
            per_tensor_totals[key] = per_tensor_totals.get(key, 0) + _count(b, f"bytes of {n!r}")
        moves.append(
            {
                "federation_id": fed.id,
                "round": round,
                "client_id": client_id,
                "category": category,
                "direction": direction,
                "bytes": nbytes,
                "fedavg_equivalent_bytes": fedavg,
            }
        )
        per_client[(client_id, direction)] = per_client.get((client_id, direction), 0) + nbytes
    counted = ("bytes", "fedavg_equivalent_bytes")
    per_round: dict[tuple[int, str], list[int]] = {}
    for m in moves:
        sums = per_round.setdefault((m["round"], m["category"]), [0, 0])
        sums[0] += m["bytes"]
        sums[1] += m["fedavg_equivalent_bytes"]
    if per_round:
        rollup = [
            {"federation_id": fed.id, "round": r, "category": c, "bytes": b, "fedavg_equivalent_bytes": f}
            for (r, c), (b, f) in sorted(per_round.items())
        ]
        _add(session, RoundBytes.__table__, ("federation_id", "round", "category"), counted, rollup)
    for direction in TRANSFER_DIRECTIONS:
        column = f"bytes_{direction}"
        rows = [
            {"federation_id": fed.id, "round": r, "name": n, column: b}
            for (r, n, d), b in sorted(per_tensor_totals.items())
            if d == direction and r > pruned
        ]
        if rows:
            _add(session, TensorMetric.__table__, ("federation_id", "round", "name"), column, rows)
        clients = [{"cid": c, "n": b} for (c, d), b in sorted(per_client.items()) if d == direction]
        if clients:
            table = Client.__table__
            session.connection().execute(
                update(table)  # type: ignore[arg-type]  # a Table at runtime
                .where(table.c.id == bindparam("cid"))
                .values({column: table.c[column] + bindparam("n")}),
                clients,
            )
            _expire_loaded(session, Client, {str(c["cid"]) for c in clients}, column)
    kept = [m for m in moves if m["round"] > pruned]
    if kept:
        _add(session, Transfer.__table__, ("federation_id", "round", "client_id", "category"), counted, kept)


def _expire_loaded(session: Session, model: type[Any], ids: set[str], column: str) -> None:
    """Core statements bypass the session: clients it has loaded reload ``column`` on next access."""
    for obj in list(session.identity_map.values()):
        if isinstance(obj, model) and obj.id in ids:
            session.expire(obj, [column])


def _add(
    session: Session, table: Any, keys: tuple[str, ...], column: str | tuple[str, ...], rows: list[dict[str, Any]]
) -> None:
    """``INSERT … ON CONFLICT (keys) DO UPDATE SET column = column + excluded.column`` for every row.

    One Core statement run with many parameter sets: it compiles once per process (statement
    cache) instead of once per call, which a multi-row VALUES or the ORM's bulk path would not.
    """
    ins = _upsert(session)(table)
    columns = (column,) if isinstance(column, str) else column
    stmt = ins.on_conflict_do_update(index_elements=list(keys), set_={c: table.c[c] + ins.excluded[c] for c in columns})
    session.connection().execute(stmt, rows)


def round_transfers(session: Session, fed: Federation, round: int) -> list[Transfer]:
    return list(
        session.scalars(
            select(Transfer)
            .where(Transfer.federation_id == fed.id, Transfer.round == round)
            .order_by(Transfer.client_id, Transfer.direction, Transfer.category)
        )
    )


# --------------------------------------------------------------------------- closing a round


def _check_round_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(metrics) - ROUND_METRIC_FIELDS
    if unknown:
        raise ValueError(f"unknown round metrics {sorted(unknown)}; known: {sorted(ROUND_METRIC_FIELDS)}")
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key == "extra":
            out[key] = _json(value, "round_metrics['extra']")
        elif key in ("latent_clients", "bytes_up", "bytes_down", "fedavg_equivalent_bytes"):
            out[key] = None if value is None else _count(value, key)
        else:
            out[key] = _finite(value, key)
    return out


def _check_tensor_metrics(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        unknown = set(row) - TENSOR_METRIC_FIELDS
        if unknown or "name" not in row:
            raise ValueError(f"tensor_metrics[{i}]: needs 'name', unknown keys {sorted(unknown)}")
        if row["name"] in seen:
            raise ValueError(f"tensor_metrics[{i}]: tensor {row['name']!r} listed twice")
        seen.add(row["name"])
        clean: dict[str, Any] = {"ordinal": i, **row}
        for key in ("d_l", "dispersion"):
            if key in clean:
                clean[key] = _finite(clean[key], f"tensor_metrics[{i}].{key}")
        for key in ("bytes_down", "bytes_up"):
            if key in clean:
                clean[key] = _count(clean[key], f"tensor_metrics[{i}].{key}")
        out.append(clean)
    return out


def _check_transfers(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    totals: dict[tuple[str, str], int] = {}
    for i, row in enumerate(rows):
        if set(row) != _TRANSFER_FIELDS:
            raise ValueError(f"transfers[{i}] must have exactly the keys {sorted(_TRANSFER_FIELDS)}, got {sorted(row)}")
        if row["direction"] not in TRANSFER_DIRECTIONS:
            raise ValueError(f"transfers[{i}]: direction must be 'down' or 'up', got {row['direction']!r}")
        key = (str(row["client_id"]), str(row["direction"]))
        totals[key] = totals.get(key, 0) + _count(row["bytes"], f"transfers[{i}].bytes")
    return totals


def close_round(
    session: Session,
    fed: Federation,
    round_number: int,
    *,
    new_tensors: Mapping[str, tuple[Any, int, int]],
    intervals: Mapping[str, int],
    round_metrics: Mapping[str, Any],
    tensor_metrics: Sequence[Mapping[str, Any]],
    transfers: Sequence[Mapping[str, Any]],
    strategy_state: Mapping[str, Any],
    policy_state: Mapping[str, Any],
    strategy_tensors: Mapping[str, Any],
    next_round: int | None,
    strategy_tensor_kind: str = SERVER_CONTROL,
    now: datetime | None = None,
) -> Round:
    """Write everything a round's close produced, in the caller's transaction; commit or roll back as one.

    In order: new global tensors (name → (array, version, interval)); ``intervals`` (name →
    τ in force from the next round; every name must be a global tensor); strategy tensors;
    the round's reporting counts (``reported``, ``stragglers``, each reporter's
    ``rounds_joined``); the consumed updates' tensors deleted (their headers kept until the next close,
    :func:`consume_round_updates`); the round marked closed; one
    ``round_metrics`` row (keys from :data:`ROUND_METRIC_FIELDS`; ``duration_seconds``
    defaults to close − open, ``bytes_up``/``bytes_down``/``fedavg_equivalent_bytes`` to the round's
    transfer totals at the close);
    ``tensor_metrics`` rows (keys from :data:`TENSOR_METRIC_FIELDS`, ``ordinal`` defaults to
    the list position); ``transfers`` (dicts ``client_id``, ``direction``, ``bytes``, added
    to what :func:`record_transfer` already counted); the engine's JSON state and
    ``current_round = next_round`` — or, with ``next_round=None``, the federation marked done.

    Inputs are validated before the first write; a failure after it (a constraint, a crash)
    leaves the caller's transaction to roll back, and with it every write above.
    """
    # -- validate everything that can be validated without writing
    metrics_row = _check_round_metrics(round_metrics)
    tm_rows = _check_tensor_metrics(tensor_metrics)
    transfer_totals = _check_transfers(transfers)
    _json(dict(strategy_state), "strategy_state")
    _json(dict(policy_state), "policy_state")
    if next_round is not None and next_round <= round_number:
        raise ValueError(f"next_round {next_round} must come after round {round_number}")
    known = set(tensor_versions(session, fed)) | set(new_tensors)
    unknown = sorted(set(intervals) - known)
    if unknown:
        raise ValueError(f"intervals for tensors that are not global tensors: {unknown[:5]}")
    clean_intervals = {n: _count(t, f"interval of {n!r}", 1) for n, t in intervals.items()}
    t = _now(now)
    row = _attached(session, fed)
    rnd = _open(session, row, round_number)

    # -- the global model and the strategy's tensors
    save_global_tensors(session, row, new_tensors)
    _set_intervals(session, row, clean_intervals)
    save_strategy_tensors(session, row, strategy_tensors, kind=strategy_tensor_kind)

    # -- who reported; consume their updates
    reporters = reported_clients(session, row, round_number)
    if reporters:
        session.execute(update(Client).where(Client.id.in_(reporters)).values(rounds_joined=Client.rounds_joined + 1))
    consume_round_updates(session, row, round_number)
    rnd.reported = len(reporters)
    rnd.stragglers = len(set(rnd.cohort) - set(reporters))
    rnd.state = "closed"
    rnd.closed_at = t
    session.flush()

    # -- bandwidth, then the metrics that summarize it
    for (client_id, direction), nbytes in transfer_totals.items():
        record_transfer(session, row, round_number, client_id, direction, nbytes)
    # (a snapshot at the close: evaluation fetches come later; the dashboard sums ``round_bytes`` instead)
    totals = {"down": 0, "up": 0, "fedavg": 0}
    for category, b, f in session.execute(
        select(RoundBytes.category, RoundBytes.bytes, RoundBytes.fedavg_equivalent_bytes).where(
            RoundBytes.federation_id == row.id, RoundBytes.round == round_number
        )
    ).all():
        totals[TRANSFER_CATEGORIES[category]] += int(b)
        totals["fedavg"] += int(f)
    metrics_row.setdefault("bytes_up", totals["up"])
    metrics_row.setdefault("bytes_down", totals["down"])
    metrics_row.setdefault("fedavg_equivalent_bytes", totals["fedavg"])
    metrics_row.setdefault("duration_seconds", (t - rnd.opened_at).total_seconds())
    session.add(RoundMetrics(federation_id=row.id, round=round_number, **metrics_row))
    session.flush()
    for r in tm_rows:  # bytes already counted by record_transfer add up; everything else is set
        tm = _upsert(session)(TensorMetric).values(federation_id=row.id, round=round_number, **r)
        set_ = {k: getattr(tm.excluded, k) for k in r if k not in ("name", "bytes_down", "bytes_up")}
        for k in ("bytes_down", "bytes_up"):
            if k in r:
                set_[k] = getattr(TensorMetric, k) + getattr(tm.excluded, k)
        session.execute(tm.on_conflict_do_update(index_elements=["federation_id", "round", "name"], set_=set_))

    # -- the engine's state, and what comes next
    row.strategy_state = dict(strategy_state)
    row.policy_state = dict(policy_state)
    if next_round is None:
        row.state = "done"
    else:
        row.current_round = next_round
    session.flush()
    return rnd
