"""thin_svd against LAPACK's SVD (torch.linalg.svd), the independent oracle: the same leading singular values and
subspaces, orthonormal bases, the matrix rebuilt, on the huge matrices it decomposes through the Gram matrix."""

from __future__ import annotations

import pytest
import torch

from fedcore.spectral import GRAM_MIN_ENTRIES, thin_svd


def _decaying(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A matrix with a layer's spectrum: σ_i = 1 / (1 + i/8), directions at random."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    s = 1.0 / (1.0 + torch.arange(k, dtype=torch.float64) / 8)
    return (u * s) @ v.T


def _check_orthonormal(m: torch.Tensor, dim: int) -> None:
    gram = m.T @ m if dim == 1 else m @ m.T
    torch.testing.assert_close(gram, torch.eye(gram.shape[0], dtype=gram.dtype), atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [(1024, 2048), (2048, 1024)])
def test_a_huge_matrix_decomposes_as_lapack_does(shape: tuple[int, int]) -> None:
    a = _decaying(*shape, seed=0)
    assert a.numel() >= GRAM_MIN_ENTRIES
    u, s, vh = thin_svd(a.to(torch.float32))
    ref_u, ref_s, ref_vh = torch.linalg.svd(a.to(torch.float32).to(torch.float64), full_matrices=False)
    k = min(shape)
    assert u.shape == (shape[0], k) and s.shape == (k,) and vh.shape == (k, shape[1])
    assert u.dtype == s.dtype == vh.dtype == torch.float64
    torch.testing.assert_close(s, ref_s, atol=1e-12, rtol=0)
    _check_orthonormal(u, 1)
    _check_orthonormal(vh, 0)
    torch.testing.assert_close((u * s) @ vh, a.to(torch.float32).to(torch.float64), atol=1e-12, rtol=0)
    # the leading 64 directions, what a ⅛ cut keeps, are LAPACK's up to sign (σ distinct: gaps ≥ 1e-4)
    top = 64
    torch.testing.assert_close((u[:, :top] * ref_u[:, :top]).sum(0).abs(), torch.ones(top, dtype=torch.float64))
    torch.testing.assert_close((vh[:top] * ref_vh[:top]).sum(1).abs(), torch.ones(top, dtype=torch.float64))
    # and U, V pair up: the same sign on both sides, so the rank-r cut is LAPACK's
    r = 64
    torch.testing.assert_close((u[:, :r] * s[:r]) @ vh[:r], (ref_u[:, :r] * ref_s[:r]) @ ref_vh[:r], atol=1e-11, rtol=0)


def test_a_rank_deficient_matrix_gets_a_whole_orthonormal_basis() -> None:
    """Rank 10 (a layer started at zero and trained a little, say): the tail's right vectors are a completion,
    orthonormal all the same, and the matrix is rebuilt to the Gram matrix's precision, √ε σ₁ (ε = 2⁻⁵², so
    1.5e-8 σ₁: under the float32 rounding of the weights it is taken from)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1024, 10, generator=g, dtype=torch.float64) @ torch.randn(
        10, 2048, generator=g, dtype=torch.float64
    )
    u, s, vh = thin_svd(a)
    assert s[10:].max() < 1e-6 * s[0]
    _check_orthonormal(u, 1)
    _check_orthonormal(vh, 0)
    assert ((u * s) @ vh - a).abs().max() < 1e-7 * s[0]
    u, s, vh = thin_svd(torch.zeros(1024, 2048))
    assert not s.any()
    _check_orthonormal(u, 1)
    _check_orthonormal(vh, 0)


@pytest.mark.parametrize("shape", [(192, 96), (1536, 1536)])
def test_a_small_or_square_matrix_keeps_lapacks_svd_bit_for_bit(shape: tuple[int, int]) -> None:
    a = _decaying(*shape, seed=2).to(torch.float32)
    for got, want in zip(thin_svd(a), torch.linalg.svd(a.to(torch.float64), full_matrices=False), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(8, 8), (1024, 2048)])
def test_non_finite_values_are_refused_on_either_route(shape: tuple[int, int]) -> None:
    a = torch.zeros(shape)
    a[3, 5] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError):
        thin_svd(a)


def test_not_a_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a matrix"):
        thin_svd(torch.zeros(4, 4, 4))
