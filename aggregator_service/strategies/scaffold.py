"""SCAFFOLD (Karimireddy et al.): FedAvg with a server step and control variates kept across rounds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from aggregator_service.strategies.base import RoundAccumulator, Setting
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.tensor_state import follow_enrolment
from aggregator_service.updates import AggregateResult, ClientUpdate
from aggregator_service.weighted_mean import WeightedMean, is_float
from fedcore.spec import ModelSpec

__all__ = ["Scaffold", "ScaffoldAccumulator"]


@dataclass
class ScaffoldAccumulator(RoundAccumulator):
    """Adds the uniform mean of the clients' control deltas ``Δc_k``."""

    controls: WeightedMean = field(default_factory=WeightedMean)


def _trainable(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in spec.tensors if t.role != "buffer"}


class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al., option II) with server step ``η_g`` and control variates.

    ``x ← x + η_g · Σ_k p_k (y_k − x)`` over the due tensors (``η_g = 1`` is FedAvg exactly) and,
    for every tensor the clients report a delta for, ``c ← c + (|S|/N) · (1/|S|) Σ_k Δc_k`` — a
    uniform mean over the reporting clients ``S`` of ``N`` in the federation. The control
    update covers all trainable tensors, due or not, since clients update ``c_k`` every round.
    ``N`` below the cohort size is treated as full participation (ratio 1). Controls start at
    zero and are stored sparsely: :meth:`server_control` fills zeros for tensors never updated.

    Only full-rank (γ = 1) clients are supported: controls live in the full model's
    parameter space and a low-rank client's gradients do not.
    """

    name: ClassVar[str] = "scaffold"
    state_tensors: ClassVar[tuple[str, ...]] = ("server_control",)

    @classmethod
    def refuse(cls, setting: Setting) -> str | None:
        if setting.low_rank:
            return "SCAFFOLD's control variates live in full-rank space: use tiers = [1]"
        if setting.factorization.startswith("atoms") and setting.atom_lr != "shared":
            return (
                "SCAFFOLD's control variates assume one learning rate for every parameter, and atom_lr = "
                f"{setting.atom_lr} gives atoms and coefficients their own: use atom_lr = shared with atoms"
            )
        return None

    def __init__(
        self,
        num_clients_total: int,
        global_lr: float = 1.0,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
        spec: ModelSpec | None = None,
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers, bn_statistics)
        if num_clients_total < 1:
            raise ValueError(f"num_clients_total must be ≥ 1, got {num_clients_total}")
        if not (global_lr > 0.0 and math.isfinite(global_lr)):
            raise ValueError(f"global_lr must be > 0, got {global_lr}")
        self.num_clients_total = int(num_clients_total)
        self.global_lr = float(global_lr)
        self.spec = spec.full() if spec is not None else None
        self._controls: dict[str, Tensor] = {}
        self._averaged_over: int | None = None  # the N the controls are a mean over (follow_enrolment)

    def client_config(self) -> dict[str, Any]:
        return {"scaffold": True}

    def server_control(self, spec: ModelSpec | None = None) -> dict[str, Tensor]:
        """The server control ``c``: one tensor per trainable full-rank tensor of ``spec`` (zeros if never updated).

        Without ``spec`` (and none given at construction) only the tensors updated so far,
        which is every trainable tensor once a round has closed.

        Raises
        ------
        ValueError
            When no spec is known and no round has closed yet: the zeros' names and shapes
            are unknown (build the strategy with ``spec=`` or pass one here).
        """
        spec = spec.full() if spec is not None else self.spec
        if spec is None:
            if not self._controls:
                raise ValueError(
                    "SCAFFOLD's initial (zero) server control needs the model: build Scaffold with spec=… "
                    "or call server_control(spec)"
                )
            return {n: c.clone() for n, c in self._controls.items()}
        out = {}
        for t in spec.tensors:
            if t.role == "buffer":
                continue
            stored = self._controls.get(t.name)
            out[t.name] = stored.clone() if stored is not None else torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
        return out

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return ScaffoldAccumulator(due, shapes)

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if not isinstance(acc, ScaffoldAccumulator):
            raise TypeError("Scaffold.fold needs the accumulator Scaffold.begin returned")
        if update.tier != 1.0:
            raise ValueError(
                f"client {update.client_id}: SCAFFOLD needs full-rank (γ = 1) clients, got tier {update.tier:g}"
            )
        if update.control_delta is None:
            raise ValueError(f"client {update.client_id}: SCAFFOLD needs the client's control delta")
        trainable = _trainable(update.spec)
        for name, delta in update.control_delta.items():
            if name not in trainable:
                raise ValueError(f"client {update.client_id}: control delta {name!r} is not a trainable tensor")
            if tuple(delta.shape) != trainable[name]:
                raise ValueError(
                    f"client {update.client_id}: control delta {name!r} has shape {tuple(delta.shape)}, "
                    f"expected {trainable[name]}"
                )
        super().fold(acc, update)
        acc.controls.add(update.control_delta, 1.0)

    @property
    def keeps_the_mean(self) -> bool:
        return self.global_lr == 1.0  # its finish adds the controls, and η_g = 1 keeps FedAvg's mean

    def new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        if self.global_lr == 1.0 or not is_float(current.dtype):
            return mean  # η_g = 1 returns FedAvg's value bit for bit
        x = current.detach().to(torch.float64)
        return x + self.global_lr * (mean64 - x)

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        if not isinstance(acc, ScaffoldAccumulator):
            raise TypeError("Scaffold.finish needs the accumulator Scaffold.begin returned")
        self._averaged_over = follow_enrolment(self._means_over_clients(), self._averaged_over, self.num_clients_total)
        result = super().finish(acc, global_tensors)
        reporting = acc.controls.count
        if reporting:
            ratio = min(reporting, self.num_clients_total) / self.num_clients_total
            for name, mean_delta in acc.controls.mean(cast=False).items():
                previous = self._controls.get(name)
                dtype = previous.dtype if previous is not None else acc.controls.dtype(name)
                base = previous.to(torch.float64) if previous is not None else torch.zeros_like(mean_delta)
                self._controls[name] = (base + ratio * mean_delta).to(dtype)
        return result

    def _means_over_clients(self) -> list[dict[str, Tensor]]:
        """The state that is a mean over all N clients (rescaled when N changes)."""
        return [self._controls]

    def state_dict(self) -> dict[str, Any]:
        return {
            "server_control": {n: c.clone() for n, c in self._controls.items()},
            "averaged_over": self._averaged_over,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # a state saved before averaged_over was kept: taken as a mean over today's N
        self._averaged_over = state.get("averaged_over")
        state = {k: v for k, v in state.items() if k != "averaged_over"}
        unknown = set(state) - {"server_control"}
        if unknown:
            raise ValueError(f"unknown {self.name} state keys {sorted(unknown)}")
        controls = state.get("server_control", {})
        if self.spec is not None:
            trainable = _trainable(self.spec)
            for name, c in controls.items():
                if trainable.get(name) != tuple(c.shape):
                    raise ValueError(f"SCAFFOLD control {name!r} with shape {tuple(c.shape)} does not fit the model")
        self._controls = {n: torch.as_tensor(c).detach().clone() for n, c in controls.items()}
