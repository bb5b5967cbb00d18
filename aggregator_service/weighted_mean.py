"""Streaming weighted means and the client weights they use, shared by every strategy.

A round folds its clients one at a time into float64 running means, so closing it costs
O(model) memory whatever the number of clients (the gRPC service reads updates from the
database one by one; the simulator passes them straight from training).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from aggregator_service.updates import ClientUpdate

__all__ = ["WEIGHTINGS", "WeightedMean", "client_weight", "is_float"]

WEIGHTINGS = ("samples", "tier-softmax", "uniform")


def is_float(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is averaged as it is (floating or complex) rather than rounded back."""
    return dtype.is_floating_point or dtype.is_complex


class WeightedMean:
    """Streaming weighted mean and dispersion of named tensors, in float64, in one pass.

    Uses West's weighted form of Welford's update, per tensor::

        W' = W + w;   δ = x − u;   u ← u + (w/W')·δ;   M2 ← M2 + w·(W/W')·‖δ‖²

    (``w·(W/W')·‖δ‖²`` is West's ``w·⟨δ, x − u_new⟩``, since ``x − u_new = (W/W')·δ``), so
    ``mean()`` is ``Σ w_k x_k / Σ w_k`` and ``dispersion()`` is ``M2/W = Σ p_k ‖x_k − u‖²``
    without keeping the clients' tensors or cancelling large sums. Each tensor has its own
    weight sum, so an update may omit tensors. Integer and bool tensors are averaged in
    float and rounded back in :meth:`mean`; results take the dtype of each tensor's first
    contribution.

    Memory is the float64 running means plus one scratch buffer of at most :attr:`CHUNK`
    elements (and no larger than the largest tensor): ``δ`` is formed chunk by chunk in that
    buffer, converting the incoming tensor to float64 once, so folding allocates nothing per
    contribution and each chunk stays in cache between the subtraction, the mean update and
    the dot product.
    """

    CHUNK: ClassVar[int] = 1 << 18  # elements of the float64 scratch buffer (2 MiB)

    def __init__(self) -> None:
        self._mean: dict[str, Tensor] = {}
        self._m2: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._dtype: dict[str, torch.dtype] = {}
        self._scratch: Tensor | None = None
        self.total_weight = 0.0
        self.count = 0

    def _buffer(self, like: Tensor, numel: int) -> Tensor:
        """A float64 scratch of ``numel ≤ CHUNK`` elements on ``like``'s device, reused across calls."""
        scratch = self._scratch
        if scratch is None or scratch.device != like.device or scratch.numel() < numel:
            size = numel if scratch is None else max(numel, min(2 * scratch.numel(), self.CHUNK))
            scratch = self._scratch = torch.empty(size, dtype=torch.float64, device=like.device)
        return scratch[:numel]

    def _fold(self, mean: Tensor, x: Tensor, weight: float, old_weight: float, total: float) -> float:
        """``mean += (w/W')·(x − mean)`` in place; returns ``w·(W/W')·‖x − mean_old‖²``."""
        flat_mean, flat_x = mean.view(-1), x.reshape(-1)
        numel = flat_mean.numel()
        alpha = weight / total
        convert = flat_x.dtype != torch.float64
        chunk = self.CHUNK
        squares = 0.0
        for start in range(0, numel, chunk):
            u, v = (
                (flat_mean, flat_x)
                if numel <= chunk
                else (flat_mean[start : start + chunk], flat_x[start : start + chunk])
            )
            delta = self._buffer(u, u.numel())
            if convert:
                delta.copy_(v)  # the one conversion to float64
                delta.sub_(u)
            else:
                torch.sub(v, u, out=delta)
            u.add_(delta, alpha=alpha)
            squares += float(torch.dot(delta, delta))
        return weight * (old_weight / total) * squares

    def add(self, tensors: Mapping[str, Tensor], weight: float, *, part: bool = False) -> None:
        """Fold one contribution (e.g. one client's aligned tensors) with ``weight > 0``.

        ``part=True`` folds part of a contribution that arrives in several calls (a client's update
        module by module); the caller then counts it once with :meth:`count_contribution`.
        """
        weight = float(weight)
        if not (weight > 0.0 and math.isfinite(weight)):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        for name, tensor in tensors.items():  # check every shape first, so a rejected add changes nothing
            known = self._mean.get(name)
            if known is not None and tuple(tensor.shape) != tuple(known.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, earlier ones {tuple(known.shape)}")
        for name, tensor in tensors.items():
            x = tensor.detach()
            mean = self._mean.get(name)
            if mean is None:
                self._mean[name] = torch.empty(x.shape, dtype=torch.float64, device=x.device).copy_(x)
                self._m2[name] = 0.0
                self._weight[name] = weight
                self._dtype[name] = tensor.dtype
                continue
            old_weight = self._weight[name]
            total = old_weight + weight
            self._m2[name] += self._fold(mean, x, weight, old_weight, total)
            self._weight[name] = total
        if not part:
            self.count_contribution(weight)

    def count_contribution(self, weight: float) -> None:
        """Count one contribution whose tensors were folded with ``add(..., part=True)``."""
        self.total_weight += float(weight)
        self.count += 1

    @property
    def names(self) -> list[str]:
        return list(self._mean)

    def weight(self, name: str) -> float:
        """Sum of the weights of the contributions that held ``name``."""
        return self._weight[name]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of ``name``'s first contribution (the dtype :meth:`mean` returns)."""
        return self._dtype[name]

    def mean(self, cast: bool = True) -> dict[str, Tensor]:
        """Weighted means; with ``cast=False`` the float64 running means themselves (do not modify)."""
        if not cast:
            return dict(self._mean)
        out: dict[str, Tensor] = {}
        for name, mean in self._mean.items():
            dtype = self._dtype[name]
            if is_float(dtype):
                out[name] = mean.to(dtype)
            elif dtype == torch.bool:
                out[name] = mean.round().to(torch.bool)
            else:
                out[name] = mean.round().to(dtype)
        return out

    def dispersion(self) -> dict[str, float]:
        """``Σ_k p_k ‖x_k − u‖²`` per tensor, ``p_k = w_k / Σ w`` over the contributions holding it."""
        return {name: max(0.0, self._m2[name] / self._weight[name]) for name in self._mean}


def client_weight(update: ClientUpdate, weighting: str = "samples", temperature: float = math.inf) -> float:
    """Unnormalized aggregation weight of one update.

    - ``"samples"``: ``n_k`` (FedAvg's ``p_k = n_k / n`` after normalization).
    - ``"tier-softmax"``: ``n_k · exp(γ_k / τ)`` (FedHM eq. 2). FedHM's clients hold
      equal-sized shards, where this is exactly eq. 2's ``softmax(γ/τ)``; with unequal data it
      keeps FedAvg's ``n_k`` weighting and tilts it towards larger tiers. ``τ = ∞`` is FedAvg.
      Computed as ``n_k · exp((γ_k − 1)/τ)`` — the common factor ``exp(1/τ)`` cancels in the
      normalization and the shift keeps small temperatures from overflowing.
    - ``"uniform"``: 1, each client once: the ``(1/|S|) Σ`` of SCAFFOLD, FedDyn and FedDC as published,
      whose server state is a uniform mean over the clients too.
    """
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weighting == "samples":
        return float(update.num_samples)
    if weighting == "tier-softmax":
        weight = update.num_samples * math.exp((update.tier - 1.0) / temperature)
        if weight <= 0.0:
            raise ValueError(f"temperature {temperature:g} is so small that tier {update.tier:g} gets weight 0")
        return weight
    if weighting == "uniform":
        return 1.0
    raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
