"""FedAdam (Reddi et al. 2021): FedOpt with Adam's second moment, ``v ← β₂·v + (1 − β₂)·Δ²``.

Defaults are Flower's ``FedAdam``: η = 1e-1, β₁ = 0.9, β₂ = 0.99, τ = 1e-9.
"""

from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor

from aggregator_service.strategies.fedopt import FedOpt

__all__ = ["FedAdam"]


class FedAdam(FedOpt):
    """Server Adam on the pseudo-gradient (see :mod:`aggregator_service.strategies.fedopt`)."""

    name: ClassVar[str] = "fedadam"

    def __init__(
        self,
        eta: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-9,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(eta, beta_1, beta_2, tau, weighting, temperature, keep_local_buffers, bn_statistics)

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return self.beta_2 * v + (1.0 - self.beta_2) * delta_sq
