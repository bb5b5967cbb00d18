"""FedDC (Gao et al. 2022, Alg. 1): local drift decoupling and correction.

Each client keeps a drift ``h_i`` and a control ``c_i`` (:class:`fedcore.training.terms.LocalTerms`,
states ``drift`` and ``control``) and minimizes ``L_i(θ) + α/2‖θ + h_i − x‖² + ⟨θ, c − c_i⟩``
(the second is SCAFFOLD's gradient correction, ``c_i`` updated by option II); after the
round ``h_i ← h_i + (θ_i − x)``. The server keeps SCAFFOLD's ``c`` and the mean drift of all
``N`` clients ``H ← H + (1/N) Σ_{i∈S}(θ_i − x)``, and sets ``x ← mean_i θ_i + H`` on the
trainable tensors (the official code's ``avg_mdl_param_sel + mean(parameter_drifts)``).
What travels is SCAFFOLD's: ``c`` down, ``Δc_i`` up; drifts stay with their owners. α = 0.01
as the official code's default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.strategies.base import RoundAccumulator, Setting
from aggregator_service.strategies.drift import DriftAccumulator, DriftFold, mean_drift, trainable_shapes
from aggregator_service.strategies.feddyn import refuse_drift
from aggregator_service.strategies.scaffold import Scaffold
from aggregator_service.strategies.tensor_state import TensorState
from aggregator_service.updates import AggregateResult
from fedcore.spec import ModelSpec

__all__ = ["FedDC"]


class FedDC(DriftFold, Scaffold):
    """FedDC with drift penalty ``alpha``: SCAFFOLD's controls plus the clients' mean drift."""

    name: ClassVar[str] = "feddc"
    state_tensors: ClassVar[tuple[str, ...]] = ("server_control", "drift")

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
        super().__init__(
            num_clients_total, 1.0, weighting, temperature, keep_local_buffers, bn_statistics=bn_statistics, spec=spec
        )
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be ≥ 0, got {alpha}")
        self.alpha = float(alpha)
        self.fp16_transport = fp16_transport  # the clients' drifts start from x as fp16 delivers it
        self.drift = TensorState("drift")

    @classmethod
    def refuse(cls, setting: Setting) -> str | None:
        return refuse_drift("FedDC", setting) or super().refuse(setting)

    def client_config(self) -> dict[str, Any]:
        return {"scaffold": True, "feddc_alpha": self.alpha}

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return DriftAccumulator(due, shapes)

    @property
    def keeps_the_mean(self) -> bool:
        return False  # the mean plus the drift

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        if not isinstance(acc, DriftAccumulator):
            raise TypeError(f"{type(self).__name__}.finish needs the accumulator its begin returned")
        result = super().finish(acc, global_tensors)
        means = acc.tensors.mean(cast=False)
        for name, drift in mean_drift(acc, global_tensors, self.num_clients_total, self.fp16_transport).items():
            dtype = global_tensors[name].dtype
            self.drift.set(name, self.drift.get64(name, drift) + drift, dtype)
            result.tensors[name] = (means[name] + self.drift.get64(name, drift)).to(dtype)
        return result

    def _means_over_clients(self) -> list[dict[str, Tensor]]:
        return [*super()._means_over_clients(), self.drift.values]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "drift": self.drift.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "drift"})
        self.drift.load(state.get("drift", {}), trainable_shapes(self.spec) if self.spec is not None else None)
