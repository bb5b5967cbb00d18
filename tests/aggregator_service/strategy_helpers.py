"""Shared by the strategy, weighted-mean and re-factorization tests: models, random clients, batch references.

References are computed here in batch, independently of the streaming code: weighted sums
over stacked client tensors; the tests add ``spec.to_full`` per client, ``spec.from_full`` per tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aggregator_service.strategies import Strategy
from aggregator_service.updates import AggregateResult, ClientUpdate
from fedcore.spec import ModelSpec

TIERS = (1.0, 0.5, 0.25, 0.125)
LENET = ModelSpec("lenet-cifar10", 10, "atoms-lowrank")
DIGITS = ModelSpec("digits-cnn", 10, "none")


def random_tensors(spec: ModelSpec, gen: torch.Generator, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Random values for every tensor of ``spec`` (ints for integer tensors)."""
    out = {}
    for t in spec.tensors:
        torch_dtype = getattr(torch, t.dtype)
        if torch_dtype.is_floating_point:
            out[t.name] = torch.randn(t.shape, generator=gen, dtype=dtype or torch_dtype)
        else:
            out[t.name] = torch.randint(0, 1000, t.shape, generator=gen, dtype=torch_dtype)
    return out


def update(
    spec: ModelSpec, tensors: dict[str, Tensor], n: int, cid: str, control_delta: dict[str, Tensor] | None = None
) -> ClientUpdate:
    return ClientUpdate(cid, n, spec.rank_ratio, spec, tensors, control_delta)


def run_round(
    strategy: Strategy, global_tensors: dict[str, Tensor], updates: list[ClientUpdate], due: list[str] | None = None
) -> AggregateResult:
    acc = strategy.begin(global_tensors, list(global_tensors) if due is None else due)
    for u in updates:
        strategy.fold(acc, u)
    return strategy.finish(acc, global_tensors)


def batch_mean(xs: list[Tensor], weights: Sequence[float]) -> tuple[Tensor, float]:
    """Reference weighted mean and Σ p‖x − u‖², in float64 over the stacked tensors."""
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    stack = torch.stack([x.to(torch.float64) for x in xs])
    u = torch.einsum("k,k...->...", p, stack)
    disp = float(p @ ((stack - u) ** 2).reshape(len(xs), -1).sum(1))
    return u, disp
