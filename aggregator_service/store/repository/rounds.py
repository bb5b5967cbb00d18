"""Rounds (open, lock, extend, abandon) and the client updates stored for them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import bindparam, delete, func, insert, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..models import Client, Federation, Round, Update, UpdateTensor
from ._common import (
    NotFound,
    NotInCohort,
    RoundStateError,
    UpdateConflict,
    _attached,
    _aware,
    _count,
    _decode,
    _encode,
    _finite,
    _now,
)

__all__ = [
    "abandon_round",
    "consume_round_updates",
    "count_updates",
    "delete_round_updates",
    "extend_round",
    "get_open_round",
    "get_round",
    "iter_round_updates",
    "lock_round",
    "open_round",
    "refuse_late_push",
    "reported_clients",
    "store_update",
]


# --------------------------------------------------------------------------- rounds


def open_round(
    session: Session,
    fed: Federation,
    number: int,
    cohort: Sequence[str],
    due: Sequence[str],
    continue_unsynced: bool,
    deadline: datetime,
    *,
    now: datetime | None = None,
) -> Round:
    """Open round ``number`` (greater than every earlier round); the federation's ``current_round`` follows.

    Raises :class:`RoundStateError` when a round is already open or ``number`` is not new; the
    partial unique index ``uq_rounds_one_open`` enforces the first across replicas as well.
    """
    number = _count(number, "round number", 1)
    if not cohort:
        raise ValueError(f"round {number}: the cohort is empty")
    row = _attached(session, fed)
    if row.state != "running":
        raise RoundStateError(f"federation {row.name!r} is {row.state}, not running: no round can open")
    current = get_open_round(session, row)
    if current is not None:
        raise RoundStateError(f"round {current.number} is still open; close or abandon it first")
    last = session.scalar(select(func.max(Round.number)).where(Round.federation_id == row.id))
    if last is not None and number <= last:
        raise RoundStateError(f"round {number} is not new: rounds up to {last} exist")
    rnd = Round(
        federation_id=row.id,
        number=number,
        state="open",
        cohort=[str(c) for c in cohort],
        due=[str(d) for d in due],
        continue_unsynced=bool(continue_unsynced),
        deadline=_aware(deadline, "deadline"),
        extended=False,
        opened_at=_now(now),
        reported=0,
        stragglers=0,
    )
    session.add(rnd)
    row.current_round = number
    session.flush()
    return rnd


def get_round(session: Session, fed: Federation, number: int) -> Round | None:
    return session.get(Round, (fed.id, number))


def get_open_round(session: Session, fed: Federation) -> Round | None:
    return session.scalar(select(Round).where(Round.federation_id == fed.id, Round.state == "open"))


def lock_round(session: Session, fed: Federation, number: int, *, shared: bool = False) -> Round:
    """Round ``number`` under a row lock until the transaction ends (``FOR UPDATE``, or ``FOR SHARE``).

    The coordinator calls it before reading the round's updates; :func:`close_round` calls it
    again (a no-op then). SQLite has no row locks: ``BEGIN IMMEDIATE`` already serializes.
    """
    rnd = session.scalar(
        select(Round)
        .where(Round.federation_id == fed.id, Round.number == number)
        .with_for_update(read=shared)
        .execution_options(populate_existing=True)
    )
    if rnd is None:
        raise NotFound(f"federation {fed.name!r} has no round {number}")
    return rnd


def _open(session: Session, fed: Federation, number: int, *, shared: bool = False) -> Round:
    rnd = lock_round(session, fed, number, shared=shared)
    if rnd.state != "open":
        raise RoundStateError(f"round {number} is {rnd.state}")
    return rnd


def extend_round(session: Session, fed: Federation, number: int, deadline: datetime) -> Round:
    """Move an open round's deadline (e.g. quorum not met yet) and mark it extended."""
    rnd = _open(session, fed, number)
    rnd.deadline = _aware(deadline, "deadline")
    rnd.extended = True
    session.flush()
    return rnd


def abandon_round(session: Session, fed: Federation, number: int, *, now: datetime | None = None) -> Round:
    """Give up an open round (no quorum by the final deadline): its updates are deleted, nothing is aggregated."""
    rnd = _open(session, fed, number)
    reporters = reported_clients(session, fed, number)
    rnd.reported = len(reporters)
    rnd.stragglers = len(set(rnd.cohort) - set(reporters))
    delete_round_updates(session, fed, number)
    rnd.state = "abandoned"
    rnd.closed_at = _now(now)
    session.flush()
    return rnd


# --------------------------------------------------------------------------- updates


# Statements every push runs, built once (see ``_common.prebuilt``).
_U, _R = Update.__table__, Round.__table__
_UPDATE_OR_SLOT = select(_U.c.id, _U.c.update_id, _U.c.round).where(
    _U.c.federation_id == bindparam("fed"),
    _U.c.client_id == bindparam("client_id"),
    or_(_U.c.update_id == bindparam("update_id"), _U.c.round == bindparam("round")),
)
_ROUND_FOR_SHARE = (
    select(_R.c.state, _R.c.cohort_json)
    .where(_R.c.federation_id == bindparam("fed"), _R.c.number == bindparam("number"))
    .with_for_update(read=True)
)
_INSERT_UPDATE = insert(_U).returning(_U.c.id)  # type: ignore[arg-type]  # a Table at runtime
_INSERT_UPDATE_TENSOR = insert(UpdateTensor.__table__)  # type: ignore[arg-type]
_INSERT_UPDATE_TENSOR_SPACE = _INSERT_UPDATE_TENSOR.values(data=func.zeroblob(bindparam("nbytes")))
# SQLite: tensors this large are written into their row's pages through a blob handle
# (_write_in_place); smaller ones are bound as parameters, a few to a statement
IN_PLACE_BYTES = 1 << 20


def _write_in_place(conn: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert SQLite rows with room for their ``data`` (``zeroblob``), then copy each array in.

    Bound as a parameter, a blob is copied twice more inside SQLite (the statement keeps its
    own copy, then builds the row's record), into fresh allocations that, for tensors of
    megabytes, are fresh pages faulted in for every update; writing through a blob handle
    copies each array once into the row's own pages.
    """
    raw = conn.connection.driver_connection  # the sqlite3 connection, inside this transaction
    table = UpdateTensor.__tablename__
    for row in rows:
        data = row["data"]
        params = {k: v for k, v in row.items() if k != "data"}
        rowid = conn.execute(_INSERT_UPDATE_TENSOR_SPACE, {**params, "nbytes": len(data)}).lastrowid
        with raw.blobopen(table, "data", rowid) as blob:
            blob.write(data)


def _duplicate_or_conflict(
    session: Session, fed: Federation, round: int, client_id: str, update_id: str
) -> tuple[Update, bool] | None:
    """``(stored update, True)`` for a retry of ``update_id``; ``None`` when the update is new.

    One Core read finds both this client's earlier use of ``update_id`` and its other update for this
    round (both unique): a push runs this on every client's critical path. The key is the client's own
    (``PushHeader.update_id`` is scoped to the client): another client's use of it is no concern of this push.
    """
    hits = session.connection().execute(
        _UPDATE_OR_SLOT, {"fed": fed.id, "update_id": update_id, "round": round, "client_id": client_id}
    )
    for pk, uid, rnd in hits.all():
        if uid != update_id:
            raise UpdateConflict(
                f"client {client_id} already pushed update {uid!r} for round {round}; one update per round; "
                "a retry must reuse the original update_id"
            )
        if rnd != round:
            raise UpdateConflict(
                f"update_id {update_id!r} was already used for this client's update of round {rnd}; a new update "
                "takes a new update_id"
            )
        existing = session.get(Update, pk)
        assert existing is not None
        return existing, True
    return None


def retried_update(session: Session, fed: Federation, round: int, client_id: str, update_id: str) -> Update | None:
    """The stored update a push of ``update_id`` by ``client_id`` for ``round`` repeats, else ``None`` (also when
    ``update_id`` belongs to another round: that push is no retry)."""
    try:
        found = _duplicate_or_conflict(session, fed, round, client_id, update_id)
    except UpdateConflict:
        return None
    return None if found is None else found[0]


def _check_open_member(session: Session, fed: Federation, number: int, client_id: str) -> None:
    """Round ``number`` is open and ``client_id`` in its cohort, read ``FOR SHARE`` (a concurrent close waits)."""
    row = session.connection().execute(_ROUND_FOR_SHARE, {"fed": fed.id, "number": number}).first()
    if row is None:
        raise NotFound(f"federation {fed.name!r} has no round {number}")
    if row.state != "open":
        raise RoundStateError(f"round {number} is {row.state}")
    if client_id not in row.cohort_json:
        raise NotInCohort(f"client {client_id} is not in round {number}'s cohort")


def store_update(
    session: Session,
    fed: Federation,
    round: int,
    client_id: str,
    update_id: str,
    num_samples: int,
    metrics: Mapping[str, float],
    tensors: Mapping[str, Any],
    control_delta: Mapping[str, Any] | None = None,
    *,
    finite: bool = False,
    move_scale: float | None = None,
    now: datetime | None = None,
) -> tuple[Update, bool]:
    """Store one client's update for an open round; ``(update header, duplicate)``.

    Idempotent on ``update_id``: a retry returns the stored update with ``duplicate=True`` and
    writes nothing (also when two copies race on PostgreSQL: the loser's unique-constraint
    violation is rolled back to a SAVEPOINT and the winner's row returned; a SQLite transaction
    holds the write lock from ``BEGIN IMMEDIATE``, so no copy can land between the check and the
    insert, and a savepoint would only journal pages). The acknowledgement may be sent
    once the caller's transaction has committed. A new update is written with Core statements
    (a push is on every client's critical path); its header is returned detached from the session.

    Raises :class:`RoundStateError` (round not open), :class:`NotFound` (no such round),
    :class:`NotInCohort`, :class:`UpdateConflict` (a different update of this client for this
    round, or its update_id reused for another round), :class:`~fedcore.codec.CodecError` (NaN/Inf,
    unsupported dtype) and :class:`ValueError` (bad counts or metrics). Names and shapes are
    the caller's to validate against the client's tier spec. ``finite=True``: the caller has already
    refused NaN and Inf (:func:`aggregator_service.validation.check_tensors`), so the arrays are not
    scanned again. ``move_scale``: what the push was told the fold scales its move by (kept with the header).
    """
    if not update_id or len(update_id) > 128:
        raise ValueError(f"update_id must have 1 to 128 characters, got {len(update_id or '')}")
    num_samples = _count(num_samples, "num_samples", 1)
    clean_metrics = {str(k): _finite(v, f"metric {k!r}") for k, v in metrics.items()}

    found = _duplicate_or_conflict(session, fed, round, client_id, update_id)
    if found is not None:
        return found
    _check_open_member(session, fed, round, client_id)

    from fedcore.codec import DTYPES, CodecError, all_finite

    wire_names = {dt: wire for wire, dt in DTYPES.items()}

    def blob(name: str, array: Any) -> tuple[str, tuple[int, ...], bytes | memoryview]:
        """dtype, shape, bytes: a C-contiguous little-endian array is bound in place (no 45 MB ``tobytes`` copy)."""
        wire = wire_names.get(array.dtype) if isinstance(array, np.ndarray) and array.size else None
        if wire is not None and array.ndim and array.flags.c_contiguous:
            if not finite and not all_finite(array):
                raise CodecError(name, "contains NaN or Inf values", "nonfinite")
            return wire, tuple(int(d) for d in array.shape), memoryview(array).cast("B")
        enc = _encode(name, array)
        return enc.dtype, enc.shape, enc.data

    rows = [("model", n, blob(n, a)) for n, a in tensors.items()]
    rows += [("control_delta", n, blob(n, a)) for n, a in (control_delta or {}).items()]
    header = {
        "federation_id": fed.id,
        "round": round,
        "client_id": client_id,
        "update_id": update_id,
        "num_samples": num_samples,
        "metrics": clean_metrics,
        "received_at": _now(now),
        "move_scale": move_scale,
    }
    racing = session.get_bind().dialect.name != "sqlite"
    try:
        with session.begin_nested() if racing else contextlib.nullcontext():
            conn = session.connection()  # inside begin_nested: acquiring it emits the SAVEPOINT
            pk = conn.execute(_INSERT_UPDATE, {k if k != "metrics" else "metrics_json": v for k, v in header.items()})
            pk = pk.scalar_one()
            params = [
                {"update_pk": pk, "kind": kind, "name": name, "dtype": dtype, "shape_json": list(shape), "data": data}
                for kind, name, (dtype, shape, data) in rows
            ]
            bound = [p for p in params if racing or len(p["data"]) < IN_PLACE_BYTES]
            in_place = [p for p in params if not racing and len(p["data"]) >= IN_PLACE_BYTES]
            if bound:
                conn.execute(_INSERT_UPDATE_TENSOR, bound)
            if in_place:
                _write_in_place(conn, in_place)
    except IntegrityError:
        if not racing:
            raise
        # Another transaction stored the same update_id (or this client's update) in between.
        found = _duplicate_or_conflict(session, fed, round, client_id, update_id)
        if found is None:
            raise
        return found
    return Update(id=pk, **header), False


class StoredTensors(Mapping[str, np.ndarray]):
    """One stored update's tensors of one kind, each read and decoded when looked up and never kept.

    A close folds a resnet18-sized update module by module through this mapping, so it holds one
    layer of the update besides its running means, not the whole update. ``shapes`` answers without
    reading a tensor. Valid while the session that :func:`iter_round_updates` read from is open.
    """

    def __init__(self, conn: Any, pk: int, kind: str, meta: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self._conn, self._pk, self._kind, self._meta = conn, pk, kind, meta
        self.shapes = {name: shape for name, (_, shape) in meta.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape = self._meta[name]
        data = self._conn.execute(_ONE_TENSOR, {"pk": self._pk, "kind": self._kind, "name": name}).scalar_one()
        return _decode(name, dtype, shape, data)

    def __contains__(self, name: object) -> bool:
        return name in self._meta  # Mapping's default looks the tensor up: a blob read for a membership test

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


_T = UpdateTensor.__table__
_ONE_TENSOR = select(_T.c.data).where(
    _T.c.update_pk == bindparam("pk"), _T.c.kind == bindparam("kind"), _T.c.name == bindparam("name")
)


def iter_round_updates(
    session: Session,
    fed: Federation,
    round: int,
    *,
    lazy: bool = False,
) -> Iterator[tuple[Update, Mapping[str, np.ndarray], Mapping[str, np.ndarray] | None]]:
    """The round's updates one by one, in registration order: ``(header, tensors, control_delta or None)``.

    Only the headers are read up front (detached from the session); each update's blobs are
    fetched when it is reached, so memory stays O(one update) however many clients reported.
    ``lazy=True`` yields :class:`StoredTensors` instead of dicts: a tensor is read when it is looked
    up, so a reader that takes one module at a time holds O(one layer).
    """
    u, c, t = Update.__table__, Client.__table__, _T
    conn = session.connection()  # Core reads: a close reads every update of the round
    fields = (
        "id",
        "federation_id",
        "round",
        "client_id",
        "update_id",
        "num_samples",
        "metrics",
        "received_at",
        "move_scale",
    )
    headers = conn.execute(
        select(*(u.c[f if f != "metrics" else "metrics_json"] for f in fields))
        .join(c, c.c.id == u.c.client_id)
        .where(u.c.federation_id == fed.id, u.c.round == round)
        .order_by(c.c.number)
    ).all()
    columns = (t.c.kind, t.c.name, t.c.dtype, t.c.shape_json)
    blobs = select(*columns, t.c.data).where(t.c.update_pk == bindparam("pk")).order_by(t.c.kind, t.c.name)
    headings = select(*columns).where(t.c.update_pk == bindparam("pk")).order_by(t.c.kind, t.c.name)
    for row in headers:
        header = Update(**dict(zip(fields, row, strict=True)))
        if lazy:
            meta: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
            for kind, name, dtype, shape in conn.execute(headings, {"pk": row.id}):
                meta.setdefault(kind, {})[name] = (dtype, tuple(shape))
            control = next((k for k in meta if k != "model"), None)
            yield (
                header,
                StoredTensors(conn, row.id, "model", meta.get("model", {})),
                None if control is None else StoredTensors(conn, row.id, control, meta[control]),
            )
            continue
        model: dict[str, np.ndarray] = {}
        deltas: dict[str, np.ndarray] = {}
        for kind, name, dtype, shape, data in conn.execute(blobs, {"pk": row.id}):
            (model if kind == "model" else deltas)[name] = _decode(name, dtype, shape, data)
        yield header, model, (deltas or None)


def count_updates(session: Session, fed: Federation, round: int) -> int:
    q = select(func.count()).select_from(Update).where(Update.federation_id == fed.id, Update.round == round)
    return int(session.scalar(q) or 0)


def reported_clients(session: Session, fed: Federation, round: int) -> list[str]:
    """Ids of the clients with a stored update for ``round``, sorted."""
    return list(
        session.scalars(
            select(Update.client_id)
            .where(Update.federation_id == fed.id, Update.round == round)
            .order_by(Update.client_id)
        )
    )


def _delete_round_tensors(session: Session, fed: Federation, round: int) -> None:
    ids = select(Update.id).where(Update.federation_id == fed.id, Update.round == round)
    session.execute(
        delete(UpdateTensor).where(UpdateTensor.update_pk.in_(ids)).execution_options(synchronize_session=False)
    )


def consume_round_updates(session: Session, fed: Federation, round: int) -> None:
    """What a close does to the updates it folded: their tensors go, their headers stay until the next close.

    A client whose acknowledgement was lost retries with the same ``update_id``; if its update
    was the one that completed the cohort, the round has closed by then, and the header left
    here lets :func:`refuse_late_push` answer it as a duplicate instead of a refusal. Headers of
    earlier rounds are deleted, so the table holds at most one closed round's headers.
    """
    _delete_round_tensors(session, fed, round)
    session.execute(
        delete(Update)
        .where(Update.federation_id == fed.id, Update.round < round)
        .execution_options(synchronize_session=False)
    )


def refuse_late_push(session: Session, fed: Federation, round: int, client_id: str, update_id: str) -> Update | None:
    """A push for ``round``, which is not open: the consumed update it repeats, else ``None`` once it is counted.

    ``round``'s ``late_pushes`` counts the push when that round has closed or was abandoned and
    ``client_id`` was in its cohort (a straggler); a round not open yet, or another client's,
    counts nothing. A retry of an update that ``round`` consumed (same ``update_id``, client and
    round, its header kept by :func:`consume_round_updates`) counts nothing either.
    """
    try:
        rnd = lock_round(session, fed, round)
    except NotFound:
        return None
    if rnd.state == "closed":
        consumed = session.scalar(
            select(Update).where(
                Update.federation_id == fed.id,
                Update.update_id == update_id,
                Update.client_id == client_id,
                Update.round == round,
            )
        )
        if consumed is not None:
            return consumed
    if rnd.state in ("closed", "abandoned") and client_id in rnd.cohort:
        rnd.late_pushes += 1
        session.flush()
    return None


def delete_round_updates(session: Session, fed: Federation, round: int) -> int:
    """Delete a round's updates and their tensors; returns how many updates went."""
    _delete_round_tensors(session, fed, round)
    result = session.execute(
        delete(Update)
        .where(Update.federation_id == fed.id, Update.round == round)
        .execution_options(synchronize_session="fetch")
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
