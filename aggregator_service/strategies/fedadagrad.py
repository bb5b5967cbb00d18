"""FedAdagrad (Reddi et al. 2021): FedOpt with Adagrad's second moment, ``v ← v + Δ²``.

Defaults are Flower's ``FedAdagrad``: η = 1e-1, τ = 1e-9, and no first-moment momentum (β₁ = 0).
"""

from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor

from aggregator_service.strategies.fedopt import FedOpt

__all__ = ["FedAdagrad"]


class FedAdagrad(FedOpt):
    """Server Adagrad on the pseudo-gradient (see :mod:`aggregator_service.strategies.fedopt`)."""

    name: ClassVar[str] = "fedadagrad"

    def __init__(
        self,
        eta: float = 1e-1,
        beta_1: float = 0.0,
        tau: float = 1e-9,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(eta, beta_1, 1.0, tau, weighting, temperature, keep_local_buffers, bn_statistics)

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return v + delta_sq
