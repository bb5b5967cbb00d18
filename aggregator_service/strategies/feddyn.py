"""FedDyn (Acar et al. 2021, Alg. 1): a dynamic regularizer that aligns the clients' minima with the global one.

Client ``k`` minimizes ``L_k(θ) − ⟨∇L_k, θ⟩ + α/2‖θ − x‖²`` and keeps ``∇L_k ← ∇L_k − α(y_k − x)``
(:class:`fedcore.training.terms.LocalTerms`, state ``gradient``, on the client only). The
server keeps ``h ← h − α·(1/N) Σ_{k∈S}(y_k − x)`` and sets ``x ← mean_k y_k − h/α`` on the
trainable tensors (buffers are averaged). The paper uses α = 0.01 (the decomposition
paper's Table 1 too). α = 0 turns the regularizer off on both sides: ``h`` stays zero and
the round is FedAvg's (the limit α → 0 is not: ``h/α`` keeps the summed drift).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.strategies.base import RoundAccumulator, Setting
from aggregator_service.strategies.drift import DriftAccumulator, DriftFold, mean_drift, trainable_shapes
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.tensor_state import TensorState, follow_enrolment
from aggregator_service.updates import AggregateResult, ClientUpdate
from fedcore.spec import ModelSpec

__all__ = ["FedDyn", "refuse_drift"]


def refuse_drift(name: str, setting: Setting) -> str | None:
    """FedDyn's and FedDC's shared limits: one parameter space, and every round starts from ``x``."""
    if setting.low_rank:
        return (
            f"{name} keeps per-client state in the full model's parameter space, and a low-rank client trains "
            "factors of it: use tiers = [1]"
        )
    if setting.interval_policy != "every_round":
        return (
            f"{name}'s state tracks each round's move from the model the clients started from, and intervals "
            "leave tensors unsynchronized across rounds: use interval_policy = every_round"
        )
    return None


class FedDyn(DriftFold, FedAvg):
    """FedDyn with weight ``alpha``; ``num_clients_total`` is ``N`` (the service keeps it current)."""

    name: ClassVar[str] = "feddyn"
    state_tensors: ClassVar[tuple[str, ...]] = ("h",)

    def __init__(
        self,
        num_clients_total: int,
        alpha: float = 0.01,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
        spec: ModelSpec | None = None,
        fp16_transport: bool = False,
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if num_clients_total < 1:
            raise ValueError(f"num_clients_total must be ≥ 1, got {num_clients_total}")
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be ≥ 0, got {alpha}")
        self.num_clients_total = int(num_clients_total)
        self.alpha = float(alpha)
        self.spec = spec
        self.fp16_transport = fp16_transport  # the clients' drifts start from x as fp16 delivers it
        self.h = TensorState("h")
        self._averaged_over: int | None = None  # the N h is a mean over (follow_enrolment)

    @classmethod
    def refuse(cls, setting: Setting) -> str | None:
        return refuse_drift("FedDyn", setting)

    def client_config(self) -> dict[str, Any]:
        return {"feddyn_alpha": self.alpha} if self.alpha > 0 else {}

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return DriftAccumulator(due, shapes)

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if update.tier != 1.0:
            raise ValueError(f"client {update.client_id}: {self.name} needs full-rank (γ = 1) clients")
        super().fold(acc, update)

    @property
    def keeps_the_mean(self) -> bool:
        return self.alpha == 0  # h ≡ 0: FedAvg

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        if not isinstance(acc, DriftAccumulator):
            raise TypeError(f"{type(self).__name__}.finish needs the accumulator its begin returned")
        self._averaged_over = follow_enrolment([self.h.values], self._averaged_over, self.num_clients_total)
        result = super().finish(acc, global_tensors)
        if self.alpha == 0:
            return result  # no regularizer, h ≡ 0: FedAvg
        means = acc.tensors.mean(cast=False)
        for name, drift in mean_drift(acc, global_tensors, self.num_clients_total, self.fp16_transport).items():
            dtype = global_tensors[name].dtype
            self.h.set(name, self.h.get64(name, drift) - self.alpha * drift, dtype)
            result.tensors[name] = (means[name] - self.h.get64(name, drift) / self.alpha).to(dtype)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h.state(), "averaged_over": self._averaged_over}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._averaged_over = state.get("averaged_over")  # absent (saved before it was kept): today's N
        state = {k: v for k, v in state.items() if k != "averaged_over"}
        unknown = set(state) - {"h"}
        if unknown:
            raise ValueError(f"unknown FedDyn state keys {sorted(unknown)}")
        self.h.load(state.get("h", {}), trainable_shapes(self.spec) if self.spec is not None else None)
