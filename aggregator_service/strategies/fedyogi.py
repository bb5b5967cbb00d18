"""FedYogi (Reddi et al. 2021): FedOpt with Yogi's second moment, ``v ← v − (1 − β₂)·Δ²·sign(v − Δ²)``.

Defaults are Flower's ``FedYogi``: η = 1e-2, β₁ = 0.9, β₂ = 0.99, τ = 1e-3.
"""

from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor

from aggregator_service.strategies.fedopt import FedOpt

__all__ = ["FedYogi"]


class FedYogi(FedOpt):
    """Server Yogi on the pseudo-gradient (see :mod:`aggregator_service.strategies.fedopt`)."""

    name: ClassVar[str] = "fedyogi"

    def __init__(
        self,
        eta: float = 1e-2,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(eta, beta_1, beta_2, tau, weighting, temperature, keep_local_buffers, bn_statistics)

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return v - (1.0 - self.beta_2) * delta_sq * (v - delta_sq).sign()
