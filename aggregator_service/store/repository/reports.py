"""Evaluations reported by clients, and the reads behind the dashboard."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from ..models import Client, Evaluation, Federation, Round, RoundMetrics, TensorMetric
from ._common import NotFound, _count, _finite, _now, _page, prebuilt, upsert_for

__all__ = [
    "evaluation_summary",
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
_SET_LAST_ACCURACY = (
    update(Client.__table__)  # type: ignore[arg-type]  # a Table at runtime
    .where(Client.__table__.c.id == bindparam("cid"))
    .values(last_accuracy=bindparam("accuracy"))
)


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
    """Record a client's evaluation after ``round``; ``False`` when it had reported already (the first stands)
    or the round's history is pruned (``history_rounds``: its evaluations are summarized already).

    A client that retries a report whose reply it lost sends the same numbers again; keeping the
    first makes the retry harmless and needs no read before the write (``INSERT … ON CONFLICT DO
    NOTHING``). Also sets the client's ``last_accuracy`` (personalized accuracy when given, else global).
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
    if round <= found[0]:
        return False
    row = {"federation_id": fed.id, "round": round, "client_id": client_id, **values}
    if conn.execute(_first_evaluation(conn.dialect.name), row).first() is None:
        return False
    accuracy = (
        values["personalized_accuracy"] if values["personalized_accuracy"] is not None else values["global_accuracy"]
    )
    if accuracy is not None:
        conn.execute(_SET_LAST_ACCURACY, {"cid": client_id, "accuracy": accuracy})
    return True


def round_evaluations(session: Session, fed: Federation, round: int) -> list[Evaluation]:
    return list(
        session.scalars(
            select(Evaluation)
            .where(Evaluation.federation_id == fed.id, Evaluation.round == round)
            .order_by(Evaluation.client_id)
        )
    )


def evaluation_summary(session: Session, fed: Federation, round: int) -> dict[str, float | int | None]:
    """Sample-weighted means of the round's evaluations (unweighted where no client gave ``num_samples``)."""
    evals = round_evaluations(session, fed, round)

    def mean(attr: str) -> float | None:
        pairs = [(getattr(e, attr), e.num_samples) for e in evals if getattr(e, attr) is not None]
        if not pairs:
            return None
        weight = sum(n for _, n in pairs)
        if weight == 0:
            return sum(v for v, _ in pairs) / len(pairs)
        return sum(v * n for v, n in pairs) / weight

    return {
        "clients": len(evals),
        "mean_client_accuracy": mean("global_accuracy"),
        "mean_client_loss": mean("global_loss"),
        "personalized_accuracy": mean("personalized_accuracy"),
    }


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
