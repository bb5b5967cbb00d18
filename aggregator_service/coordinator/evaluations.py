"""Evaluations: what clients measured on a closed round's global model (and their personalized models)."""

from __future__ import annotations

import math

from sqlalchemy import select

from aggregator_service import store
from aggregator_service.errors import FailedPrecondition, InvalidArgument

from .answers import ClientInfo
from .shared import Shared

__all__ = ["Evaluations"]


class Evaluations:
    """ReportEvaluation; no lock (a closed round stays closed, so the set of known ones only grows)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._closed_rounds: set[int] = set()

    def report_evaluation(
        self,
        client: ClientInfo,
        round_: int,
        global_accuracy: float,
        global_loss: float,
        personalized_accuracy: float | None,
        num_samples: int,
    ) -> bool:
        """Store a client's evaluation of round ``round_``; ``False`` when it already reported (the first stands)."""
        for what, value in (("global_accuracy", global_accuracy), ("personalized_accuracy", personalized_accuracy)):
            if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise InvalidArgument(f"{what} must be a fraction in [0, 1], got {value}")
        if not (math.isfinite(global_loss) and global_loss >= 0.0):
            raise InvalidArgument(f"global_loss must be a finite number ≥ 0, got {global_loss}")
        if num_samples < 1:
            raise InvalidArgument(f"num_samples must be ≥ 1, got {num_samples}")
        if round_ < 1:  # no round 0 closes: it names the initial model
            raise InvalidArgument(f"round must be ≥ 1 (the round whose model you evaluated), got {round_}")
        shared = self.shared
        if round_ not in self._closed_rounds:
            with shared.reader.connect() as conn:
                state = conn.execute(
                    select(store.Round.state).where(
                        store.Round.federation_id == shared.fed_row.id, store.Round.number == round_
                    )
                ).scalar()
            if state != "closed":
                raise FailedPrecondition(f"round {round_} has not closed: evaluate a model version you fetched")
            if len(self._closed_rounds) >= 4096:  # a bound on memory over months of rounds; a miss is one read
                self._closed_rounds.clear()
            self._closed_rounds.add(round_)
        return shared.writes.run(
            lambda s: store.record_evaluation(
                s,
                shared.fed_row,
                round_,
                client.id,
                global_accuracy=global_accuracy,
                global_loss=global_loss,
                personalized_accuracy=personalized_accuracy,
                num_samples=num_samples,
            )
        )
