"""Mixed tiers averaged where they hold: each entry of a factorized tensor from the clients that can move it.

A client of rank ``r`` starts from the global tensor's truncated SVD ``W = L S Rᵀ`` cut at ``r``,
and its factor pair ``U V`` moves ``W`` only within ``{L_r A + B R_rᵀ}`` (to first order): in the
basis ``(L, R)``, the entries ``(i, j)`` with ``min(i, j) < r``. FedHM's aligned average (eq. 1)
counts that client's zeros everywhere else, so every round the entries past a tier's rank shrink by
that tier's share of the weight, and what the larger tiers learn there is mostly averaged away.
HeteroFL's rule for width-sliced models, each parameter the weighted mean of the clients that hold
it, carried into this basis gives each of the ``k × k`` entries of ``W``'s own singular coordinates
(``k = min(m, n)``) the mean of its holders. An entry that some tier of the federation holds but no
client of this round does (a cohort drawn without a tier-1 client) keeps its global value, as a
HeteroFL parameter no client held keeps its own: FedHM's average would put the low tiers' zeros
there and cut the global model to the round's largest rank. An entry no tier holds keeps FedHM's
average, so a single-tier federation is FedHM exactly; so does whatever lies outside ``W``'s row
and column spaces (directions the global tensor does not have yet: treating those as held by the
full-rank tiers alone amplified a few clients' noise there, docs/methods.md).

``TIER_AVERAGES``: ``"held"`` (this rule) or ``"aligned"`` (FedHM's eq. 1 as printed).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from aggregator_service.refactorization import Spectra
from aggregator_service.updates import ClientUpdate
from fedcore.spec import factored_matrix, tensor_from_matrix

__all__ = ["TIER_AVERAGES", "HeldAverage"]

TIER_AVERAGES = ("held", "aligned")


class HeldAverage:
    """One round's correction: the global tensors' singular bases and the parts low tiers do not hold."""

    def __init__(
        self, global_tensors: Mapping[str, Tensor], reach: Mapping[str, int], spectra: Spectra | None = None
    ) -> None:
        self._global = global_tensors
        #: full name → the largest rank a tier of the federation trains it at (absent: some tier holds it whole)
        self._reach = reach
        self._spectra = spectra if spectra is not None else Spectra()  # the tiers' cuts decompose the same tensors
        self._bases: dict[str, tuple[Tensor, Tensor]] = {}  # full name → (L, Rᵀ) of its matrix, float64
        self._unheld: dict[str, Tensor] = {}  # Σ_k p_k (1 − held_k) ⊙ Lᵀ X_k R
        self._rank_weights: dict[str, dict[int, float]] = {}  # rank → Σ p_k of the low-rank clients

    def fold(self, update: ClientUpdate, aligned: Mapping[str, Tensor], weight: float) -> None:
        """Record the entries ``update``'s factor pairs cannot move (``aligned``: its full-rank values)."""
        for t in update.spec.tensors:
            if t.full_name is None or not t.role.endswith("_u") or t.full_name not in aligned:
                continue
            self.fold_tensor(t.full_name, aligned[t.full_name], t.shape[1], weight)

    def fold_tensor(self, name: str, value: Tensor, rank: int, weight: float) -> None:
        left, right_t = self._basis(name)
        size = left.shape[1]
        if rank >= size:
            return  # full rank: holds every entry
        unheld = ~held_entries(size, rank)
        in_basis = left.T @ factored_matrix(value).to(torch.float64) @ right_t.T
        if name not in self._unheld:
            self._unheld[name] = torch.zeros(size, size, dtype=torch.float64)
        self._unheld[name] += weight * torch.where(unheld, in_basis, 0.0)
        weights = self._rank_weights.setdefault(name, {})
        weights[rank] = weights.get(rank, 0.0) + weight

    def correct(self, name: str, mean: Tensor, total: float) -> Tensor:
        """The holders' mean from the round's plain weighted ``mean`` (float64) of ``total`` weight."""
        if name not in self._unheld:
            return mean
        left, right_t = self._bases[name]
        matrix = factored_matrix(mean).to(torch.float64)
        in_basis = left.T @ matrix @ right_t.T
        size = in_basis.shape[0]
        unheld_weight = sum(w * ~held_entries(size, r) for r, w in self._rank_weights[name].items())
        holders = total - unheld_weight
        # coordinates some but not all clients hold (sums of the same weights: compare with a tolerance)
        partial = (holders > total * 1e-9) & (unheld_weight > total * 1e-9)
        # coordinates a tier of the federation holds and no client of this round does
        kept = (holders <= total * 1e-9) & held_entries(size, self._reach.get(name, size))
        if not bool(partial.any()) and not bool(kept.any()):
            return mean  # one rank for every client, or no tier holds: FedHM's average, to the bit
        _, s, _ = self._spectra.of(name, self._global[name])
        held = torch.where(
            partial,
            (total * in_basis - self._unheld[name]) / torch.where(partial, holders, 1.0),
            torch.where(kept, torch.diag(s), in_basis),  # the global tensor is diag(s) in its own basis
        )
        return tensor_from_matrix(matrix + left @ (held - in_basis) @ right_t, mean.shape)

    def _basis(self, name: str) -> tuple[Tensor, Tensor]:
        if name not in self._bases:
            left, _, right_t = self._spectra.of(name, self._global[name])
            self._bases[name] = (left, right_t)
        return self._bases[name]


def held_entries(size: int, rank: int) -> Tensor:
    """``(size, size)`` mask of the entries a rank-``rank`` factor pair moves: row or column index below ``rank``."""
    index = torch.arange(size)
    return torch.minimum(index[:, None], index[None, :]) < rank
