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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear

__all__ = ["ATOM_LR_RULES", "AtomSteps"]

ATOM_LR_RULES = ("scaled", "shared")

_COEFFICIENTS = ("coefficients", "coefficients_u", "coefficients_v")


def _top_squared_singular_value(matrix: torch.Tensor) -> float:
    """``‖M‖₂²`` from the small Gram matrix (``M`` is tall or wide; its short side is ``m`` or ``k²``)."""
    m = matrix.detach().to(torch.float64)
    gram = m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T
    return float(torch.linalg.eigvalsh(gram)[-1])


class AtomSteps:
    """The optimizer's parameter groups for one phase, and the per-step rates of atom layers."""

    def __init__(self, model: nn.Module, params: Mapping[str, nn.Parameter], lr: float, rule: str) -> None:
        if rule not in ATOM_LR_RULES:
            raise ValueError(f"atom_lr must be one of {', '.join(ATOM_LR_RULES)}, got {rule!r}")
        self.lr = lr
        taken: set[str] = set()
        scaled: list[tuple[nn.Module, str, list[nn.Parameter]]] = []  # (layer, which factor, its parameters)
        if rule == "scaled":
            for path, layer in model.named_modules():
                prefix = f"{path}." if path else ""
                if isinstance(layer, LowRankConv2d | LowRankLinear):
                    for factor in ("lowrank_u", "lowrank_v"):
                        scaled.append((layer, factor, [params[n] for n in (prefix + factor,) if n in params]))
                        taken.add(prefix + factor)
                    continue
                if not isinstance(layer, AtomConv2d):
                    continue
                atoms = [params[n] for n in (f"{prefix}atoms",) if n in params]
                coefficients = [params[n] for n in (prefix + c for c in _COEFFICIENTS) if n in params]
                scaled += [(layer, "atoms", atoms), (layer, "coefficients", coefficients)]
                taken.update(f"{prefix}{n}" for n in ("atoms", *_COEFFICIENTS))
        rest = [p for n, p in params.items() if n not in taken]
        scaled = [s for s in scaled if s[2]]
        offset = 1 if rest else 0
        #: what ``torch.optim`` takes: the unscaled parameters first, then one group per scaled factor
        self.param_groups: list[dict] = ([{"params": rest}] if rest else []) + [{"params": p} for _, _, p in scaled]
        self._scaled = [(offset + i, layer, factor) for i, (layer, factor, _) in enumerate(scaled)]

    def rescale(self, optimizer: torch.optim.Optimizer) -> None:
        """Set each atom layer's rates from its current factors (before every optimizer step)."""
        with torch.no_grad():
            for index, layer, factor in self._scaled:
                if factor == "lowrank_u":  # moves W by ΔU·V
                    other = layer.lowrank_v
                elif factor == "lowrank_v":  # moves W by U·ΔV
                    other = layer.lowrank_u
                elif factor == "atoms":  # moves W by A·ΔD: bounded by the coefficients' top singular value
                    other = layer.coefficient_tensor().reshape(-1, layer.num_atoms)
                else:  # moves W by Δα·D: bounded by the atoms' top singular value
                    other = layer.atoms.reshape(layer.num_atoms, -1)
                optimizer.param_groups[index]["lr"] = self.lr / max(1.0, _top_squared_singular_value(other))
