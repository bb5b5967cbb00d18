"""FedProx (Li et al.): the server is FedAvg; the proximal term lives in the clients' loss."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from aggregator_service.strategies.fedavg import FedAvg

__all__ = ["FedProx"]


class FedProx(FedAvg):
    """FedProx: the server is FedAvg; clients add ``(μ/2)‖w − w_global‖²`` to their loss."""

    name: ClassVar[str] = "fedprox"

    def __init__(
        self,
        mu: float = 0.01,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if not (mu >= 0.0 and math.isfinite(mu)):
            raise ValueError(f"mu must be ≥ 0, got {mu}")
        self.mu = float(mu)

    def client_config(self) -> dict[str, Any]:
        return {"prox_mu": self.mu}
