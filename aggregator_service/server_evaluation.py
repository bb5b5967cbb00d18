"""The server's evaluation of a closed round: the global model, and its cut at each tier below 1.

A client of tier γ < 1 never runs the global model: it trains and predicts with the global model
cut to its rank (the truncated SVD its fetch hands it, :meth:`Federation.tier_tensors`). With
mixed tiers the larger tiers' updates can leave that cut well below the model it was cut from, so
"do small tiers keep up" is answered by the cut's accuracy, not the global model's alone. Both
transports call :func:`evaluate_round`, so the in-process record and the service's metrics row
hold the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aggregator_service.rounds import Federation

__all__ = ["ServerEvaluation", "evaluate_round", "tier_key"]


def tier_key(tier: float) -> str:
    """How a tier names its figures in records, JSON and metric labels: ``0.125`` → ``"0.125"``."""
    return f"{tier:g}"


@dataclass(frozen=True)
class ServerEvaluation:
    accuracy: float
    loss: float
    #: tier key → accuracy of the global model cut to that tier; only tiers below 1 the federation serves
    tier_accuracy: dict[str, float] = field(default_factory=dict)


def evaluate_round(federation: Federation, data: Any) -> ServerEvaluation:
    """Evaluate the global model and, for every tier below 1 the federation serves, its cut on ``data``."""
    from fedcore.training import evaluate

    model = federation.spec.build()
    model.load_state_dict(federation.global_tensors)
    result = evaluate(model, data, device="cpu")
    cuts: dict[str, float] = {}
    for tier in federation.tiers:
        if tier >= 1.0:
            continue
        cut = federation.tier_spec(tier).build()
        cut.load_state_dict(federation.tier_tensors(tier))
        cuts[tier_key(tier)] = evaluate(cut, data, device="cpu").accuracy
    return ServerEvaluation(result.accuracy, result.loss, cuts)
