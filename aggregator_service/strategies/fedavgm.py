"""FedAvgM (Hsu et al. 2019): server momentum on the pseudo-gradient ``Δ = mean_k y_k − x``.

``v ← β·v + Δ``, ``x ← x + η·v`` per floating tensor, as Flower's ``FedAvgM``
(``server_learning_rate = 1``, ``server_momentum``); ``β = 0, η = 1`` is FedAvg.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.tensor_state import TensorState
from aggregator_service.weighted_mean import is_float

__all__ = ["FedAvgM"]


class FedAvgM(FedAvg):
    """FedAvg with server momentum ``β`` and server learning rate ``η``."""

    name: ClassVar[str] = "fedavgm"
    state_tensors: ClassVar[tuple[str, ...]] = ("momentum",)

    def __init__(
        self,
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.9,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if not (server_learning_rate > 0 and math.isfinite(server_learning_rate)):
            raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate}")
        if not 0.0 <= server_momentum < 1.0:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}")
        self.server_learning_rate = float(server_learning_rate)
        self.server_momentum = float(server_momentum)
        self.momentum = TensorState("momentum")

    def new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        if not is_float(current.dtype):
            return mean
        x = current.detach().to(mean64.dtype)
        v = self.server_momentum * self.momentum.get64(name, x) + (mean64 - x)
        self.momentum.set(name, v, current.dtype)
        return x + self.server_learning_rate * self.momentum.get64(name, x)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"momentum"}
        if unknown:
            raise ValueError(f"unknown FedAvgM state keys {sorted(unknown)}")
        self.momentum.load(state.get("momentum", {}))
