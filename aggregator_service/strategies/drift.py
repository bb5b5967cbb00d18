"""The clients' mean drift from the global model: what FedDyn's and FedDC's servers add to the average.

Both keep, over all ``N`` clients, the running sum of what they moved in their rounds;
a round with reporting clients ``S`` adds ``D = (1/N) Σ_{k∈S} (y_k − x)`` (uniform, as the
papers write it) over the trainable tensors. :class:`DriftAccumulator` folds the
uniform sum ``Σ_{k∈S} y_k`` alongside FedAvg's weighted mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from aggregator_service.strategies.base import RoundAccumulator
from aggregator_service.strategies.scaffold import ScaffoldAccumulator
from aggregator_service.updates import ClientUpdate
from aggregator_service.weighted_mean import WeightedMean
from fedcore import codec
from fedcore.spec import ModelSpec

__all__ = ["DriftAccumulator", "DriftFold", "mean_drift", "trainable_shapes"]


def trainable_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in spec.full().tensors if t.role != "buffer"}


@dataclass
class DriftAccumulator(ScaffoldAccumulator):
    """Adds the uniform mean of the clients' trainable tensors (and SCAFFOLD's controls, used by FedDC)."""

    uniform: WeightedMean = field(default_factory=WeightedMean)


class DriftFold:
    """FedDyn's and FedDC's fold: FedAvg's, plus each module's trainable tensors into the uniform sum.

    A mixin before the strategy's FedAvg-derived base, whose ``fold`` and ``fold_module`` it extends.
    """

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if not isinstance(acc, DriftAccumulator):
            raise TypeError(f"{type(self).__name__}.fold needs the accumulator its begin returned")
        super().fold(acc, update)  # type: ignore[misc]
        acc.uniform.count_contribution(1.0)

    def fold_module(
        self, acc: RoundAccumulator, update: ClientUpdate, aligned: Mapping[str, Tensor], weight: float
    ) -> None:
        super().fold_module(acc, update, aligned, weight)  # type: ignore[misc]
        trainable = trainable_shapes(update.spec)
        acc.uniform.add({n: t for n, t in aligned.items() if n in trainable}, 1.0, part=True)  # type: ignore[attr-defined]


def mean_drift(
    acc: DriftAccumulator, global_tensors: Mapping[str, Tensor], num_clients_total: int, fp16: bool = False
) -> dict[str, Tensor]:
    """``D = (1/N) Σ_{k∈S} (y_k − x)`` per trainable tensor the clients reported, in float64.

    ``fp16``: clients started from ``x`` as float16 transport delivered it, and count their drift from there
    (:class:`fedcore.training.terms.LocalTerms`): so does the server, or the two sums part by the rounding."""
    count = acc.uniform.count
    out = {}
    for name, mean in acc.uniform.mean(cast=False).items():
        x = global_tensors[name].detach()
        x = codec.as_delivered(x, fp16).to(torch.float64)
        out[name] = (count / max(num_clients_total, count)) * (mean - x)
    return out
