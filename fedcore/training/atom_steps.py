"""Step sizes for filter atoms and their coefficients, so ``W = α × D`` moves like a plain conv.

With ``A`` the ``(c_out·c_in, m)`` coefficient matrix, ``D`` the ``(m, k²)`` atoms and ``G`` the
loss gradient with respect to the stacked filters, one SGD step of rate ``η`` on both factors
moves the filters by (to first order)

    ΔW = −η (G DᵀD + A Aᵀ G).

The first term is plain SGD on ``W`` when the atoms are orthonormal; the second amplifies ``G``
by up to ``‖A‖₂²``, the top squared singular value of the coefficients, which is about
``c_out/(3k²)`` at PyTorch's default init (2–20 for the zoo's convs) and grows as training
does. One learning rate for every parameter therefore makes the atoms' path several times
faster than a plain conv, and a plain conv's stable rate diverges. ``scaled`` divides the
atoms' rate by ``max(1, ‖A‖₂²)`` and the coefficients' by ``max(1, ‖D‖₂²)``, recomputed before
every step: each path then moves ``W`` no further than plain SGD, so the product moves at most
twice as far at the same ``η``. FedHM's factor pairs ``W = U V`` obey the same algebra
(``ΔW = −η (G VᵀV + U Uᵀ G)``): ``scaled`` divides ``U``'s rate by ``max(1, ‖V‖₂²)`` and ``V``'s
by ``max(1, ‖U‖₂²)``. ``shared`` keeps the papers' single rate. docs/methods.md has the derivation.

``preconditioned`` (the default) steps atoms as ``scaled`` does and a rank-``r`` factor pair (FedHM's
``U, V``; atoms-lowrank's coefficient factors) by ScaledGD: ``∇U (V Vᵀ + λ)⁻¹`` and ``(UᵀU + λ)⁻¹ ∇V``,
so the product moves by ``−η (G P_V + P_U G)``, plain SGD's step projected on the pair's tangent
space, whatever the singular values: ``scaled`` moves direction ``i`` at ``σ_i/σ_1`` of that, and a
pair cut from a random layer, whose lower ``σ_i`` are small, learns slowly there. ``λ`` is
``DAMPING`` (0.1) times the Gram matrix's mean eigenvalue, so a vanishing direction's step stays bounded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear

__all__ = ["ATOM_LR_RULES", "AtomSteps"]

ATOM_LR_RULES = ("preconditioned", "scaled", "shared")

_COEFFICIENTS = ("coefficients", "coefficients_u", "coefficients_v")

#: ScaledGD's damping, relative to the Gram matrix's mean eigenvalue: a direction whose singular value vanishes
#: moves at most 1/DAMPING times as fast as an average one (docs/methods.md: 1e-2 let FedHM's aligned average of
#: mixed tiers collapse)
DAMPING = 0.1


def _top_squared_singular_value(matrix: torch.Tensor) -> float:
    """``‖M‖₂²`` from the small Gram matrix (``M`` is tall or wide; its short side is ``m`` or ``k²``); infinite
    for a non-finite ``M`` (training has diverged: the factor takes no step, and the check after training says so,
    where ``eigvalsh`` would fail to converge)."""
    m = matrix.detach().to(torch.float64)
    gram = m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T
    if not bool(torch.isfinite(gram).all()):
        return math.inf
    return float(torch.linalg.eigvalsh(gram)[-1])


def _damped_gram(gram: torch.Tensor) -> torch.Tensor:
    """``gram + λ I`` in float64, ``λ = DAMPING`` × the mean eigenvalue (the trace over ``r``)."""
    gram = gram.detach().to(torch.float64)
    r = gram.shape[0]
    damping = DAMPING * torch.trace(gram) / r + 1e-12  # a tensor on the factors' device: no sync per step
    return gram + damping * torch.eye(r, dtype=torch.float64, device=gram.device)


@dataclass(frozen=True)
class _Group:
    """One parameter group beyond the plain ones: a factor of one layer."""

    layer: nn.Module
    factor: str  # lowrank_u, lowrank_v, atoms or coefficients


class AtomSteps:
    """The optimizer's parameter groups for one phase, and the per-step rates of atom layers and factor pairs."""

    def __init__(self, model: nn.Module, params: Mapping[str, nn.Parameter], lr: float, rule: str) -> None:
        if rule not in ATOM_LR_RULES:
            raise ValueError(f"atom_lr must be one of {', '.join(ATOM_LR_RULES)}, got {rule!r}")
        self.lr, self.rule = lr, rule
        taken: set[str] = set()
        groups: list[tuple[_Group, list[nn.Parameter]]] = []
        #: factor pairs W = U V whose gradients ScaledGD preconditions: (U, V, U trains, V trains)
        self._pairs: list[tuple[nn.Parameter, nn.Parameter, bool, bool]] = []
        pair: tuple[str, str] | None
        for path, layer in model.named_modules():
            prefix = f"{path}." if path else ""
            if isinstance(layer, LowRankConv2d | LowRankLinear):
                factors, pair = ["lowrank_u", "lowrank_v"], ("lowrank_u", "lowrank_v")
            elif isinstance(layer, AtomConv2d):
                factors = ["atoms", "coefficients"]
                pair = ("coefficients_u", "coefficients_v") if layer.rank is not None else None
            else:
                continue
            for factor in factors:
                names = [prefix + factor] if factor != "coefficients" else [prefix + c for c in _COEFFICIENTS]
                taken.update(names)
                groups.append((_Group(layer, factor), [params[n] for n in names if n in params]))
            if rule == "preconditioned" and pair is not None:
                u, v = (prefix + f for f in pair)
                if u in params or v in params:
                    self._pairs.append((getattr(layer, pair[0]), getattr(layer, pair[1]), u in params, v in params))
        rest = [p for n, p in params.items() if n not in taken]
        groups = [g for g in groups if g[1]]
        offset = 1 if rest else 0
        #: what ``torch.optim`` takes: the other parameters first, then one group per factor of a layer
        self.param_groups: list[dict] = ([{"params": rest}] if rest else []) + [{"params": p} for _, p in groups]
        self._groups = [(offset + i, group) for i, (group, _) in enumerate(groups)]

    def rescale(self, optimizer: torch.optim.Optimizer) -> None:
        """Set each factor's rate (and precondition pairs' gradients) from the current factors, before every step."""
        with torch.no_grad():
            for index, group in self._groups if self.rule != "shared" else ():  # shared: every group keeps lr
                optimizer.param_groups[index]["lr"] = self.lr / max(1.0, self._energy_of_other(group))
            for u, v, move_u, move_v in self._pairs:
                gram_v, gram_u = _damped_gram(v @ v.T), _damped_gram(u.T @ u)
                if move_u and u.grad is not None:
                    u.grad.copy_(torch.linalg.solve(gram_v, u.grad.to(torch.float64).T).T)
                if move_v and v.grad is not None:
                    v.grad.copy_(torch.linalg.solve(gram_u, v.grad.to(torch.float64)))

    def _energy_of_other(self, group: _Group) -> float:
        """``‖·‖₂²`` of the factor that multiplies this one; a preconditioned pair needs none (ScaledGD's own scale)."""
        layer, factor = group.layer, group.factor
        if factor in ("lowrank_u", "lowrank_v") and self.rule == "preconditioned":
            return 0.0
        if factor == "lowrank_u":  # moves W by ΔU·V
            return _top_squared_singular_value(layer.lowrank_v)  # type: ignore[arg-type]  # nn.Module attributes type as Tensor | Module
        if factor == "lowrank_v":  # moves W by U·ΔV
            return _top_squared_singular_value(layer.lowrank_u)  # type: ignore[arg-type]  # as above
        if factor == "atoms":  # moves W by A·ΔD: bounded by the coefficients' top singular value
            return _top_squared_singular_value(layer.coefficient_tensor().reshape(-1, layer.num_atoms))  # type: ignore[operator]  # as above
        # moves W by Δα·D: bounded by the atoms' top singular value
        return _top_squared_singular_value(layer.atoms.reshape(layer.num_atoms, -1))  # type: ignore[call-overload,operator]  # as above
