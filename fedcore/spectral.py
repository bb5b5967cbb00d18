"""The thin SVD that FedHM's cuts take of a layer's matrix, at a cost that stays reasonable for huge layers.

LAPACK's SVD (torch.linalg.svd) of a long ``k × l`` matrix (``l`` several times ``k``) takes several times
what its ``k²l`` flops need: a VGG-11 classifier's 4096 × 25088 takes minutes in float64, each round, on the
server (``benchmarks/thin_svd.py``). A matrix of at least :data:`GRAM_MIN_ENTRIES` entries whose long side
is at least :data:`GRAM_MIN_ASPECT` times its short side is decomposed through the smaller Gram matrix
instead: ``A Aᵀ = U Σ² Uᵀ`` by a symmetric eigendecomposition (one ``k²l`` product and a ``k³``
eigensolver), ``Σ Vᵀ = Uᵀ A``, and ``V`` the Q of its QR, which keeps every right vector of a nonzero
singular value (in order, up to rounding) and completes the basis where ``A`` is rank-deficient. In float64
the leading singular values and vectors, the ones a cut keeps, agree with LAPACK's to about ``1e-12``
relative; the Gram matrix loses what lies below ``√ε σ₁`` (``1.5e-8 σ₁``, under the float32 rounding of the
weights it comes from), so a tail that small is noise. Small and square matrices keep LAPACK's SVD, bit for
bit (for square ones it is as fast).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GRAM_MIN_ASPECT", "GRAM_MIN_ENTRIES", "thin_svd"]

#: From this many entries (a 1024 × 1024 matrix's) ...
GRAM_MIN_ENTRIES = 1 << 20
#: ... and this ratio of the long side to the short one, :func:`thin_svd` goes through the Gram matrix.
GRAM_MIN_ASPECT = 2


def thin_svd(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(U, S, Vh)`` of ``matrix`` in float64, ``S`` descending, ``U`` and ``Vh`` with orthonormal columns and
    rows (``full_matrices=False``)."""
    a = matrix.detach().to(torch.float64)
    if a.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(a.shape)}")
    rows, cols = a.shape
    if not bool(torch.isfinite(a).all()):  # LAPACK refuses them; the Gram route would return NaN bases
        raise torch.linalg.LinAlgError(f"thin_svd: the {rows} × {cols} matrix holds non-finite values")
    if rows * cols < GRAM_MIN_ENTRIES or max(rows, cols) < GRAM_MIN_ASPECT * min(rows, cols):
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u, s, vh
    wide = rows <= cols
    b = a if wide else a.T  # (k, l), k ≤ l
    eigenvalues, eigenvectors = torch.linalg.eigh(b @ b.T)  # ascending
    left = eigenvectors.flip(1)
    s = eigenvalues.flip(0).clamp_min(0).sqrt()
    q, r = torch.linalg.qr((left.T @ b).T)  # columns s_i v_i: Q's are the v_i, up to the signs R's diagonal has
    sign = torch.sign(torch.diagonal(r))
    right_t = (q * torch.where(sign == 0, torch.ones_like(sign), sign)).T
    return (left, s, right_t) if wide else (right_t.T, s, left.T)
