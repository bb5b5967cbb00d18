"""FedHM re-factorization: every tier's download from the full-rank global model.

The server keeps one full-rank model; a client of tier γ trains low-rank factors of its
factorized tensors, so each tier's download is cut from the new global tensors by truncated
SVD, once per tensor for all tiers.

A tensor no client has trained yet is an initialization, not a fit to keep: its top ``r``
singular values hold only part of its energy (about ``r`` of ``min(m, n)`` shares of a random
matrix), so the truncated layer's outputs start several times smaller than the plain layer's,
which PyTorch's init sized to keep activations' variance. ``TIER_INITS``: ``"energy"`` scales such
a cut's singular values to the full tensor's Frobenius norm (same directions, the variance of the
plain layer's outputs); ``"truncated"`` is FedHM's spectral initialization as printed.

``"nested"``: with mixed tiers trained nested (:mod:`fedcore.training.nested`) every tier trains the
smallest tier's cut as that tier's model, yet under ``"energy"`` a larger tier's first cut is the plain
truncation. ``energy_ranks`` scales only a tensor's top ``r`` singular values (``r`` the smallest tier's
rank) to the tensor's norm, in every tier's download, the full-rank one included, and leaves the rest
as they are, so every tier starts from the cut the smallest tier gets. Faster early, not at the end
(docs/methods.md), hence not the default.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from fedcore.spec import ModelSpec, factored_matrix, pair_v, tensor_from_matrix
from fedcore.spectral import thin_svd

__all__ = ["TIER_INITS", "Spectra", "refactorize"]

#: how a tier's factors are cut from a tensor no client has trained yet (module docstring)
TIER_INITS = ("energy", "truncated", "nested")


class Spectra:
    """The SVD of each factorized global tensor's matrix, computed once while the tensor stays the same.

    The tiers' cuts (:func:`refactorize`) and the held average's bases
    (:class:`~aggregator_service.held_average.HeldAverage`) decompose the same round-start tensors:
    with one ``Spectra`` they share each decomposition instead of each paying for its own. An entry
    is reused only for the very tensor object it was computed from, unmodified since (its in-place
    version counter), so a new global tensor is decomposed anew; the previous one's entry is
    dropped then.
    """

    def __init__(self) -> None:
        # a weak reference: a replaced global tensor is not kept alive for its entry
        self._svds: dict[str, tuple[weakref.ref[Tensor], int, tuple[Tensor, Tensor, Tensor]]] = {}

    def of(self, name: str, full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(U, S, Vh)`` of ``factored_matrix(full)`` in float64 (thin SVD)."""
        hit = self._svds.get(name)
        if hit is not None and hit[0]() is full and hit[1] == full._version:
            return hit[2]
        u, s, vh = thin_svd(factored_matrix(full))
        svd = (u, s, vh)  # returned as stored, not read back: a close's fork may store another tensor's meanwhile
        self._svds[name] = (weakref.ref(full), full._version, svd)
        return svd


def refactorize(
    global_tensors: Mapping[str, Tensor],
    tier_specs: Sequence[ModelSpec],
    keep_energy: Collection[str] = (),
    spectra: Spectra | None = None,
    energy_ranks: Mapping[str, int] | None = None,
) -> dict[float, dict[str, Tensor]]:
    """Every tier's download: truncated-SVD factors (√Σ split) of the factorized tensors, others as they are.

    Truncated SVDs are nested, so each factorized full-rank tensor is decomposed once and
    sliced at every tier's rank; the result equals ``spec.from_full(global_tensors)`` per
    tier. Full-rank tensors named in ``keep_energy`` are cut with their kept singular values
    scaled to the whole tensor's Frobenius norm (``"energy"`` in :data:`TIER_INITS`); with
    ``energy_ranks`` (full-rank name → the smallest tier's rank) only that many top values are
    scaled, the same in every tier (module docstring). ``spectra`` shares the decompositions with
    the round's held average.
    Un-factorized tensors (and a γ = 1 tier entirely) share storage with ``global_tensors``:
    do not modify them in place.
    """
    spectra = spectra if spectra is not None else Spectra()
    energy_ranks = energy_ranks or {}
    out: dict[float, dict[str, Tensor]] = {}
    for spec in tier_specs:
        tier: dict[str, Tensor] = {}
        for t in spec.tensors:
            if t.full_name is None:
                full = global_tensors[t.name]
                if t.name in energy_ranks and t.name in keep_energy:
                    u_, s, vh = spectra.of(t.name, full)
                    matrix = (u_ * _nested_energy(s, energy_ranks[t.name])) @ vh
                    tier[t.name] = tensor_from_matrix(matrix, tuple(full.shape)).to(full.dtype)
                else:
                    tier[t.name] = full
            elif t.role.endswith("_u"):
                full = global_tensors[t.full_name]
                u_, s, vh = spectra.of(t.full_name, full)
                rank = t.shape[1]
                kept = s[:rank]
                if t.full_name in keep_energy:
                    if t.full_name in energy_ranks:
                        kept = _nested_energy(s, energy_ranks[t.full_name])[:rank]
                    else:
                        kept = kept * _energy_ratio(s, rank)
                root = kept.sqrt()
                tier[t.name] = (u_[:, :rank] * root).to(full.dtype)
                tier[pair_v(t.name)] = (root[:, None] * vh[:rank]).to(full.dtype)
        out[spec.rank_ratio] = {t.name: tier[t.name] for t in spec.tensors}
    return out


def _energy_ratio(s: Tensor, rank: int) -> Tensor:
    """``‖σ‖ / ‖σ[:rank]‖``: the factor that gives the rank-``rank`` cut the whole tensor's Frobenius norm."""
    kept = s[:rank].square().sum()
    if kept <= 0:
        return torch.ones((), dtype=s.dtype)  # a zero tensor: nothing to restore
    return (s.square().sum() / kept).sqrt()


def _nested_energy(s: Tensor, rank: int) -> Tensor:
    """``s`` with its top ``rank`` values scaled to the whole tensor's norm, the rest unchanged."""
    return torch.cat([s[:rank] * _energy_ratio(s, rank), s[rank:]])
