"""How much per-client and per-tensor history a long-running federation keeps.

A round leaves a row per client and category in ``transfers``, one per reporting client in
``evaluations`` and one per tensor in ``tensor_metrics``: tens of kilobytes a round, which a
federation closing a round a minute for months turns into gigabytes. What the dashboard plots
over all rounds lives in rows per round (``rounds``, ``round_metrics``, ``round_bytes``), so
:func:`prune_history` may delete the detail of old rounds and keep every curve.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..models import Evaluation, Federation, RoundMetrics, TensorMetric, Transfer
from .reports import evaluation_summary

__all__ = ["prune_history"]


def prune_history(session: Session, fed: Federation, last_closed: int, keep_rounds: int) -> int:
    """Delete the ``transfers``, ``evaluations`` and ``tensor_metrics`` of rounds before the ``keep_rounds``
    latest closed ones; returns the last round pruned (0: none).

    A pruned round's clients' evaluations are first summarized into its metrics row (the weighted
    means :func:`evaluation_summary` gives, and their count in ``extra['evaluations']``), so its
    mean client accuracy stays on the dashboard. Its bytes stay in ``round_bytes`` and in the clients'
    lifetime counters. An evaluation reported after its round was pruned is not added to the summary.
    """
    if keep_rounds < 1:
        raise ValueError(f"keep_rounds must be ≥ 1, got {keep_rounds}")
    cutoff = last_closed - keep_rounds
    if cutoff < 1:
        return 0
    e = Evaluation
    evaluated = session.scalars(
        select(e.round).where(e.federation_id == fed.id, e.round <= cutoff).group_by(e.round)
    ).all()
    for round_ in evaluated:
        metrics = session.get(RoundMetrics, (fed.id, round_))
        if metrics is None or "evaluations" in (metrics.extra or {}):
            continue  # an abandoned round has no metrics row; a summarized one keeps its summary
        summary = evaluation_summary(session, fed, round_)
        metrics.mean_client_accuracy = summary["mean_client_accuracy"]
        metrics.personalized_accuracy = summary["personalized_accuracy"]
        extra: dict[str, Any] = dict(metrics.extra or {})
        extra["evaluations"] = summary["clients"]
        extra["mean_client_loss"] = summary["mean_client_loss"]
        metrics.extra = extra
    session.flush()
    for table in (Evaluation, Transfer, TensorMetric):
        session.execute(
            delete(table)
            .where(table.federation_id == fed.id, table.round <= cutoff)
            .execution_options(synchronize_session=False)
        )
    return cutoff
