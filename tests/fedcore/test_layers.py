"""Tests for fedcore.layers: DCF atom convs, FedHM low-rank layers and their pure reshapes.

Identities are checked in float64 (an autouse fixture switches the default dtype) against
reference computations written independently of the module (broadcast-sum reconstruction,
the spec's literal reshape-based two-layer form, SVD via torch.linalg).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fedcore.layers import (
    RANK_FLOOR,
    AtomConv2d,
    LowRankConv2d,
    LowRankLinear,
    atoms_from_filters,
    coefficients_to_matrix,
    conv_weight_to_matrix,
    factors_to_matrix,
    matrix_to_coefficients,
    matrix_to_conv_weight,
    matrix_to_factors,
    orthonormal_atoms,
    rank_for,
    reconstruct_filter,
)

TOL = {"rtol": 1e-10, "atol": 1e-10}
HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _float64_seed_single_thread():
    # One intra-op thread: these tensors are tiny, and on a shared 2-core box thread
    # contention makes each small conv ~100× slower than running it single-threaded.
    old_dtype, old_threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old_dtype)
    torch.set_num_threads(old_threads)


# --------------------------------------------------------------------------- references


def ref_weight(coefficients: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """W[o,i] = Σ_q α[o,i,q] D_q, by broadcasting (independent of the module's einsum)."""
    return (coefficients[:, :, :, None, None] * atoms[None, None]).sum(dim=2)


def ref_two_layer(x, coefficients, atoms, bias, stride, padding, dilation):
    """The spec's literal DCF form (filter-decomposition.md §1.2): reshape x to (N·c_in, 1, H, W),
    convolve with the atoms, reshape to (N, c_in·m, H', W'), then a 1×1 coefficient conv."""
    n, c, h, w = x.shape
    o, _, m = coefficients.shape
    k = atoms.shape[-1]
    z = F.conv2d(x.reshape(n * c, 1, h, w), atoms.reshape(m, 1, k, k), None, stride, padding, dilation)
    z = z.reshape(n, c * m, z.shape[-2], z.shape[-1])
    return F.conv2d(z, coefficients.reshape(o, c * m, 1, 1), bias)


def grads(out: torch.Tensor, upstream: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * upstream).sum(), wrt, retain_graph=True)


def with_context(context: str):
    """A ``msg`` for assert_close that keeps its mismatch report and appends ``context``."""
    return lambda report: f"{report}\n[{context}]"


def assert_all_close(a, b, context: str = ""):
    assert len(a) == len(b)
    for n, (ta, tb) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(ta, tb, **TOL, msg=with_context(f"gradient #{n} {context}"))


def atoms_for(k: int, which: str) -> int:
    return {"below": k * k // 2, "equal": k * k, "above": k * k + 3}[which]


def discarded_norm(matrix: torch.Tensor, rank: int) -> float:
    s = torch.linalg.svdvals(matrix.to(torch.float64))
    return float(s[rank:].pow(2).sum().sqrt())


# --------------------------------------------------------------------------- 1. AtomConv2d, full coefficients


def _check_atomconv(stride, padding, dilation, k, m, bias):
    layer = AtomConv2d(2, 3, k, num_atoms=m, stride=stride, padding=padding, dilation=dilation, bias=bias)
    x = torch.randn(2, 2, 12, 13, requires_grad=True)
    wrt = [x, layer.atoms, layer.coefficients] + ([layer.bias] if bias else [])

    y_dense = layer(x, path="dense")
    y_atoms = layer(x, path="atoms")
    y_default = layer(x)
    y_conv = F.conv2d(x, layer.weight, layer.bias, stride, padding, dilation)
    y_ref = F.conv2d(x, ref_weight(layer.coefficients, layer.atoms), layer.bias, stride, padding, dilation)
    y_lit = ref_two_layer(x, layer.coefficients, layer.atoms, layer.bias, stride, padding, dilation)

    for y in (y_atoms, y_default, y_conv, y_ref, y_lit):
        assert y.shape == y_dense.shape
        torch.testing.assert_close(y, y_dense, **TOL)
    # output size agrees with the layer's own arithmetic (used for MAC counts)
    assert layer.macs_per_sample(12, 13) == 3 * 2 * k * k * y_dense.shape[-2] * y_dense.shape[-1]

    g = torch.randn_like(y_dense)
    g_dense = grads(y_dense, g, wrt)
    assert all(t.abs().sum() > 0 for t in g_dense)
    for y in (y_atoms, y_default, y_conv, y_ref, y_lit):
        assert_all_close(grads(y, g, wrt), g_dense)


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("padding", [0, 1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_atomconv_three_forms_agree(stride, padding, dilation, k):
    """conv2d(x, α×D) == layer(path="dense") == layer(path="atoms") == the spec's literal two-layer
    form, in outputs and in gradients w.r.t. x, atoms, coefficients and bias."""
    for which, bias in itertools.product(("below", "equal", "above"), (True, False)):
        try:
            _check_atomconv(stride, padding, dilation, k, atoms_for(k, which), bias)
        except AssertionError as e:
            raise AssertionError(f"num_atoms {which} k², bias={bias}: {e}") from e


def test_atomconv_full_coefficients_defaults_to_dense_and_rejects_unknown_path(monkeypatch):
    layer = AtomConv2d(2, 3, 3, num_atoms=9)
    calls = []
    monkeypatch.setattr(layer, "_two_layer", lambda x: calls.append(1) or x)
    layer(torch.randn(1, 2, 6, 6))
    assert calls == []
    with pytest.raises(ValueError, match="unknown path"):
        layer(torch.randn(1, 2, 6, 6), path="sparse")


def test_atomconv_tuple_geometry_and_nonsquare_input():
    layer = AtomConv2d(3, 4, (3, 3), num_atoms=6, stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    x = torch.randn(2, 3, 9, 14)
    y = layer(x, path="atoms")
    torch.testing.assert_close(y, F.conv2d(x, layer.weight, layer.bias, (2, 1), (1, 2), (1, 2)), **TOL)
    torch.testing.assert_close(y, layer(x, path="dense"), **TOL)
    assert layer.macs_per_sample(9, 14) == 4 * 3 * 9 * y.shape[-2] * y.shape[-1]


# --------------------------------------------------------------------------- 2. AtomConv2d, low-rank coefficients


def _check_atomconv_lowrank(stride, padding, dilation, k, bias, rank):
    m = 4  # i·m = 8 ≥ o = 4, so rank 4 is the largest allowed
    layer = AtomConv2d(2, 4, k, num_atoms=m, stride=stride, padding=padding, dilation=dilation, bias=bias, rank=rank)
    assert "coefficients" not in dict(layer.named_parameters())
    x = torch.randn(2, 2, 12, 11, requires_grad=True)
    wrt = [x, layer.atoms, layer.coefficients_u, layer.coefficients_v] + ([layer.bias] if bias else [])

    coeff = (layer.coefficients_u @ layer.coefficients_v).reshape(4, 2, m)
    torch.testing.assert_close(layer.coefficient_tensor(), coeff, **TOL)

    y_dense = layer(x, path="dense")
    y_atoms = layer(x, path="atoms")
    y_factored = layer(x, path="factored")
    y_default = layer(x)
    y_conv = F.conv2d(x, layer.weight, layer.bias, stride, padding, dilation)
    y_ref = F.conv2d(x, ref_weight(coeff, layer.atoms), layer.bias, stride, padding, dilation)
    y_lit = ref_two_layer(x, coeff, layer.atoms, layer.bias, stride, padding, dilation)
    for y in (y_atoms, y_factored, y_default, y_conv, y_ref, y_lit):
        torch.testing.assert_close(y, y_dense, **TOL)

    g = torch.randn_like(y_dense)
    g_dense = grads(y_dense, g, wrt)
    assert all(t.abs().sum() > 0 for t in g_dense)
    for y in (y_atoms, y_factored, y_default, y_conv, y_ref, y_lit):
        assert_all_close(grads(y, g, wrt), g_dense)


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("stride", [1, 2])
def test_atomconv_lowrank_three_forms_agree(stride, padding, dilation, k):
    """Same three-way identity with coefficients held as u (o, r) @ v (r, i·m); grads w.r.t. u, v, atoms."""
    for bias, rank in itertools.product((True, False), (1, 2, 4)):
        try:
            _check_atomconv_lowrank(stride, padding, dilation, k, bias, rank)
        except AssertionError as e:
            raise AssertionError(f"bias={bias}, rank={rank}: {e}") from e


def _macs(o, i, m, k, r, ho, wo):
    dense = o * i * k * k * ho * wo
    two_layer = (i * m * k * k + i * m * r + r * o) * ho * wo
    factored = (r * i * k * k + r * o) * ho * wo
    return dense, two_layer, factored


@pytest.mark.parametrize(
    ("c_in", "c_out", "m", "r", "k", "stride", "padding", "expected"),
    [
        (64, 64, 9, 8, 3, 1, 1, "factored"),  # wide layer, small rank: U·(V×D) is far cheaper
        (64, 64, 9, 8, 3, 2, 1, "factored"),
        (2, 3, 9, 3, 3, 1, 1, "dense"),  # tiny layer, rank as large as allowed: reconstruct-then-conv
        (3, 4, 12, 4, 3, 1, 0, "dense"),
    ],
)
def test_atomconv_lowrank_path_choice_and_macs(monkeypatch, c_in, c_out, m, r, k, stride, padding, expected):
    layer = AtomConv2d(c_in, c_out, k, num_atoms=m, stride=stride, padding=padding, rank=r)
    h, w = 8, 7
    x = torch.randn(1, c_in, h, w)
    y_dense = layer(x, path="dense")
    ho, wo = y_dense.shape[-2:]
    dense, two_layer, factored = _macs(c_out, c_in, m, k, r, ho, wo)
    assert (factored < dense) == (expected == "factored")

    assert layer.macs_per_sample(h, w) == min(dense, factored)
    assert layer.macs_per_sample(h, w, path="dense") == dense
    assert layer.macs_per_sample(h, w, path="atoms") == two_layer
    assert layer.macs_per_sample(h, w, path="factored") == factored

    real_factored = layer._factored
    calls = []

    def spy(inp):
        calls.append(1)
        return real_factored(inp)

    monkeypatch.setattr(layer, "_factored", spy)
    y_default = layer(x)
    assert (len(calls) == 1) == (expected == "factored")
    torch.testing.assert_close(y_default, y_dense, **TOL)
    torch.testing.assert_close(layer(x, path="atoms"), y_dense, **TOL)
    torch.testing.assert_close(layer(x, path="factored"), y_dense, **TOL)


def test_full_coefficient_layer_has_no_factored_path():
    layer = AtomConv2d(3, 4, 3, num_atoms=9)
    with pytest.raises(ValueError, match="unknown path"):
        layer(torch.randn(1, 3, 5, 5), path="factored")
    with pytest.raises(ValueError, match="unknown path"):
        layer.macs_per_sample(5, 5, path="factored")


# --------------------------------------------------------------------------- 3. from_conv


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("k", "m"), [(3, 9), (3, 12), (5, 25), (5, 30), (1, 1), (1, 3)])
def test_from_conv_exact_when_atoms_span(k, m, bias):
    conv = nn.Conv2d(3, 4, k, stride=2, padding=1, dilation=2 if k > 1 else 1, bias=bias)
    layer = AtomConv2d.from_conv(conv, num_atoms=m)
    assert (layer.weight - conv.weight).abs().max().item() < 1e-10
    assert layer.stride == (2, 2) and layer.padding == (1, 1) and layer.dilation == conv.dilation
    assert (layer.bias is None) == (not bias)
    x = torch.randn(2, 3, 9, 10)
    for path in ("dense", "atoms"):
        assert (layer(x, path=path) - conv(x)).abs().max().item() < 1e-10
    if m <= k * k:
        d = layer.atoms.reshape(m, k * k)
        torch.testing.assert_close(d @ d.T, torch.eye(m), **TOL)
    else:  # surplus atoms: unit-norm, zero coefficients
        assert torch.all(layer.coefficients[..., k * k :] == 0)
        torch.testing.assert_close(layer.atoms.reshape(m, -1).norm(dim=1), torch.ones(m), **TOL)


@pytest.mark.parametrize(("k", "m"), [(3, 1), (3, 4), (3, 8), (5, 9), (5, 24)])
def test_from_conv_error_is_discarded_singular_mass(k, m):
    conv = nn.Conv2d(6, 5, k, bias=False)  # 30 stacked filters ≥ k², so every singular value is nonzero
    layer = AtomConv2d.from_conv(conv, num_atoms=m)
    err = float(torch.linalg.matrix_norm((layer.weight - conv.weight).detach().reshape(-1, k * k)))
    expected = discarded_norm(conv.weight.detach().reshape(6 * 5, k * k), m)
    assert expected > 1e-3  # the truncation really discards something
    assert math.isclose(err, expected, rel_tol=1e-9, abs_tol=1e-12)
    # the coefficients are exactly the projections of the filters onto the orthonormal atoms
    d = layer.atoms.reshape(m, k * k)
    torch.testing.assert_close(d @ d.T, torch.eye(m), **TOL)
    proj = conv.weight.detach().reshape(30, k * k) @ d.T
    torch.testing.assert_close(layer.coefficients.reshape(30, m), proj, **TOL)


def test_atoms_from_filters_shapes_and_dtype():
    w = torch.randn(3, 2, 3, 3, dtype=torch.float32)
    coefficients, atoms = atoms_from_filters(w, 5)
    assert coefficients.shape == (3, 2, 5) and atoms.shape == (5, 3, 3)
    assert coefficients.dtype == atoms.dtype == torch.float32


# --------------------------------------------------------------------------- 4. fresh init


@pytest.mark.parametrize("k", [1, 3, 5])
def test_orthonormal_atoms(k):
    for m in range(1, k * k + 1):
        d = orthonormal_atoms(m, k).reshape(m, k * k)
        torch.testing.assert_close(d @ d.T, torch.eye(m), **TOL)
    over = orthonormal_atoms(k * k + 4, k).reshape(k * k + 4, k * k)
    torch.testing.assert_close(over.norm(dim=1), torch.ones(k * k + 4), **TOL)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(orthonormal_atoms(4, k, generator=g1), orthonormal_atoms(4, k, generator=g2))


def test_orthonormal_atoms_follow_default_dtype():
    torch.set_default_dtype(torch.float32)
    assert orthonormal_atoms(4, 3).dtype == torch.float32


@pytest.mark.parametrize(("m", "rank"), [(4, None), (9, None), (12, None), (9, 8), (9, 64), (4, 16)])
def test_fresh_init_is_kaiming_scale(m, rank):
    layer = AtomConv2d(64, 64, 3, num_atoms=m, rank=rank)
    if m <= 9:
        d = layer.atoms.reshape(m, 9)
        torch.testing.assert_close(d @ d.T, torch.eye(m), **TOL)
    var = float(layer.weight.detach().var())
    target = 2.0 / (64 * 9)
    assert target / 1.5 < var < target * 1.5, (var, target)
    bound = 1.0 / math.sqrt(64 * 9)
    assert layer.bias is not None and float(layer.bias.detach().abs().max()) <= bound


def test_lowrank_layers_fresh_init_has_default_scale():
    """Fresh factors carry Kaiming (fan_out) / nn.Linear variance in their product, without an SVD."""
    torch.manual_seed(0)
    conv = LowRankConv2d(64, 64, 3, rank=16)
    assert conv.weight.var().item() == pytest.approx(2.0 / (64 * 9), rel=0.15)
    linear = LowRankLinear(512, 256, 32)
    assert linear.weight.var().item() == pytest.approx(1.0 / (3 * 512), rel=0.15)
    conv = LowRankConv2d(8, 6, 3, rank=5)
    assert conv.bias is None
    assert torch.all(LowRankConv2d(8, 6, 3, rank=5, bias=True).bias == 0)


# --------------------------------------------------------------------------- 5. LowRankConv2d


@pytest.mark.parametrize("dilation", [1, 2, (2, 1)])
@pytest.mark.parametrize("padding", [0, 1, (1, 2)])
@pytest.mark.parametrize("stride", [1, 2, (2, 1)])
def test_lowrank_conv_forward_is_exact_unrolling(stride, padding, dilation):
    """1×k conv (v) then k×1 conv (u) == conv2d with the unrolled weight, non-square input, grads to u and v."""
    for k, bias in itertools.product((3, 5), (True, False)):
        for rank in (1, 4, 3 * k):  # 3·k = min(o·k, i·k) with i = 3
            layer = LowRankConv2d(3, 4, k, rank, stride=stride, padding=padding, dilation=dilation, bias=bias)
            if bias:
                with torch.no_grad():
                    layer.bias.normal_()
            x = torch.randn(2, 3, 13, 11, requires_grad=True)
            y = layer(x)
            weight = matrix_to_conv_weight(layer.lowrank_u @ layer.lowrank_v, 4, 3, k)  # the unrolling, undone
            ctx = f"k={k}, bias={bias}, rank={rank}"
            msg = with_context(ctx)
            torch.testing.assert_close(
                y, F.conv2d(x, weight, layer.bias, layer.stride, layer.padding, layer.dilation), **TOL, msg=msg
            )
            y_w = F.conv2d(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation)
            torch.testing.assert_close(y, y_w, **TOL, msg=msg)

            wrt = [x, layer.lowrank_u, layer.lowrank_v] + ([layer.bias] if bias else [])
            g = torch.randn_like(y)
            g_layer = grads(y, g, wrt)
            assert all(t.abs().sum() > 0 for t in g_layer), ctx
            assert_all_close(g_layer, grads(y_w, g, wrt), ctx)


def test_lowrank_conv_macs():
    layer = LowRankConv2d(3, 4, 3, rank=2, padding=1)
    assert layer.macs_per_sample(8, 6) == 8 * 6 * 2 * 3 * (3 + 4)
    strided = LowRankConv2d(3, 4, 3, rank=2, stride=2, padding=1)
    ho, wo = strided(torch.randn(1, 3, 9, 8)).shape[-2:]
    # the 1×k conv strides along W only, so it runs at full input height
    assert strided.macs_per_sample(9, 8) == 9 * wo * 3 * 2 * 3 + ho * wo * 2 * 4 * 3


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("c_in", "c_out", "k"), [(3, 4, 3), (5, 2, 3), (2, 3, 5)])
def test_lowrank_conv_from_full_exact_at_full_rank(c_in, c_out, k, bias):
    conv = nn.Conv2d(c_in, c_out, k, stride=2, padding=1, dilation=2, bias=bias)
    full_rank = min(c_out * k, c_in * k)
    layer = LowRankConv2d.from_full(conv, full_rank)
    assert (layer.weight - conv.weight).abs().max().item() < 1e-10
    assert layer.stride == (2, 2) and layer.padding == (1, 1) and layer.dilation == (2, 2)
    assert (layer.bias is None) == (not bias)
    x = torch.randn(2, c_in, 11, 12)
    assert (layer(x) - conv(x)).abs().max().item() < 1e-10
    with pytest.raises(ValueError):
        LowRankConv2d.from_full(conv, full_rank + 1)


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_lowrank_conv_from_full_eckart_young(rank):
    conv = nn.Conv2d(4, 3, 3, bias=False)
    layer = LowRankConv2d.from_full(conv, rank)
    err = float(torch.linalg.vector_norm(layer.weight - conv.weight).detach())
    expected = discarded_norm(conv_weight_to_matrix(conv.weight.detach()), rank)
    assert expected > 1e-3
    assert math.isclose(err, expected, rel_tol=1e-9, abs_tol=1e-12)
    u, v = layer.lowrank_u.detach(), layer.lowrank_v.detach()
    assert u.shape == (3 * 3, rank) and v.shape == (rank, 4 * 3)
    torch.testing.assert_close(u.T @ u, v @ v.T, **TOL)


# --------------------------------------------------------------------------- 6. LowRankLinear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("fin", "fout"), [(7, 5), (4, 9), (6, 6)])
def test_lowrank_linear(fin, fout, bias):
    linear = nn.Linear(fin, fout, bias=bias)
    full_rank = min(fin, fout)
    exact = LowRankLinear.from_full(linear, full_rank)
    assert (exact.weight - linear.weight).abs().max().item() < 1e-10
    assert (exact.bias is None) == (not bias)
    x = torch.randn(3, 2, fin, requires_grad=True)  # extra batch dim
    assert (exact(x) - linear(x)).abs().max().item() < 1e-10

    for rank in range(1, full_rank):
        layer = LowRankLinear.from_full(linear, rank)
        err = float(torch.linalg.matrix_norm(layer.weight - linear.weight).detach())
        assert math.isclose(err, discarded_norm(linear.weight.detach(), rank), rel_tol=1e-9, abs_tol=1e-12)
        y = layer(x)
        torch.testing.assert_close(y, F.linear(x, layer.lowrank_u @ layer.lowrank_v, layer.bias), **TOL)
        assert layer.macs_per_sample() == rank * (fin + fout)

        wrt = [x, layer.lowrank_u, layer.lowrank_v] + ([layer.bias] if bias else [])
        g = torch.randn_like(y)
        g_layer = grads(y, g, wrt)
        assert all(t.abs().sum() > 0 for t in g_layer)
        assert_all_close(g_layer, grads(F.linear(x, layer.weight, layer.bias), g, wrt))


# --------------------------------------------------------------------------- 7. pure functions


def test_conv_weight_to_matrix_layout():
    w = torch.randn(2, 3, 4, 4)
    mat = conv_weight_to_matrix(w)
    assert mat.shape == (2 * 4, 3 * 4)
    for o, i, kh, kw in itertools.product(range(2), range(3), range(4), range(4)):
        assert mat[o * 4 + kh, i * 4 + kw] == w[o, i, kh, kw]


@HYP
@given(o=st.integers(1, 4), i=st.integers(1, 4), k=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_conv_matrix_roundtrip(o, i, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, k, k, generator=g)
    assert torch.equal(matrix_to_conv_weight(conv_weight_to_matrix(w), o, i, k), w)
    mat = torch.randn(o * k, i * k, generator=g)
    assert torch.equal(conv_weight_to_matrix(matrix_to_conv_weight(mat, o, i, k)), mat)


@HYP
@given(o=st.integers(1, 5), i=st.integers(1, 5), m=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_coefficient_matrix_roundtrip(o, i, m, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(o, i, m, generator=g)
    mat = coefficients_to_matrix(c)
    assert mat.shape == (o, i * m)
    assert mat[o - 1, (i - 1) * m + (m - 1)] == c[o - 1, i - 1, m - 1]
    assert torch.equal(matrix_to_coefficients(mat, i, m), c)
    back = torch.randn(o, i * m, generator=g)
    assert torch.equal(coefficients_to_matrix(matrix_to_coefficients(back, i, m)), back)


@HYP
@given(a=st.integers(1, 7), b=st.integers(1, 7), seed=st.integers(0, 2**16), data=st.data())
def test_matrix_to_factors_splits_sqrt_sigma(a, b, seed, data):
    rank = data.draw(st.integers(1, min(a, b)))
    mat = torch.randn(a, b, generator=torch.Generator().manual_seed(seed))
    u, v = matrix_to_factors(mat, rank)
    assert u.shape == (a, rank) and v.shape == (rank, b)
    s = torch.linalg.svdvals(mat)[:rank]
    torch.testing.assert_close(u.T @ u, torch.diag(s), **TOL)
    torch.testing.assert_close(v @ v.T, torch.diag(s), **TOL)
    torch.testing.assert_close(factors_to_matrix(u, v), u @ v, rtol=0, atol=0)
    err = float(torch.linalg.matrix_norm(mat - u @ v))
    assert math.isclose(err, discarded_norm(mat, rank), rel_tol=1e-9, abs_tol=1e-12)


def test_matrix_to_factors_dtype_and_validation():
    mat = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    u, v = matrix_to_factors(mat, 4)
    assert u.dtype == v.dtype == torch.float32 and not u.requires_grad
    torch.testing.assert_close(u @ v, mat.detach(), rtol=1e-5, atol=1e-5)
    for bad in (0, -1, 5):
        with pytest.raises(ValueError, match="rank"):
            matrix_to_factors(mat, bad)
    with pytest.raises(ValueError, match="matrix"):
        matrix_to_factors(torch.randn(2, 3, 4), 1)


# FedHM's rule r = max(1, round(γ·c_out)) (specs/fedhm.md §1.3), worked out by hand for the four
# tiers. Halves round to even as in the paper's code (Python's round): 1.5 → 2, 2.5 → 2, 12.5 → 12.
RANKS = {
    # c_out: (γ=1, γ=1/2, γ=1/4, γ=1/8)
    1: (1, 1, 1, 1),  # 0.5 → 0 and 0.125 → 0, both clamped to 1
    3: (3, 2, 1, 1),  # 1.5 → 2; 0.75 → 1; 0.375 → 0 → 1
    4: (4, 2, 1, 1),  # 0.5 → 0 → 1
    10: (10, 5, 2, 1),  # 2.5 → 2; 1.25 → 1
    20: (20, 10, 5, 2),  # 2.5 → 2
    32: (32, 16, 8, 4),
    64: (64, 32, 16, 8),
    100: (100, 50, 25, 12),  # 12.5 → 12
    120: (120, 60, 30, 15),
    512: (512, 256, 128, 64),
}


@pytest.mark.parametrize("c_out", sorted(RANKS))
def test_rank_for_literal(c_out):
    """FedHM's literal rule, the default ``floor=1``."""
    assert [rank_for(g, c_out) for g in (1.0, 0.5, 0.25, 0.125)] == list(RANKS[c_out])


# The narrow-layer floor of 8, by hand: max(round(γ·c_out), min(c_out, 8)).
FLOORED = {
    3: (3, 3, 3, 3),  # narrower than the floor: full rank at every tier
    20: (20, 10, 8, 8),  # 5 → 8; 2.5 → 2 → 8
    32: (32, 16, 8, 8),  # the case: 4 → 8 at ⅛
    64: (64, 32, 16, 8),  # unchanged from 64 outputs up
    512: (512, 256, 128, 64),
}


@pytest.mark.parametrize("c_out", sorted(FLOORED))
def test_rank_for_floor(c_out):
    assert RANK_FLOOR == 8
    assert [rank_for(g, c_out, floor=RANK_FLOOR) for g in (1.0, 0.5, 0.25, 0.125)] == list(FLOORED[c_out])


def test_rank_for_rejects_a_floor_below_one():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="floor"):
            rank_for(0.5, 64, floor=bad)


def test_rank_for_rejects_ratios_outside_the_unit_interval():
    for bad in (0.0, -0.5, 1.0001, 2.0):
        with pytest.raises(ValueError):
            rank_for(bad, 64)


# --------------------------------------------------------------------------- 8. expansion identity


@pytest.mark.parametrize("m", [2, 3, 5])
def test_latent_client_expansion_identity(m):
    o, i, q, k = 4, 3, 6, 3
    alphas = [torch.randn(o, i, q) for _ in range(m)]
    atoms = [torch.randn(q, k, k) for _ in range(m)]
    p = torch.rand(m) + 0.1
    p = p / p.sum()

    lhs = reconstruct_filter(sum(p[c] * alphas[c] for c in range(m)), sum(p[c] * atoms[c] for c in range(m)))
    clients = sum(p[c] ** 2 * reconstruct_filter(alphas[c], atoms[c]) for c in range(m))
    pairs = [(k1, k2) for k1 in range(m) for k2 in range(m) if k1 != k2]
    assert len(pairs) == m * m - m
    latent = sum(p[k1] * p[k2] * reconstruct_filter(alphas[k1], atoms[k2]) for k1, k2 in pairs)
    assert (lhs - (clients + latent)).abs().max().item() < 1e-12
    weight_total = float(sum(p[c] ** 2 for c in range(m)) + sum(p[a] * p[b] for a, b in pairs))
    assert math.isclose(weight_total, 1.0, abs_tol=1e-14)

    # FedAvg over AtomConv2d state_dicts yields exactly this "product of averages" filter
    layers = []
    for c in range(m):
        layer = AtomConv2d(i, o, k, num_atoms=q, bias=False)
        layer.load_state_dict({"atoms": atoms[c], "coefficients": alphas[c]})
        layers.append(layer)
    avg = AtomConv2d(i, o, k, num_atoms=q, bias=False)
    avg.load_state_dict(
        {key: sum(p[c] * layers[c].state_dict()[key] for c in range(m)) for key in ("atoms", "coefficients")}
    )
    assert (avg.weight - lhs).abs().max().item() < 1e-12


# --------------------------------------------------------------------------- 9. state_dict roles


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(t.shape) for key, t in module.state_dict().items()}


def test_state_dict_keys_and_shapes():
    assert _shapes(AtomConv2d(3, 5, 3, num_atoms=6)) == {"atoms": (6, 3, 3), "coefficients": (5, 3, 6), "bias": (5,)}
    assert _shapes(AtomConv2d(3, 5, 3, num_atoms=6, bias=False)) == {"atoms": (6, 3, 3), "coefficients": (5, 3, 6)}
    assert _shapes(AtomConv2d(3, 5, 3, num_atoms=6, rank=2)) == {
        "atoms": (6, 3, 3),
        "coefficients_u": (5, 2),
        "coefficients_v": (2, 18),
        "bias": (5,),
    }
    assert _shapes(AtomConv2d(3, 5, 3, num_atoms=6, rank=2, bias=False)) == {
        "atoms": (6, 3, 3),
        "coefficients_u": (5, 2),
        "coefficients_v": (2, 18),
    }
    assert _shapes(LowRankConv2d(3, 5, 3, rank=4)) == {"lowrank_u": (15, 4), "lowrank_v": (4, 9)}
    assert _shapes(LowRankConv2d(3, 5, 3, rank=4, bias=True)) == {
        "lowrank_u": (15, 4),
        "lowrank_v": (4, 9),
        "bias": (5,),
    }
    assert _shapes(LowRankLinear(7, 4, rank=3)) == {"lowrank_u": (4, 3), "lowrank_v": (3, 7), "bias": (4,)}
    assert _shapes(LowRankLinear(7, 4, rank=3, bias=False)) == {"lowrank_u": (4, 3), "lowrank_v": (3, 7)}


def test_state_dict_roundtrip_reproduces_function():
    src = AtomConv2d(3, 4, 3, num_atoms=5, rank=2, padding=1)
    dst = AtomConv2d(3, 4, 3, num_atoms=5, rank=2, padding=1)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(1, 3, 6, 6)
    assert torch.equal(src(x), dst(x))


# --------------------------------------------------------------------------- 10. validation


def test_constructor_validation():
    with pytest.raises(ValueError, match="square"):
        AtomConv2d(3, 4, (3, 5))
    with pytest.raises(ValueError, match="square"):
        LowRankConv2d(3, 4, (1, 3), rank=1)
    with pytest.raises(ValueError, match="num_atoms"):
        AtomConv2d(3, 4, 3, num_atoms=0)
    AtomConv2d(3, 4, 3, num_atoms=1)
    # AtomConv2d rank ∈ [1, min(o, i·m)]
    for bad in (0, 5):
        with pytest.raises(ValueError, match="rank"):
            AtomConv2d(3, 4, 3, num_atoms=2, rank=bad)
    AtomConv2d(3, 4, 3, num_atoms=2, rank=4)
    with pytest.raises(ValueError, match="rank"):
        AtomConv2d(3, 8, 3, num_atoms=2, rank=7)  # i·m = 6 < o
    AtomConv2d(3, 8, 3, num_atoms=2, rank=6)
    # LowRankConv2d rank ∈ [1, min(o·k, i·k)]
    for bad in (0, 10):
        with pytest.raises(ValueError, match="rank"):
            LowRankConv2d(3, 4, 3, rank=bad)
    LowRankConv2d(3, 4, 3, rank=9)
    # LowRankLinear rank ∈ [1, min(in, out)]
    for bad in (0, 5):
        with pytest.raises(ValueError, match="rank"):
            LowRankLinear(7, 4, rank=bad)
    LowRankLinear(7, 4, rank=4)


def test_grouped_conv_rejected():
    grouped = nn.Conv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match="grouped"):
        AtomConv2d.from_conv(grouped, num_atoms=9)
    with pytest.raises(ValueError, match="grouped"):
        LowRankConv2d.from_full(grouped, rank=2)


# --------------------------------------------------------------------------- conversions keep dtype and padding


@pytest.mark.parametrize("case", ["atom_from_conv", "lowrank_conv_from_full", "lowrank_linear_from_full", "weight"])
def test_conversions_preserve_dtype(case):
    torch.set_default_dtype(torch.float32)
    conv = nn.Conv2d(3, 4, 3).double()
    if case == "atom_from_conv":
        out = AtomConv2d.from_conv(conv, 9).atoms
    elif case == "lowrank_conv_from_full":
        out = LowRankConv2d.from_full(conv, 9).lowrank_u
    elif case == "lowrank_linear_from_full":
        out = LowRankLinear.from_full(nn.Linear(5, 4).double(), 4).lowrank_u
    else:
        out = LowRankConv2d(3, 4, 3, rank=2).double().weight
    assert out.dtype == torch.float64


@pytest.mark.parametrize("factory", ["atoms", "lowrank"])
def test_conversion_respects_or_rejects_padding_mode(factory):
    conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    try:
        layer = AtomConv2d.from_conv(conv, 9) if factory == "atoms" else LowRankConv2d.from_full(conv, 9)
    except ValueError:
        return
    x = torch.randn(1, 3, 6, 6)
    torch.testing.assert_close(layer(x), conv(x), **TOL)


def test_float64_conversions_stay_exact_under_a_float32_default():
    """Converting a float64 layer must not round through the float32 default dtype."""
    torch.set_default_dtype(torch.float32)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    assert (AtomConv2d.from_conv(conv, 9).weight - conv.weight).abs().max().item() < 1e-12
    full_rank = LowRankConv2d.from_full(conv, 9)
    assert (full_rank.weight - conv.weight).abs().max().item() < 1e-12
    linear = nn.Linear(6, 5).double()
    assert (LowRankLinear.from_full(linear, 5).weight - linear.weight).abs().max().item() < 1e-12
