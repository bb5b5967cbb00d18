"""FedHM re-factorization: every tier's download from the full-rank global model.

The server keeps one full-rank model; a client of tier γ trains low-rank factors of its
factorized tensors, so each tier's download is cut from the new global tensors by truncated
SVD, once per tensor for all tiers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedcore.spec import ModelSpec, factored_matrix

__all__ = ["refactorize"]


def refactorize(
    global_tensors: Mapping[str, Tensor], tier_specs: Sequence[ModelSpec]
) -> dict[float, dict[str, Tensor]]:
    """Every tier's download: truncated-SVD factors (√Σ split) of the factorized tensors, others as they are.

    Truncated SVDs are nested, so each factorized full-rank tensor is decomposed once and
    sliced at every tier's rank; the result equals ``spec.from_full(global_tensors)`` per
    tier. Un-factorized tensors (and a γ = 1 tier entirely) share storage with
    ``global_tensors``: do not modify them in place.
    """
    svds: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    out: dict[float, dict[str, Tensor]] = {}
    for spec in tier_specs:
        tier: dict[str, Tensor] = {}
        for t in spec.tensors:
            if t.full_name is None:
                tier[t.name] = global_tensors[t.name]
            elif t.role.endswith("_u"):
                full = global_tensors[t.full_name]
                if t.full_name not in svds:
                    matrix = factored_matrix(full).detach().to(torch.float64)
                    svds[t.full_name] = torch.linalg.svd(matrix, full_matrices=False)
                u_, s, vh = svds[t.full_name]
                rank = t.shape[1]
                root = s[:rank].sqrt()
                tier[t.name] = (u_[:, :rank] * root).to(full.dtype)
                tier[t.name[: -len("_u")] + "_v"] = (root[:, None] * vh[:rank]).to(full.dtype)
        out[spec.rank_ratio] = {t.name: tier[t.name] for t in spec.tensors}
    return out
