"""FedMedian (Yin et al. 2018): the coordinate-wise median of the clients' values, as Flower's ``FedMedian``.

Unweighted, and for an even number of clients the mean of the two middle values (numpy's
median). Robust to a minority of arbitrary clients per coordinate.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from aggregator_service.strategies.robust import CoordinateWise

__all__ = ["FedMedian"]


class FedMedian(CoordinateWise):
    """Coordinate-wise median over the round's clients."""

    name: ClassVar[str] = "fedmedian"

    def combine(self, stacked: Tensor, weights: Tensor) -> Tensor:
        ordered = stacked.sort(dim=0).values
        n = ordered.shape[0]
        if n % 2:
            return ordered[n // 2]
        return (ordered[n // 2 - 1] + ordered[n // 2]) / 2
