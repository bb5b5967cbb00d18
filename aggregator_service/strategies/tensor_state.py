"""Per-tensor server state (momentum, Adam's moments, FedDyn's ``h``, FedDC's drift), restart-exact.

Values are zeros until first written and are kept in the tensor's own dtype, exactly what
the store writes, so a restarted aggregator continues bit for bit; updates are computed
in float64 from them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["TensorState", "follow_enrolment"]


class TensorState:
    """One named group of server tensors, e.g. FedAvgM's ``momentum``."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.values: dict[str, Tensor] = {}

    def get64(self, name: str, like: Tensor) -> Tensor:
        """The state of ``name`` in float64 (zeros shaped like ``like`` before its first write)."""
        held = self.values.get(name)
        if held is None:
            return torch.zeros(like.shape, dtype=torch.float64)
        return held.to(torch.float64)

    def set(self, name: str, value: Tensor, dtype: torch.dtype) -> None:
        self.values[name] = value.to(dtype)

    def state(self) -> dict[str, Tensor]:
        return {n: t.clone() for n, t in self.values.items()}

    def load(self, values: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Restore a saved group; with ``shapes``, every tensor must belong to the model and fit it."""
        loaded = {n: torch.as_tensor(t).detach().clone() for n, t in values.items()}
        for name, t in loaded.items():
            if shapes is not None and shapes.get(name) != tuple(t.shape):
                raise ValueError(f"{self.label} state {name!r} with shape {tuple(t.shape)} does not fit the model")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{self.label} state {name!r} holds non-finite values")
        self.values = loaded


def follow_enrolment(groups: list[dict[str, Tensor]], averaged_over: int | None, clients: int) -> int:
    """Rescale state that is a mean over all ``N`` clients, ``(1/N) Σ_i s_i`` (SCAFFOLD's ``c``, FedDyn's
    ``h``, FedDC's ``H``), from the ``N`` it was averaged over to ``clients`` now enrolled, in place; returns
    ``clients``. The sum ``Σ_i s_i`` does not change when a client enrolls (its ``s_i`` starts at zero) or
    leaves, but ``1/N`` does: without this, a round closed when few had enrolled kept its ``1/N`` for good."""
    if averaged_over is not None and averaged_over != clients:
        factor = averaged_over / clients
        for group in groups:
            for name, t in group.items():
                group[name] = (t.to(torch.float64) * factor).to(t.dtype)
    return clients
