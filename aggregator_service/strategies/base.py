"""What every strategy is: a small object with few verbs, in Flower's style.

The round template (plan, fold every reported update, close) lives with the caller
(:mod:`aggregator_service.rounds`); a strategy only supplies the verbs::

    acc = strategy.begin(global_tensors, due)
    for update in updates:            # any order, one at a time
        strategy.fold(acc, update)
    result = strategy.finish(acc, global_tensors)   # new values of the due tensors + metrics

``fold`` adds one client to streaming float64 accumulators, so closing a round costs
O(model) memory whatever the number of clients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.updates import AggregateResult, ClientUpdate
from aggregator_service.weighted_mean import WeightedMean
from fedcore.spec import ModelSpec

__all__ = ["RoundAccumulator", "Strategy"]


@dataclass
class RoundAccumulator:
    """Running sums of one round: aligned tensors, effective filters, weights, client metrics."""

    due: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    tensors: WeightedMean = field(default_factory=WeightedMean)
    filters: WeightedMean = field(default_factory=WeightedMean)
    weights: list[float] = field(default_factory=list)
    client_ids: list[str] = field(default_factory=list)
    reported: set[str] = field(default_factory=set)  # O(1) duplicate check in fold
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_weights: dict[str, float] = field(default_factory=dict)


class Strategy(ABC):
    """A server-side aggregation rule; the caller owns the round template (begin → fold… → finish)."""

    name: ClassVar[str]

    def client_config(self) -> dict[str, Any]:
        """Hyper-parameters clients need for their local update (sent with every TRAIN task)."""
        return {}

    def local_tensors(self, spec: ModelSpec) -> frozenset[str]:
        """Full-rank names this strategy never aggregates (they stay on the clients)."""
        return frozenset()

    def server_control(self, spec: ModelSpec | None = None) -> dict[str, Tensor] | None:
        """Per-tensor server state clients need for their local update (SCAFFOLD's ``c``); ``None`` if none."""
        return None

    @abstractmethod
    def begin(self, global_tensors: Mapping[str, Tensor], due: Sequence[str]) -> RoundAccumulator:
        """Open a round that aggregates the full-rank tensors ``due``."""

    @abstractmethod
    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        """Add one client's update to the round's running sums (O(model) memory)."""

    @abstractmethod
    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        """New global values of the due tensors, and the round's dispersion metrics."""

    def state_dict(self) -> dict[str, Any]:
        """Server state that must survive a restart (tensors are left for the caller to encode)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")
