"""Read-only SQL over the aggregator's store, shaped for the dashboard.

Every list is paged and filtered in SQL and every total is aggregated in SQL, so a request
costs the same with 10 rounds or 10,000: no function here loads a whole table into Python.
Nothing here writes; the two writes the dashboard makes go through the store's own functions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Float, Integer, Select, and_, case, cast, func, literal, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from aggregator_service import store

__all__ = [
    "bandwidth",
    "client_detail",
    "client_item",
    "client_page",
    "evaluation_means",
    "federation_summary",
    "intervals",
    "metrics_snapshot",
    "participation",
    "round_detail",
    "round_page",
]

ClientStatus = Literal["online", "offline", "revoked"]
Order = Literal["asc", "desc"]


def _rows(result: Any) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in result]


# --------------------------------------------------------------------------- federation


def _last_closed(session: Session, fed_id: int) -> int:
    q = select(func.max(store.Round.number)).where(store.Round.federation_id == fed_id, store.Round.state == "closed")
    return int(session.scalar(q) or 0)


def _client_totals(session: Session, fed_id: int, online_since: datetime) -> dict[str, int]:
    """Client counts in one scan of the federation's clients."""
    c = store.Client
    active = c.revoked_at.is_(None)
    row = session.execute(
        select(
            func.count().filter(active).label("registered"),
            func.count().filter(~active).label("revoked"),
            func.count().filter(active, c.last_seen >= online_since).label("online"),
        ).where(c.federation_id == fed_id)
    ).one()
    return {k: int(v) for k, v in row._mapping.items()}


def federation_summary(session: Session, fed: store.Federation, online_since: datetime) -> dict[str, Any]:
    open_round = session.scalar(
        select(store.Round.number).where(store.Round.federation_id == fed.id, store.Round.state == "open")
    )
    last_closed = _last_closed(session, fed.id)
    counts = _client_totals(session, fed.id, online_since)
    config = dict(fed.config or {})
    return {
        "name": fed.name,
        "state": fed.state,
        "current_round": open_round if open_round is not None else last_closed,
        "open_round": open_round,
        "last_closed_round": last_closed,
        "rounds_planned": config.get("rounds"),
        "clients_registered": counts["registered"],
        "clients_revoked": counts["revoked"],
        "clients_online": counts["online"],
        "config": config,
        "created_at": fed.created_at,
        "updated_at": fed.updated_at,
    }


# --------------------------------------------------------------------------- rounds


@dataclass(frozen=True)
class RoundFilters:
    state: str | None = None
    after: int | None = None
    before: int | None = None


def _round_where(fed_id: int, f: RoundFilters) -> list[Any]:
    where: list[Any] = [store.Round.federation_id == fed_id]
    if f.state is not None:
        where.append(store.Round.state == f.state)
    if f.after is not None:
        where.append(store.Round.number > f.after)
    if f.before is not None:
        where.append(store.Round.number < f.before)
    return where


def _weighted_mean(column: Any) -> Any:
    """Σ v·n / Σ n over reports that have ``v``; the plain mean where none gave ``num_samples``.

    The same rule as :func:`store.evaluation_summary`, computed by the database.
    """
    e = store.Evaluation
    weight = func.sum(case((column.is_not(None), e.num_samples), else_=0))
    return case(
        (weight > 0, cast(func.sum(column * e.num_samples), Float) / cast(weight, Float)),
        else_=cast(func.avg(column), Float),
    )


def evaluation_means(session: Session, fed_id: int, rounds: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Per round: how many clients evaluated it and their weighted mean accuracies and loss."""
    if not rounds:
        return {}
    e = store.Evaluation
    result = session.execute(
        select(
            e.round,
            func.count().label("clients"),
            _weighted_mean(e.global_accuracy).label("mean_client_accuracy"),
            _weighted_mean(e.global_loss).label("mean_client_loss"),
            _weighted_mean(e.personalized_accuracy).label("personalized_accuracy"),
        )
        .where(e.federation_id == fed_id, e.round.in_(list(rounds)))
        .group_by(e.round)
    )
    return {int(r.round): {k: v for k, v in r._mapping.items() if k != "round"} for r in result}


class _json_array_length(FunctionElement[int]):
    """How many items a JSON array kept in a TEXT column holds, counted by the database."""

    type = Integer()
    inherit_cache = True


@compiles(_json_array_length)
def _json_array_length_sql(element: _json_array_length, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_array_length({compiler.process(element.clauses, **kw)})"  # SQLite's JSON1


@compiles(_json_array_length, "postgresql")
def _json_array_length_pg(element: _json_array_length, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_array_length(CAST({compiler.process(element.clauses, **kw)} AS json))"


#: the clients a round counted, as REST shows them per round and /metrics sums them over rounds: one definition
PARTICIPATION = ("cohort_size", "reported", "stragglers")


def participation() -> list[Any]:
    """A round's cohort size, the clients whose update it kept (``reported``) and the rest of its cohort
    (``stragglers``, set when it closes or is abandoned): the columns ``/rounds`` shows and ``/metrics`` sums. They
    live in ``rounds``, which ``history_rounds`` never prunes, so sums over finished rounds never decrease."""
    r = store.Round
    return [_json_array_length(r.cohort).label("cohort_size"), r.reported, r.stragglers]


def participation_totals(session: Session, fed_id: int) -> dict[str, dict[str, int]]:
    """:func:`participation` summed over the closed and over the abandoned rounds (they change no more)."""
    r = store.Round
    per_state = {state: dict.fromkeys(PARTICIPATION, 0) for state in ("closed", "abandoned")}
    columns = participation()
    rows = session.execute(
        select(r.state, *(func.coalesce(func.sum(c), 0) for c in columns))
        .where(r.federation_id == fed_id, r.state.in_(list(per_state)))
        .group_by(r.state)
    )
    for state, *sums in rows:
        per_state[state] = {k: int(v) for k, v in zip(PARTICIPATION, sums, strict=True)}
    return per_state


def _round_select(fed_id: int, rounds: Sequence[int]) -> Select[Any]:
    """``rounds`` with their metrics row and their bytes from ``round_bytes``, the sums ``/bandwidth`` reads
    too (the metrics row's byte columns are a snapshot at close, before the round's evaluation fetches)."""
    r, m = store.Round, store.RoundMetrics
    moved = _round_byte_sums(fed_id, rounds)
    return (
        select(r, m, moved, *participation())
        .outerjoin(m, and_(m.federation_id == r.federation_id, m.round == r.number))
        .outerjoin(moved, moved.c.round == r.number)
        .where(r.federation_id == fed_id, r.number.in_(list(rounds)))
    )


def _round_dict(row: Any, evals: dict[str, Any] | None) -> dict[str, Any]:
    rnd, m = row[0], row[1]
    evals = evals or {}
    mean_acc = evals.get("mean_client_accuracy")
    personal = evals.get("personalized_accuracy")
    return {
        "number": rnd.number,
        "state": rnd.state,
        **{k: int(row._mapping[k] or 0) for k in PARTICIPATION},
        "late_pushes": rnd.late_pushes,
        "opened_at": rnd.opened_at,
        "closed_at": rnd.closed_at,
        "deadline": rnd.deadline,
        "duration_seconds": m.duration_seconds if m else None,
        "test_accuracy": m.test_accuracy if m else None,
        "test_loss": m.test_loss if m else None,
        "tier_accuracy": dict(((m.extra if m else None) or {}).get("tier_accuracy") or {}),
        # clients evaluate after the close, so the evaluations table is fresher than the metrics row
        "mean_client_accuracy": mean_acc if mean_acc is not None else (m.mean_client_accuracy if m else None),
        "personalized_accuracy": personal if personal is not None else (m.personalized_accuracy if m else None),
        # a round past the aggregator's history_rounds has its evaluations summarized into its metrics row
        "evaluations": int(evals.get("clients", ((m.extra if m else None) or {}).get("evaluations", 0))),
        "dispersion": m.dispersion if m else None,
        "latent_clients": m.latent_clients if m else None,
        "bytes_down": int(row.bytes_down or 0),
        "bytes_up": int(row.bytes_up or 0),
        "fedavg_equivalent_bytes": int(row.fedavg_equivalent_bytes or 0),
    }


def round_page(
    session: Session, fed_id: int, filters: RoundFilters, offset: int, limit: int, order: Order
) -> tuple[int, list[dict[str, Any]]]:
    where = _round_where(fed_id, filters)
    total = int(session.scalar(select(func.count()).select_from(store.Round).where(*where)) or 0)
    number = store.Round.number
    page = list(
        session.scalars(
            select(number)
            .where(*where)
            .order_by(number.desc() if order == "desc" else number)
            .offset(offset)
            .limit(limit)
        )
    )
    rows = session.execute(_round_select(fed_id, page).order_by(number.desc() if order == "desc" else number)).all()
    evals = evaluation_means(session, fed_id, page)
    return total, [_round_dict(row, evals.get(row[0].number)) for row in rows]


def round_detail(session: Session, fed_id: int, number: int) -> dict[str, Any] | None:
    row = session.execute(_round_select(fed_id, [number])).one_or_none()
    if row is None:
        return None
    rnd, metrics = row[0], row[1]
    out = _round_dict(row, evaluation_means(session, fed_id, [number]).get(number))
    extra = (metrics.extra if metrics else None) or {}
    out.update(
        cohort=list(rnd.cohort or ()),
        due=list(rnd.due or ()),
        continue_unsynced=bool(rnd.continue_unsynced),
        extended=bool(rnd.extended),
        effective_dispersion=dict(extra.get("effective_dispersion") or {}),
        client_metrics=dict(extra.get("client_metrics") or {}),
    )
    return out


# --------------------------------------------------------------------------- clients


def client_item(c: store.Client, online_since: datetime) -> dict[str, Any]:
    return {
        "id": c.id,
        "name": c.name,
        "tier": c.tier,
        "online": c.revoked_at is None and c.last_seen >= online_since,
        "revoked": c.revoked_at is not None,
        "registered_at": c.registered_at,
        "last_seen": c.last_seen,
        "revoked_at": c.revoked_at,
        "rounds_joined": c.rounds_joined,
        "bytes_up": c.bytes_up,
        "bytes_down": c.bytes_down,
        "last_accuracy": c.last_accuracy,
    }


def client_page(
    session: Session,
    fed_id: int,
    online_since: datetime,
    offset: int,
    limit: int,
    *,
    status: ClientStatus | None = None,
    tier: float | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    c = store.Client
    where: list[Any] = [c.federation_id == fed_id]
    if status == "revoked":
        where.append(c.revoked_at.is_not(None))
    elif status == "online":
        where += [c.revoked_at.is_(None), c.last_seen >= online_since]
    elif status == "offline":
        where += [c.revoked_at.is_(None), c.last_seen < online_since]
    if tier is not None:
        where.append(c.tier == tier)
    total = int(session.scalar(select(func.count()).select_from(c).where(*where)) or 0)
    clients = session.scalars(select(c).where(*where).order_by(c.registered_at, c.id).offset(offset).limit(limit))
    return total, [client_item(x, online_since) for x in clients]


def client_detail(
    session: Session, fed_id: int, client_id: str, online_since: datetime, recent: int = 50
) -> dict[str, Any] | None:
    client = session.get(store.Client, client_id)
    if client is None or client.federation_id != fed_id:
        return None
    t = store.Transfer
    transfers = session.execute(
        select(
            t.round,
            func.sum(case((t.direction == "down", t.bytes), else_=0)).label("bytes_down"),
            func.sum(case((t.direction == "up", t.bytes), else_=0)).label("bytes_up"),
        )
        .where(t.federation_id == fed_id, t.client_id == client_id)
        .group_by(t.round)
        .order_by(t.round.desc())
        .limit(recent)
    )
    e = store.Evaluation
    evaluations = session.execute(
        select(e.round, e.global_accuracy, e.global_loss, e.personalized_accuracy, e.num_samples, e.reported_at)
        .where(e.federation_id == fed_id, e.client_id == client_id)
        .order_by(e.round.desc())
        .limit(recent)
    )
    return {
        **client_item(client, online_since),
        "profile": dict(client.profile or {}),
        "transfers": _rows(transfers),
        "evaluations": _rows(evaluations),
    }


# --------------------------------------------------------------------------- bandwidth


def _round_byte_sums(fed_id: int, rounds: Sequence[int] | None = None) -> Any:
    """Per round, from ``round_bytes`` (the ``transfers`` ledger summed as it is written): bytes down/up,
    per category, and the FedAvg-equivalent; only ``rounds`` when given, so a page costs its rows."""
    b = store.RoundBytes

    def of(*categories: str) -> Any:
        return func.coalesce(func.sum(case((b.category.in_(categories), b.bytes), else_=0)), 0)

    down = [c for c, d in store.TRANSFER_CATEGORIES.items() if d == "down"]
    up = [c for c, d in store.TRANSFER_CATEGORIES.items() if d == "up"]
    q = select(
        b.round.label("round"),
        of(*down).label("bytes_down"),
        of(*up).label("bytes_up"),
        of("train_fetch").label("bytes_train_fetch"),
        of("eval_fetch").label("bytes_eval_fetch"),
        of("push").label("bytes_push"),
        func.coalesce(func.sum(b.fedavg_equivalent_bytes), 0).label("fedavg_equivalent_bytes"),
    ).where(b.federation_id == fed_id)
    if rounds is not None:
        q = q.where(b.round.in_(list(rounds)))
    return q.group_by(b.round).subquery()


BANDWIDTH_COLUMNS = (
    "bytes_down",
    "bytes_up",
    "bytes_train_fetch",
    "bytes_eval_fetch",
    "bytes_push",
    "fedavg_equivalent_bytes",
)


def bandwidth_totals(session: Session, fed_id: int) -> dict[str, int]:
    """Every byte the federation moved, by direction and category, and its FedAvg-equivalent (``round_bytes``)."""
    per_round = _round_byte_sums(fed_id)
    sums = session.execute(select(*(func.sum(per_round.c[k]) for k in BANDWIDTH_COLUMNS))).one()
    return {k: int(v or 0) for k, v in zip(BANDWIDTH_COLUMNS, sums, strict=True)}


def bandwidth(
    session: Session, fed_id: int, offset: int, limit: int, after: int | None
) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """Rounds' bytes with running totals (a window over all rounds, then paged), and the grand totals.

    Everything comes from ``round_bytes``, the one ledger's per-round sums: a round's evaluation fetches
    (made after its close) count toward it, and an open round shows what it moved so far.
    """
    per_round = _round_byte_sums(fed_id)
    c = per_round.c
    running = select(
        c.round,
        *(c[k] for k in BANDWIDTH_COLUMNS),
        func.sum(c.bytes_down).over(order_by=c.round).label("cumulative_bytes_down"),
        func.sum(c.bytes_up).over(order_by=c.round).label("cumulative_bytes_up"),
        func.sum(c.fedavg_equivalent_bytes).over(order_by=c.round).label("cumulative_fedavg_equivalent_bytes"),
    ).subquery()
    newer = [running.c.round > after] if after is not None else []
    total = int(session.scalar(select(func.count()).select_from(running).where(*newer)) or 0)
    rows = _rows(session.execute(select(running).where(*newer).order_by(running.c.round).offset(offset).limit(limit)))
    sums = bandwidth_totals(session, fed_id)
    m = store.RoundMetrics
    n = int(session.scalar(select(func.count()).select_from(m).where(m.federation_id == fed_id)) or 0)
    d, u, f = sums["bytes_down"], sums["bytes_up"], sums["fedavg_equivalent_bytes"]
    moved = d + u
    totals = {
        "rounds": n,
        **sums,
        "saving_ratio": f / moved if moved else None,
        "saved_fraction": 1.0 - moved / f if f else None,
    }
    return totals, total, [{k: int(v) for k, v in r.items()} for r in rows]


# --------------------------------------------------------------------------- intervals


def intervals(session: Session, fed_id: int, after: int | None, limit: int, name: str | None) -> dict[str, Any]:
    """Each global tensor's interval now, and its τ_l, d_l and dispersion over (at most ``limit``) closed rounds."""
    tm = store.TensorMetric
    rounds_q = select(store.RoundMetrics.round).where(store.RoundMetrics.federation_id == fed_id)
    if after is not None:
        rounds_q = rounds_q.where(store.RoundMetrics.round > after)
    rounds = list(session.scalars(rounds_q.order_by(store.RoundMetrics.round).limit(limit)))
    g = store.GlobalTensor
    globals_q = select(g.name, g.interval, g.version).where(g.federation_id == fed_id)
    if name is not None:
        globals_q = globals_q.where(g.name == name)
    current = session.execute(globals_q).all()
    history: dict[str, list[dict[str, Any]]] = defaultdict(list)
    placement: dict[str, tuple[int | None, str | None]] = {}
    if rounds and current:
        hq = select(tm.name, tm.round, tm.interval, tm.d_l, tm.dispersion, tm.ordinal, tm.role).where(
            tm.federation_id == fed_id, tm.round >= rounds[0], tm.round <= rounds[-1]
        )
        if name is not None:
            hq = hq.where(tm.name == name)
        for r in session.execute(hq.order_by(tm.round, tm.ordinal)):
            history[r.name].append({"round": r.round, "interval": r.interval, "d_l": r.d_l, "dispersion": r.dispersion})
            placement[r.name] = (r.ordinal, r.role)
    if len(placement) < len(current):  # tensors without history in the window: place them by their latest row
        missing = [c.name for c in current if c.name not in placement]
        latest = (
            select(tm.name, func.max(tm.round).label("round"))
            .where(tm.federation_id == fed_id, tm.name.in_(missing))
            .group_by(tm.name)
            .subquery()
        )
        for row in session.execute(
            select(tm.name, tm.ordinal, tm.role).join(
                latest, and_(tm.federation_id == fed_id, tm.name == latest.c.name, tm.round == latest.c.round)
            )
        ):
            placement[row.name] = (row.ordinal, row.role)
    tensors = [
        {
            "name": c.name,
            "ordinal": placement.get(c.name, (None, None))[0],
            "role": placement.get(c.name, (None, None))[1],
            "interval": c.interval,
            "version": c.version,
            "history": history.get(c.name, []),
        }
        for c in current
    ]
    tensors.sort(key=lambda t: (t["ordinal"] is None, t["ordinal"] or 0, t["name"]))  # unplaced last, by name
    return {"rounds": rounds, "tensors": tensors}


# --------------------------------------------------------------------------- Prometheus


def _latest(session: Session, fed_id: int, column: Any) -> tuple[int, float] | None:
    m = store.RoundMetrics
    row = session.execute(
        select(m.round, column).where(m.federation_id == fed_id, column.is_not(None)).order_by(m.round.desc()).limit(1)
    ).first()
    return None if row is None else (int(row[0]), float(row[1]))


def _latest_tier_accuracy(session: Session, fed_id: int, last_closed: int | None) -> dict[str, float]:
    """The server's accuracy of the global model cut to each tier below 1, at the last closed round."""
    if last_closed is None:
        return {}
    m = store.RoundMetrics
    extra = session.scalar(select(m.extra).where(m.federation_id == fed_id, m.round == last_closed))
    return dict((extra or {}).get("tier_accuracy") or {})


def _latest_evaluations(session: Session, fed_id: int, last_eval: int | None) -> dict[str, Any] | None:
    """The latest evaluated round's means. With ``history_rounds`` a round keeping ``evaluations`` rows is newer
    than every pruned one; with none left (a round just closed, its reports to come), the latest pruned round
    that was evaluated gives its kept summary, as an unpruned database would give its rows' means."""
    if last_eval is not None:
        return evaluation_means(session, fed_id, [last_eval]).get(last_eval)
    m = store.RoundMetrics
    kept = session.scalars(
        select(m)
        .where(m.federation_id == fed_id, m.mean_client_accuracy.is_not(None))
        .order_by(m.round.desc())
        .limit(1)
    ).first()
    return None if kept is None else store.kept_evaluation_summary(kept)


def metrics_snapshot(
    session: Session, fed: store.Federation, online_since: datetime, buckets: Sequence[float]
) -> dict[str, Any]:
    """Everything ``/metrics`` exposes: one aggregate per table, the rest by index.

    A closed round always has its metrics row, so closed rounds are counted on ``round_metrics``
    (primary-key scan) and abandoned ones by difference; the one scan of ``rounds`` sums its clients
    (:func:`participation_totals`, each cohort's JSON array counted by the database).
    """
    m, r, e = store.RoundMetrics, store.Round, store.Evaluation
    duration = m.duration_seconds
    closed = session.execute(
        select(
            func.count(),
            func.max(m.round),
            func.count(duration),
            func.coalesce(func.sum(duration), 0.0),
            *(func.count().filter(duration <= b) for b in buckets),
        ).where(m.federation_id == fed.id)
    ).one()
    n_closed, last_closed, n_durations, duration_sum = closed[:4]
    all_rounds = int(session.scalar(select(func.count()).select_from(r).where(r.federation_id == fed.id)) or 0)
    opened = session.execute(
        select(r.number, r.opened_at, r.deadline).where(r.federation_id == fed.id, r.state == "open")
    ).first()
    open_round = None if opened is None else opened.number
    closed_at = (
        None
        if last_closed is None
        else session.scalar(select(r.closed_at).where(r.federation_id == fed.id, r.number == last_closed))
    )
    last_eval = session.scalar(select(e.round).where(e.federation_id == fed.id).order_by(e.round.desc()).limit(1))
    tensors = []
    if last_closed is not None:  # the last closed round: an open round's rows only count bytes so far
        tm = store.TensorMetric
        tensors = _rows(
            session.execute(
                select(tm.name, tm.role, tm.d_l, tm.dispersion, tm.interval)
                .where(tm.federation_id == fed.id, tm.round == last_closed)
                .order_by(tm.ordinal)
            )
        )
    clients = _client_totals(session, fed.id, online_since)
    return {
        "name": fed.name,
        "state": fed.state,
        "config": dict(fed.config or {}),
        "rounds": {
            "open": int(open_round is not None),
            "closed": int(n_closed),
            "abandoned": all_rounds - int(n_closed) - int(open_round is not None),
        },
        "current_round": open_round if open_round is not None else int(last_closed or 0),
        "last_closed_round": int(last_closed or 0),
        # Unix seconds (the store's datetimes are UTC-aware on both backends); None: nothing to report
        "last_closed_at": None if closed_at is None else closed_at.timestamp(),
        "open_round_opened_at": None if opened is None else opened.opened_at.timestamp(),
        "open_round_deadline": None if opened is None else opened.deadline.timestamp(),
        "participation": participation_totals(session, fed.id),
        "clients": clients,
        "duration_count": int(n_durations),
        "duration_sum": float(duration_sum or 0.0),
        "duration_buckets": [(b, int(n)) for b, n in zip(buckets, closed[4:], strict=True)],
        **bandwidth_totals(session, fed.id),  # the one ledger: the same sums as /api/v1/bandwidth
        "test_accuracy": _latest(session, fed.id, m.test_accuracy),
        "test_loss": _latest(session, fed.id, m.test_loss),
        "dispersion": _latest(session, fed.id, m.dispersion),
        "tier_accuracy": _latest_tier_accuracy(session, fed.id, last_closed),
        "evaluations": _latest_evaluations(session, fed.id, last_eval),
        "tensors": tensors,
    }


def database_ok(session: Session) -> None:
    """Raise unless the database answers and holds the store's tables."""
    session.execute(select(literal(1)))
    session.execute(select(store.Federation.id).limit(1))
