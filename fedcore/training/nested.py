"""Mixed tiers trained as nested models: a larger tier trains the smallest tier's part of its model as that
smallest model, and its extra rank as a residual on top of it.

A client of the smallest tier (rank ``r`` per factorized tensor) trains and runs the global model cut to
``r``. A larger client holds that cut and more. Trained as FedHM prints it, each tier fits its own model:
the larger tiers fit the shared part together with their extra rank, the smallest tier fits it alone, and
their average is neither; in a mixture the model and its cut both end below a federation of the smallest
tier alone (docs/methods.md, "Why larger tiers train the smallest tier's model"). Here a larger client
takes two losses a step:

- the loss of its model cut to ``r``, whose gradient trains the cut's entries and every tensor that is
  not factorized (the smallest tier's whole model);
- the loss of its whole model, whose gradient trains only the entries past the cut (the rest detached).

So every tier trains the shared entries for one objective, the smallest model's, and the extra rank
learns what that model misses. The cut of each factorized tensor a client holds at a larger rank:

- a dense tensor: its entries in the round's starting singular basis ``(L, R)`` with ``min(i, j) < r``,
  ``P_L W + W P_R − P_L W P_R``, the entries a rank-``r`` factor pair cut from it moves (to first order,
  the held entries of aggregator_service.held_average);
- a factor pair ``U V``: its first ``r`` components ``U[:, :r] V[:r]``, the top ``r`` directions of the
  server's nested SVD cut.

Only a client above the federation's smallest tier does this; the smallest tier, a single-tier federation
and plain FedAvg train as before, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.spec import ModelSpec, factored_matrix, pair_v, tensor_from_matrix
from fedcore.spectral import thin_svd

__all__ = ["TIER_TRAININGS", "NestedCut", "NestedPasses", "nested_cut"]

#: How mixed tiers train: "nested" (this module) or "own" (each tier its own model, FedHM as printed).
TIER_TRAININGS = ("nested", "own")


@dataclass(frozen=True)
class NestedCut:
    """The smallest tier's rank of each factorized tensor a client holds at a larger rank."""

    dense: Mapping[str, int]  # a full-rank tensor → the smallest tier's rank
    pairs: Mapping[str, tuple[str, int]]  # a pair's U → (its V, the smallest tier's rank)


def nested_cut(spec: ModelSpec, smallest: float) -> NestedCut | None:
    """What a client of ``spec``'s tier trains as the model of the tier ``smallest``; ``None`` when it is that
    tier (or holds no factorized tensor at a larger rank)."""
    ranks = spec.at_tier(smallest).pair_ranks
    dense: dict[str, int] = {}
    pairs: dict[str, tuple[str, int]] = {}
    for t in spec.tensors:
        if t.full_name is None and t.name in ranks:
            dense[t.name] = ranks[t.name]
        elif t.full_name in ranks and t.role.endswith("_u") and t.shape[1] > ranks[t.full_name]:
            pairs[t.name] = (pair_v(t.name), ranks[t.full_name])
    return NestedCut(dense, pairs) if dense or pairs else None


class NestedPasses:
    """One phase's two forward passes a step; the cut's bases come from the parameters' starting values.
    Tensors of the cut that do not train (a frozen layer) stay as they are in both passes."""

    def __init__(self, cut: NestedCut, params: Mapping[str, nn.Parameter]) -> None:
        self._bases: dict[str, tuple[Tensor, Tensor]] = {}  # dense name → (L_r, R_r)
        for name, rank in cut.dense.items():
            if name in params:
                p = params[name]
                matrix = factored_matrix(p.detach()).to("cpu", torch.float64)
                left, _, right_t = thin_svd(matrix)
                self._bases[name] = (
                    left[:, :rank].to(p.device, p.dtype),
                    right_t[:rank].T.contiguous().to(p.device, p.dtype),
                )
        self._masks: dict[str, Tensor] = {}  # a pair's factor → 1 on its first r components
        for u_name, (v_name, rank) in cut.pairs.items():
            for name, dim in ((u_name, 1), (v_name, 0)):
                if name in params:
                    p = params[name]
                    kept = (torch.arange(p.shape[dim], device=p.device) < rank).to(p.dtype)
                    self._masks[name] = kept[None, :] if dim == 1 else kept[:, None]

    @property
    def empty(self) -> bool:
        """Whether no tensor of the cut trains: the step is the plain one."""
        return not self._bases and not self._masks

    def _project(self, name: str, w: Tensor) -> Tensor:
        """``P_L W + W P_R − P_L W P_R`` in ``W``'s factorized matrix form, back in its shape."""
        left, right = self._bases[name]
        matrix = factored_matrix(w)
        in_left = left.T @ matrix
        return tensor_from_matrix(
            left @ in_left + (matrix @ right) @ right.T - left @ (in_left @ right) @ right.T, w.shape
        )

    def _cut(self, name: str, p: Tensor) -> Tensor:
        if name in self._bases:
            return self._project(name, p)
        if name in self._masks:
            return p * self._masks[name]
        return p

    def _residual(self, name: str, p: Tensor) -> Tensor:
        """``p`` as the whole model uses it, with a gradient only past the cut."""
        if name in self._bases:
            shared = self._project(name, p)
            return shared.detach() + (p - shared)
        if name in self._masks:
            mask = self._masks[name]
            return p.detach() * mask + p * (1 - mask)
        return p.detach()

    def losses(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        x: Tensor,
        y: Tensor,
        check_classes: Callable[[int], None] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The whole model's logits and loss, and the cut's loss; the cut's pass leaves the model's buffers
        (BatchNorm's running statistics) as the whole model's pass leaves them. ``check_classes`` gets the
        logits' width before the losses are taken."""
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        cut_logits = torch.func.functional_call(
            model, {**{n: self._cut(n, p) for n, p in params.items()}, **buffers}, (x,)
        )
        logits = torch.func.functional_call(model, {n: self._residual(n, p) for n, p in params.items()}, (x,))
        if check_classes is not None:
            check_classes(logits.shape[-1])
        return logits, F.cross_entropy(logits, y), F.cross_entropy(cut_logits, y)
