"""Coordinate-wise robust aggregation (FedMedian, FedTrimmedAvg): every client's aligned values are kept.

A median or trimmed mean needs all values of a coordinate at once, so these rules hold the
round's aligned tensors in memory (O(clients × model), unlike FedAvg's streaming mean).
Integer tensors (step counters) take FedAvg's rounded mean. Low-rank tiers are refused:
a γ < 1 client sends factors whose product the server rebuilds, so one bad factor moves
every coordinate of its layer at once and a per-coordinate vote no longer bounds it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from aggregator_service.strategies.base import RoundAccumulator, Setting
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.updates import AggregateResult, ClientUpdate
from aggregator_service.weighted_mean import is_float

__all__ = ["CoordinateWise", "RobustAccumulator"]


@dataclass
class RobustAccumulator(RoundAccumulator):
    """Adds every client's aligned floating tensors and weight, in fold order."""

    values: dict[str, list[Tensor]] = field(default_factory=dict)
    value_weights: dict[str, list[float]] = field(default_factory=dict)


class CoordinateWise(FedAvg):
    """FedAvg's bookkeeping, with each floating coordinate aggregated by :meth:`combine`."""

    @classmethod
    def refuse(cls, setting: Setting) -> str | None:
        if setting.low_rank:
            return (
                f"{cls.name} votes per coordinate of what clients send, and a low-rank client sends factors "
                "whose product moves a whole layer: use tiers = [1]"
            )
        return None

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return RobustAccumulator(due, shapes)

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if not isinstance(acc, RobustAccumulator):
            raise TypeError(f"{type(self).__name__}.fold needs the accumulator its begin returned")
        super().fold(acc, update)

    def fold_module(
        self, acc: RoundAccumulator, update: ClientUpdate, aligned: Mapping[str, Tensor], weight: float
    ) -> None:
        super().fold_module(acc, update, aligned, weight)
        if not isinstance(acc, RobustAccumulator):
            raise TypeError(f"{type(self).__name__}.fold needs the accumulator its begin returned")
        for name, tensor in aligned.items():
            if is_float(tensor.dtype):
                acc.values.setdefault(name, []).append(tensor.detach().to(torch.float64))
                acc.value_weights.setdefault(name, []).append(weight)

    @abstractmethod
    def combine(self, stacked: Tensor, weights: Tensor) -> Tensor:
        """The aggregate of ``stacked`` (clients × …, float64) along dim 0; ``weights`` are the clients' (float64)."""

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        if not isinstance(acc, RobustAccumulator):
            raise TypeError(f"{type(self).__name__}.finish needs the accumulator its begin returned")
        result = super().finish(acc, global_tensors)
        for name, values in acc.values.items():
            weights = torch.tensor(acc.value_weights[name], dtype=torch.float64)
            result.tensors[name] = self.combine(torch.stack(values), weights).to(global_tensors[name].dtype)
        return result
