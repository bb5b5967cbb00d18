"""Evaluations reported by clients, and the reads behind the dashboard."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, case, func, select, update
from sqlalchemy.orm import Session

from ..models import Client, Evaluation, Federation, Round, RoundMetrics, TensorMetric
from ._common import NotFound, _count, _finite, _now, _page, prebuilt, upsert_for

__all__ = [
    "evaluation_summary",
    "keep_evaluation_summary",
    "kept_evaluation_summary",
    "list_rounds",
    "record_evaluation",
    "round_evaluations",
    "round_tensor_metrics",
    "tensor_metric_history",
]


# --------------------------------------------------------------------------- evaluations

# Statements every report runs, built once (see ``_common.prebuilt``).
_ROUND_EXISTS = (
    select(Federation.history_pruned_through)
    .join(Round, Round.federation_id == Federation.id)
    .where(Round.federation_id == bindparam("fed"), Round.number == bindparam("round"))
)
_CLIENTS = Client.__table__
# after a first report: the client's last accuracy (when it gave one) and its latest counted round
_COUNT_FOR_CLIENT = (
    update(_CLIENTS)  # type: ignore[arg-type]  # a Table at runtime
    .where(_CLIENTS.c.id == bindparam("cid"))
    .values(
        last_accuracy=func.coalesce(bindparam("accuracy"), _CLIENTS.c.last_accuracy),
        evaluated_through=case(
            (_CLIENTS.c.evaluated_through < bindparam("round"), bindparam("round")),
            else_=_CLIENTS.c.evaluated_through,
        ),
    )
)
# a report for a pruned round counts only above the client's latest counted round (below or at it: a retry)
_COUNT_PRUNED = (
    update(_CLIENTS)  # type: ignore[arg-type]
    .where(_CLIENTS.c.id == bindparam("cid"), _CLIENTS.c.evaluated_through < bindparam("round"))
    .values(
        last_accuracy=func.coalesce(bindparam("accuracy"), _CLIENTS.c.last_accuracy),
        evaluated_through=bindparam("round"),
    )
)

#: what a round's evaluations are summed into, so a pruned round's means take a late report exactly
_SUMMED = ("global_accuracy", "global_loss", "personalized_accuracy")


@prebuilt
def _first_evaluation(dialect: str) -> Any:
    """``INSERT … ON CONFLICT DO NOTHING RETURNING``: a row back only when this report is the first."""
    table = Evaluation.__table__
    ins = upsert_for(dialect)(table).on_conflict_do_nothing(index_elements=["federation_id", "round", "client_id"])
    return ins.returning(table.c.client_id)


def record_evaluation(
    session: Session,
    fed: Federation,
    round: int,
    client_id: str,
    *,
    global_accuracy: float | None,
    global_loss: float | None,
    personalized_accuracy: float | None = None,
    num_samples: int = 0,
    now: datetime | None = None,
) -> bool:
    """Record a client's evaluation after ``round``; ``False`` when it had reported already (the first stands).

    A client that retries a report whose reply it lost sends the same numbers again; keeping the
    first makes the retry harmless and needs no read before the write (``INSERT … ON CONFLICT DO
    NOTHING``). Also sets the client's ``last_accuracy`` (personalized accuracy when given, else global).
    A round whose history is pruned (``history_rounds``) has no rows to add to: the report adds to the
    sums its metrics row keeps (:func:`_count_in_pruned_round`), so its figures are an unpruned database's.
    """
    values = {
        "global_accuracy": _finite(global_accuracy, "global_accuracy"),
        "global_loss": _finite(global_loss, "global_loss"),
        "personalized_accuracy": _finite(personalized_accuracy, "personalized_accuracy"),
        "num_samples": _count(num_samples, "num_samples"),
        "reported_at": _now(now),
    }
    conn = session.connection()
    found = conn.execute(_ROUND_EXISTS, {"fed": fed.id, "round": round}).first()
    if found is None:
        raise NotFound(f"federation {fed.name!r} has no round {round}")
    accuracy = (
        values["personalized_accuracy"] if values["personalized_accuracy"] is not None else values["global_accuracy"]
    )
    client = {"cid": client_id, "accuracy": accuracy, "round": round}
    if round <= found[0]:
        return _count_in_pruned_round(session, fed, round, client, values)
    row = {"federation_id": fed.id, "round": round, "client_id": client_id, **values}
    if conn.execute(_first_evaluation(conn.dialect.name), row).first() is None:
        return False
    conn.execute(_COUNT_FOR_CLIENT, client)
    return True


def _count_in_pruned_round(
    session: Session, fed: Federation, round: int, client: dict[str, Any], values: dict[str, Any]
) -> bool:
    """Add a late report to a pruned round's kept sums and means; ``False`` for a retry (the client's reports
    are in round order: one at or below its latest counted round was counted) or a round pruned before its
    sums were kept."""
    metrics = session.get(RoundMetrics, (fed.id, round), with_for_update=True, populate_existing=True)
    extra: dict[str, Any] = dict((metrics.extra if metrics is not None else None) or {})
    if "evaluation_sums" not in extra:
        return False
    if session.connection().execute(_COUNT_PRUNED, client).rowcount != 1:
        return False
    sums = {k: list(v) for k, v in extra["evaluation_sums"].items()}
    _add(sums, values["num_samples"], values)
    summary = _summary(sums, int(extra.get("evaluations", 0)) + 1)
    _keep_summary(metrics, summary, sums)
    return True


def _add(sums: dict[str, list[float]], n: int, values: Any) -> None:
    """Add one report to ``sums``: per measure Σ v·n, Σ n, Σ v and the count of reports that gave it."""
    for attr in _SUMMED:
        v = values[attr] if isinstance(values, dict) else getattr(values, attr)
        if v is not None:
            s = sums.setdefault(attr, [0.0, 0, 0.0, 0])
            s[0] += v * n
            s[1] += n
            s[2] += v
            s[3] += 1


def _summary(sums: dict[str, list[float]], clients: int) -> dict[str, Any]:
    """Σ v·n / Σ n over reports that gave ``v``; the plain mean where none gave ``num_samples``."""

    def mean(attr: str) -> float | None:
        weighted, weight, plain, count = sums.get(attr) or (0.0, 0, 0.0, 0)
        if not count:
            return None
        return plain / count if weight == 0 else weighted / weight

    return {
        "clients": clients,
        "mean_client_accuracy": mean("global_accuracy"),
        "mean_client_loss": mean("global_loss"),
        "personalized_accuracy": mean("personalized_accuracy"),
    }


def _keep_summary(metrics: RoundMetrics, summary: dict[str, Any], sums: dict[str, list[float]]) -> None:
    """What the dashboard shows of a pruned round, and the sums a late report adds to."""
    metrics.mean_client_accuracy = summary["mean_client_accuracy"]
    metrics.personalized_accuracy = summary["personalized_accuracy"]
    extra: dict[str, Any] = dict(metrics.extra or {})
    extra["evaluations"] = summary["clients"]
    extra["evaluation_sums"] = sums
    metrics.extra = extra


def keep_evaluation_summary(metrics: RoundMetrics, evals: list[Evaluation]) -> None:
    """Sum a round's ``evals`` into its metrics row before they are pruned (see :func:`kept_evaluation_summary`)."""
    sums = _sums_of(evals)
    _keep_summary(metrics, _summary(sums, len(evals)), sums)


def kept_evaluation_summary(metrics: RoundMetrics) -> dict[str, Any]:
    """A pruned round's :func:`evaluation_summary`, from the sums its metrics row keeps. A round pruned before
    sums were kept (a database written before 0009) has its means but no loss: ``mean_client_loss`` is ``None``."""
    extra = metrics.extra or {}
    clients = int(extra.get("evaluations", 0))
    if "evaluation_sums" in extra:
        return _summary(extra["evaluation_sums"], clients)
    return {
        "clients": clients,
        "mean_client_accuracy": metrics.mean_client_accuracy,
        "mean_client_loss": None,
        "personalized_accuracy": metrics.personalized_accuracy,
    }


def round_evaluations(session: Session, fed: Federation, round: int) -> list[Evaluation]:
    return list(
        session.scalars(
            select(Evaluation)
            .where(Evaluation.federation_id == fed.id, Evaluation.round == round)
            .order_by(Evaluation.client_id)
        )
    )


def _sums_of(evals: list[Evaluation]) -> dict[str, list[float]]:
    """Per measure of :data:`_SUMMED`: Σ v·n, Σ n, Σ v and how many of ``evals`` gave it."""
    sums: dict[str, list[float]] = {}
    for e in evals:
        _add(sums, e.num_samples, e)
    return sums


def evaluation_summary(session: Session, fed: Federation, round: int) -> dict[str, float | int | None]:
    """Sample-weighted means of the round's evaluations (unweighted where no client gave ``num_samples``)."""
    evals = round_evaluations(session, fed, round)
    return _summary(_sums_of(evals), len(evals))


# --------------------------------------------------------------------------- dashboard reads


def list_rounds(
    session: Session, fed: Federation, offset: int = 0, limit: int = 100, *, newest_first: bool = False
) -> list[tuple[Round, RoundMetrics | None]]:
    """Rounds with their metrics (``None`` while open or when abandoned), by number."""
    offset, limit = _page(offset, limit)
    order = Round.number.desc() if newest_first else Round.number
    rows = session.execute(
        select(Round, RoundMetrics)
        .outerjoin(
            RoundMetrics, (RoundMetrics.federation_id == Round.federation_id) & (RoundMetrics.round == Round.number)
        )
        .where(Round.federation_id == fed.id)
        .order_by(order)
        .offset(offset)
        .limit(limit)
    )
    return [(r, m) for r, m in rows]


def round_tensor_metrics(session: Session, fed: Federation, round: int) -> list[TensorMetric]:
    """The round's per-tensor metrics in model order."""
    return list(
        session.scalars(
            select(TensorMetric)
            .where(TensorMetric.federation_id == fed.id, TensorMetric.round == round)
            .order_by(TensorMetric.ordinal, TensorMetric.name)
        )
    )


def tensor_metric_history(session: Session, fed: Federation, name: str) -> list[TensorMetric]:
    """One tensor's metrics over the rounds (its interval and d_l history)."""
    return list(
        session.scalars(
            select(TensorMetric)
            .where(TensorMetric.federation_id == fed.id, TensorMetric.name == name)
            .order_by(TensorMetric.round)
        )
    )
