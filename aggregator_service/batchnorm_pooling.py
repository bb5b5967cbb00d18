"""BatchNorm statistics pooled over the clients' data: the law of total variance.

A BatchNorm layer's ``running_mean`` μ_k and ``running_var`` σ²_k describe client k's
activations. All clients' data together have mean μ̄ = Σ p_k μ_k and variance
Σ p_k (σ²_k + μ_k²) − μ̄²: the clients' variances plus the spread of their means. The plain
average Σ p_k σ²_k leaves out the spread, which non-IID clients (each with its own classes)
make large, so a model normalized by it over-scales every activation at test time. FedAvg
therefore folds each client's second moment σ²_k + μ_k² in ``running_var``'s place and turns
the mean back into a variance at the close (HeteroFL's static BatchNorm computes the same
global statistics by querying the clients one after another). With ``bn_statistics =
"running"`` the statistics are averaged like any other tensor, FedAvg's literal rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

__all__ = ["BN_MEAN", "BN_VAR", "pooled_variances", "second_moments", "variance_pairs"]

BN_MEAN, BN_VAR = "running_mean", "running_var"


def variance_pairs(names: Iterable[str]) -> dict[str, str]:
    """``{running_var name: running_mean name}`` for every layer of which both are in ``names``."""
    present = set(names)
    pairs: dict[str, str] = {}
    for name in present:
        prefix, _, leaf = name.rpartition(".")
        if leaf == BN_VAR:
            mean = f"{prefix}.{BN_MEAN}" if prefix else BN_MEAN
            if mean in present:
                pairs[name] = mean
    return pairs


def second_moments(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` with each paired ``running_var`` σ² replaced by the second moment σ² + μ² (float64)."""
    out = dict(tensors)
    for var, mean in variance_pairs(tensors).items():
        mu = tensors[mean].to(torch.float64)
        out[var] = tensors[var].to(torch.float64) + mu * mu
    return out


def pooled_variances(means: Mapping[str, Tensor], pairs: Mapping[str, str]) -> dict[str, Tensor]:
    """The pooled variance E[σ² + μ²] − μ̄² (float64, never below 0) of each pair, from the clients'
    mean second moments and mean means."""
    out: dict[str, Tensor] = {}
    for var, mean in pairs.items():
        mu = means[mean].to(torch.float64)
        out[var] = (means[var].to(torch.float64) - mu * mu).clamp_min(0.0)
    return out
