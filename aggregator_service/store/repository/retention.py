"""How much per-client and per-tensor history a long-running federation keeps.

A round leaves a row per client and category in ``transfers``, one per reporting client in
``evaluations`` and one per tensor in ``tensor_metrics``: tens of kilobytes a round, which a
federation closing a round a minute for months turns into gigabytes. A round's totals live in
rows per round (``rounds``, ``round_metrics``, ``round_bytes``), so :func:`prune_history` may delete
the detail of old rounds and keep their bytes, accuracies and client counts.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..models import Evaluation, Federation, RoundMetrics, TensorMetric, Transfer
from ._common import _attached
from .reports import keep_evaluation_summary, round_evaluations

__all__ = ["MAX_ROUNDS_PER_PRUNE", "prune_history"]

#: Rounds one call summarizes and deletes at most: turning ``history_rounds`` on for a long-lived
#: federation spreads its backlog over the next closes instead of holding one close for minutes.
MAX_ROUNDS_PER_PRUNE = 100


def prune_history(session: Session, fed: Federation, last_closed: int, keep_rounds: int) -> int:
    """Delete the ``transfers``, ``evaluations`` and ``tensor_metrics`` of rounds numbered below the
    ``keep_rounds`` latest; returns the last round pruned so far (``federations.history_pruned_through``).

    Each newly pruned round's evaluations are first summed into its metrics row (``extra['evaluation_sums']``,
    with the weighted means :func:`evaluation_summary` gives and their count in ``extra['evaluations']``),
    so its mean client accuracy stays on the dashboard; its bytes stay in ``round_bytes`` and in the
    clients' lifetime counters. Reports and transfers that arrive later for a pruned round add to those
    sums (:func:`record_evaluation`, :func:`record_transfers`), so its figures stay an unpruned database's.
    """
    if keep_rounds < 1:
        raise ValueError(f"keep_rounds must be ≥ 1, got {keep_rounds}")
    row = _attached(session, fed)
    start = row.history_pruned_through
    cutoff = min(last_closed - keep_rounds, start + MAX_ROUNDS_PER_PRUNE)
    if cutoff <= start:
        return start
    m = RoundMetrics
    kept = session.scalars(select(m).where(m.federation_id == row.id, m.round > start, m.round <= cutoff)).all()
    for metrics in kept:  # every closed round, evaluated or not yet: a late report adds to its sums
        keep_evaluation_summary(metrics, round_evaluations(session, row, metrics.round))
    row.history_pruned_through = cutoff
    session.flush()
    for table in (Evaluation, Transfer, TensorMetric):  # ≤ cutoff: a row a concurrent late write left goes too
        session.execute(
            delete(table)
            .where(table.federation_id == row.id, table.round <= cutoff)
            .execution_options(synchronize_session=False)
        )
    return cutoff
