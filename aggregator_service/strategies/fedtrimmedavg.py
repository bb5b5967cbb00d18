"""FedTrimmedAvg (Yin et al. 2018): per coordinate, drop the ``⌊β·n⌋`` lowest and highest client values.

As Flower's ``FedTrimmedAvg`` (β = 0.2, its default), except that the values kept are
averaged with the clients' weights (``weighting``), so β = 0 is FedAvg.
"""

from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor

from aggregator_service.strategies.robust import CoordinateWise

__all__ = ["FedTrimmedAvg"]


class FedTrimmedAvg(CoordinateWise):
    """Coordinate-wise trimmed mean: ``beta`` is the fraction cut from each end."""

    name: ClassVar[str] = "fedtrimmedavg"

    def __init__(
        self,
        beta: float = 0.2,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"beta (the fraction trimmed from each end) must be in [0, 0.5), got {beta}")
        self.beta = float(beta)

    def combine(self, stacked: Tensor, weights: Tensor) -> Tensor:
        n = stacked.shape[0]
        cut = int(self.beta * n)
        ordered, order = stacked.sort(dim=0)
        kept = slice(cut, n - cut)
        w = weights[order[kept]]  # each kept value's client weight, per coordinate
        return (ordered[kept] * w).sum(0) / w.sum(0)
