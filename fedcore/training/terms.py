"""The optional terms a method adds to plain SGD, each off unless its method asks for it.

FedProx's proximal term and FedHM's Frobenius decay are penalties on the loss; SCAFFOLD's
control variates correct the gradient instead, so here they are only checked and placed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, factors_to_matrix

__all__ = ["combine", "control_on", "factor_pairs", "frobenius_penalty", "proximal_penalty", "step_weight"]


def factor_pairs(model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """Every low-rank factor pair ``(U, V)`` the Frobenius decay acts on, named by module.

    ``lowrank_u``/``lowrank_v`` of FedHM's layers and ``coefficients_u``/``coefficients_v`` of
    low-rank :class:`AtomConv2d` (the ``α`` matrix a γ < 1 tier trains as factors).
    """
    pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    for name, module in model.named_modules():
        if isinstance(module, LowRankConv2d | LowRankLinear):
            pairs.append((name, module.lowrank_u, module.lowrank_v))
        elif isinstance(module, AtomConv2d) and module.rank is not None:
            pairs.append((name, module.coefficients_u, module.coefficients_v))
    return pairs


def frobenius_penalty(model: nn.Module, lam: float) -> Callable[[], Tensor | None]:
    """FedHM's FD: ``(λ/2)·‖U V‖_F²`` per trainable pair; its gradient is ``λ·UVVᵀ`` and ``λ·UᵀUV``."""
    pairs = [(u, v) for _, u, v in factor_pairs(model) if u.requires_grad and v.requires_grad]

    def penalty() -> Tensor | None:
        if not pairs:
            return None
        return (lam / 2) * sum(factors_to_matrix(u, v).pow(2).sum() for u, v in pairs)  # type: ignore[return-value]

    return penalty


def proximal_penalty(
    params: Mapping[str, nn.Parameter], start: Mapping[str, Tensor], mu: float
) -> Callable[[], Tensor]:
    """FedProx: ``(μ/2)·‖w − w_start‖²`` over every trainable parameter."""

    def penalty() -> Tensor:
        return (mu / 2) * sum((p - start[n]).pow(2).sum() for n, p in params.items())  # type: ignore[return-value]

    return penalty


def combine(*terms: Callable[[], Tensor | None] | None) -> Callable[[], Tensor | None] | None:
    """The sum of the active terms, or ``None`` when none is, so plain SGD builds no extra graph."""
    active = [t for t in terms if t is not None]
    if not active:
        return None

    def penalty() -> Tensor | None:
        total: Tensor | None = None
        for term in active:
            value = term()
            if value is not None:
                total = value if total is None else total + value
        return total

    return penalty


def control_on(
    name: str, control: Mapping[str, Tensor], params: Mapping[str, nn.Parameter], device: torch.device
) -> dict[str, Tensor]:
    """Validate a SCAFFOLD control (one tensor per trainable parameter) and move it to ``device``."""
    missing = set(params) - set(control)
    extra = set(control) - set(params)
    if missing or extra:
        raise ValueError(
            f"{name} must hold exactly the trainable parameters; "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
        )
    out = {}
    for key, p in params.items():
        if tuple(control[key].shape) != tuple(p.shape):
            raise ValueError(f"{name}[{key!r}] has shape {tuple(control[key].shape)}, expected {tuple(p.shape)}")
        out[key] = control[key].detach().to(device=device, dtype=p.dtype)
    return out


def step_weight(steps: int, lr: float, momentum: float) -> float:
    """How far ``steps`` SGD steps move a parameter per unit of constant gradient: SCAFFOLD's ``K·η``.

    Option II estimates a client's gradient as ``(x − y_i)/(K·η)``, which holds for plain SGD.
    With heavy-ball momentum ``β`` (restarted every round, as the local optimizer is) the
    gradient of step ``s`` of ``K`` moves the parameter by ``η·(1 − β^(K−s+1))/(1 − β)`` in all,
    so ``x − y_i = Σ_s w_s g_s`` with ``Σ_s w_s = η/(1 − β)·(K − β(1 − β^K)/(1 − β))``; dividing
    by that sum makes ``c_i⁺`` a weighted mean of the local gradients again. At ``β = 0`` it is
    ``K·η``; at the papers' ``β = 0.9`` and ``K = 20`` dividing by ``K·η`` instead overstates
    ``c_i⁺`` six-fold and SCAFFOLD diverges.
    """
    if momentum == 0.0:
        return steps * lr
    return lr / (1.0 - momentum) * (steps - momentum * (1.0 - momentum**steps) / (1.0 - momentum))
