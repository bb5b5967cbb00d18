"""Adaptive federated optimization (Reddi et al. 2021, Alg. 2): a server optimizer on the pseudo-gradient.

With ``Δ = mean_k y_k − x`` per floating tensor::

    m ← β₁·m + (1 − β₁)·Δ
    v ← second_moment(v, Δ²)         # FedAdagrad, FedAdam, FedYogi differ only here
    x ← x + η·m / (√v + τ)

``m`` and ``v`` start at zero and have no bias correction, as in the paper and Flower's
``fedopt.py`` family, whose defaults each subclass takes (Flower's ``eta_l``, the client's
rate, is the federation's ``lr`` here). State is kept per tensor and survives restarts.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.tensor_state import TensorState
from aggregator_service.weighted_mean import is_float

__all__ = ["FedOpt"]


class FedOpt(FedAvg):
    """The FedOpt template: FedAvg's mean, then a server optimizer step (subclasses give ``v``'s update)."""

    state_tensors: ClassVar[tuple[str, ...]] = ("m", "v")

    def __init__(
        self,
        eta: float,
        beta_1: float,
        beta_2: float,
        tau: float,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if not (eta > 0 and math.isfinite(eta)):
            raise ValueError(f"eta must be > 0, got {eta}")
        if not 0.0 <= beta_1 < 1.0:
            raise ValueError(f"beta_1 must be in [0, 1), got {beta_1}")
        if not 0.0 <= beta_2 <= 1.0:
            raise ValueError(f"beta_2 must be in [0, 1], got {beta_2}")
        if not (tau > 0 and math.isfinite(tau)):
            raise ValueError(f"tau must be > 0, got {tau}")
        self.eta, self.beta_1, self.beta_2, self.tau = float(eta), float(beta_1), float(beta_2), float(tau)
        self.m, self.v = TensorState("m"), TensorState("v")

    @abstractmethod
    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        """``v_t`` from ``v_{t−1}`` and ``Δ_t²`` (float64)."""

    def new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        if not is_float(current.dtype):
            return mean
        x = current.detach().to(mean64.dtype)
        delta = mean64 - x
        self.m.set(name, self.beta_1 * self.m.get64(name, x) + (1.0 - self.beta_1) * delta, current.dtype)
        self.v.set(name, self.second_moment(self.v.get64(name, x), delta * delta), current.dtype)
        m, v = self.m.get64(name, x), self.v.get64(name, x)
        return x + self.eta * m / (v.sqrt() + self.tau)

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m.state(), "v": self.v.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"m", "v"}
        if unknown:
            raise ValueError(f"unknown {self.name} state keys {sorted(unknown)}")
        self.m.load(state.get("m", {}))
        self.v.load(state.get("v", {}))
