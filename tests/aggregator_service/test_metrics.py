"""Tests for aggregator_service.metrics: latent clients, variance of the product of averages, bandwidth.

The variance tests follow specs/filter-decomposition.md §2.5: the expansion identity, the
idealized Prop 5.1 (i.i.d. terms: ``S²σ²`` vs ``Sσ²``), the realistic bilinear closed forms
``S·L + S²·P`` (product of averages) vs ``S·L + S·P`` (average of products) from the
implementer's caveat, checked by vectorized Monte Carlo, and monotone decrease with ``m``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from aggregator_service.metrics import (
    BandwidthLedger,
    Transfer,
    atom_modules,
    effective_dispersion,
    effective_filters,
    fedavg_equivalent_bytes,
    latent_clients,
    total_dispersion,
)
from aggregator_service.refactorization import refactorize
from aggregator_service.strategies import FedAvg
from aggregator_service.updates import ClientUpdate
from aggregator_service.weighted_mean import WeightedMean
from fedcore.codec import encode
from fedcore.layers import reconstruct_filter
from fedcore.spec import ModelSpec

# the caveat's setting
C_OUT, C_IN, K, M_A = 4, 3, 3, 9
N_K = [120, 80, 200, 50, 150]
SIGMA_A, SIGMA_D = 0.3, 0.2


def test_latent_clients_and_total_dispersion() -> None:
    assert [latent_clients(m) for m in (0, 1, 2, 4, 5)] == [0, 0, 2, 12, 20]
    with pytest.raises(ValueError):
        latent_clients(-1)
    assert total_dispersion({"a": 0.5, "b": 1.25}) == 1.75
    assert total_dispersion({}) == 0.0


# --------------------------------------------------------------------------- variance (spec §2.5)


def weights(n_k: list[int]) -> Tensor:
    n = torch.tensor(n_k, dtype=torch.float64)
    return n / n.sum()


def closed_forms(p: Tensor, alpha_bar: Tensor, atoms_bar: Tensor) -> tuple[float, float, float, float]:
    """(S, L, P) of the caveat and the two variances: product of averages, average of products."""
    s = float((p**2).sum())
    big_l = SIGMA_A**2 * C_OUT * C_IN * float((atoms_bar**2).sum()) + SIGMA_D**2 * K**2 * float((alpha_bar**2).sum())
    big_p = M_A * SIGMA_A**2 * SIGMA_D**2 * C_OUT * C_IN * K**2
    return s, big_l, big_p, s * big_l + s * s * big_p


def draw_clients(
    gen: torch.Generator, draws: int, m: int, alpha_bar: Tensor, atoms_bar: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """α_k = ᾱ + a_k, D_k = D̄ + d_k for ``draws`` independent federations of ``m`` clients."""
    a = SIGMA_A * torch.randn(draws, m, C_OUT, C_IN, M_A, generator=gen, dtype=torch.float64)
    d = SIGMA_D * torch.randn(draws, m, M_A, K, K, generator=gen, dtype=torch.float64)
    return alpha_bar + a, atoms_bar + d, a, d


def trace_var(x: Tensor) -> float:
    """E‖X − EX‖² estimated over the leading (draw) dimension."""
    flat = x.reshape(x.shape[0], -1)
    return float(((flat - flat.mean(0)) ** 2).sum(1).mean() * x.shape[0] / (x.shape[0] - 1))


def products(p: Tensor, alpha: Tensor, atoms: Tensor) -> tuple[Tensor, Tensor]:
    """Per draw: average of products Σp α_k×D_k and product of averages (Σp α_k)×(Σp D_k)."""
    avg_of_products = torch.einsum("k,nkoiq,nkqxy->noixy", p, alpha, atoms)
    prod_of_avgs = torch.einsum(
        "noiq,nqxy->noixy", torch.einsum("k,nk...->n...", p, alpha), torch.einsum("k,nk...->n...", p, atoms)
    )
    return avg_of_products, prod_of_avgs


def test_expansion_identity() -> None:
    gen = torch.Generator().manual_seed(0)
    p = weights(N_K)
    alpha = torch.randn(len(N_K), C_OUT, C_IN, M_A, generator=gen, dtype=torch.float64)
    atoms = torch.randn(len(N_K), M_A, K, K, generator=gen, dtype=torch.float64)
    lhs = reconstruct_filter(torch.einsum("k,k...->...", p, alpha), torch.einsum("k,k...->...", p, atoms))
    clients = sum(p[k] ** 2 * reconstruct_filter(alpha[k], atoms[k]) for k in range(len(N_K)))
    latent = sum(
        p[k1] * p[k2] * reconstruct_filter(alpha[k1], atoms[k2])
        for k1 in range(len(N_K))
        for k2 in range(len(N_K))
        if k1 != k2
    )
    assert float((lhs - clients - latent).abs().max()) < 1e-12


def test_idealized_prop_5_1() -> None:
    """m + m(m−1) i.i.d. terms with trace variance σ²: Var(θ′) ≈ S²σ² ≤ Var(θ) ≈ Sσ²."""
    gen = torch.Generator().manual_seed(1)
    p = weights(N_K)
    m, dim, draws, sigma2 = len(N_K), 40, 4000, 2.0
    terms = 3.0 + math.sqrt(sigma2 / dim) * torch.randn(draws, m, m, dim, generator=gen, dtype=torch.float64)
    theta_prime = torch.einsum("a,b,nabd->nd", p, p, terms)  # clients on the diagonal, latent clients off it
    theta = torch.einsum("k,nkd->nd", p, terms.diagonal(dim1=1, dim2=2).transpose(1, 2))
    s = float((p**2).sum())
    assert trace_var(theta_prime) == pytest.approx(s * s * sigma2, rel=0.03)
    assert trace_var(theta) == pytest.approx(s * sigma2, rel=0.03)
    assert trace_var(theta_prime) < trace_var(theta)
    # equal weights: σ²/m² vs σ²/m
    eq = weights([1] * m)
    assert float((eq**2).sum()) == pytest.approx(1 / m)


def test_realistic_bilinear_closed_forms() -> None:
    gen = torch.Generator().manual_seed(2)
    p = weights(N_K)
    alpha_bar = torch.randn(C_OUT, C_IN, M_A, generator=gen, dtype=torch.float64)
    atoms_bar = torch.randn(M_A, K, K, generator=gen, dtype=torch.float64)
    s, big_l, big_p, var_prod_cf = closed_forms(p, alpha_bar, atoms_bar)
    var_avg_cf = s * big_l + s * big_p

    alpha, atoms, a, d = draw_clients(gen, 6000, len(N_K), alpha_bar, atoms_bar)
    avg_of_products, prod_of_avgs = products(p, alpha, atoms)
    var_avg, var_prod = trace_var(avg_of_products), trace_var(prod_of_avgs)
    assert var_avg == pytest.approx(var_avg_cf, rel=0.03)
    assert var_prod == pytest.approx(var_prod_cf, rel=0.03)
    assert var_prod <= var_avg and var_prod_cf <= var_avg_cf

    # The first-order terms are identical, so the gap is all second order: Σp a_k×d_k vs ā×d̄.
    second_avg = torch.einsum("k,nkoiq,nkqxy->noixy", p, a, d)
    second_prod = torch.einsum(
        "noiq,nqxy->noixy", torch.einsum("k,nk...->n...", p, a), torch.einsum("k,nk...->n...", p, d)
    )
    torch.testing.assert_close(avg_of_products - prod_of_avgs, second_avg - second_prod)
    assert trace_var(second_avg) == pytest.approx(s * big_p, rel=0.03)
    assert trace_var(second_prod) == pytest.approx(s * s * big_p, rel=0.03)
    gap_cf = (s - s * s) * big_p
    assert trace_var(second_avg) - trace_var(second_prod) == pytest.approx(gap_cf, rel=0.05)
    # the direct estimate carries the first-order noise too: looser
    assert var_avg - var_prod == pytest.approx(gap_cf, rel=0.35)


def test_variance_decreases_with_m() -> None:
    gen = torch.Generator().manual_seed(3)
    alpha_bar = torch.randn(C_OUT, C_IN, M_A, generator=gen, dtype=torch.float64)
    atoms_bar = torch.randn(M_A, K, K, generator=gen, dtype=torch.float64)
    prev = (math.inf, math.inf, math.inf, math.inf)
    for m in (2, 4, 8, 16):
        p = weights([1] * m)
        s, big_l, big_p, var_prod_cf = closed_forms(p, alpha_bar, atoms_bar)
        var_avg_cf = s * big_l + s * big_p
        alpha, atoms, _, _ = draw_clients(gen, 1500, m, alpha_bar, atoms_bar)
        avg_of_products, prod_of_avgs = products(p, alpha, atoms)
        now = (var_prod_cf, var_avg_cf, trace_var(prod_of_avgs), trace_var(avg_of_products))
        assert all(x < y for x, y in zip(now, prev, strict=True)), (m, now, prev)
        prev = now


# --------------------------------------------------------------------------- effective-filter dispersion


def batch_effective_dispersion(p: Tensor, alpha: list[Tensor], atoms: list[Tensor]) -> float:
    alpha64 = [x.to(torch.float64) for x in alpha]
    atoms64 = [x.to(torch.float64) for x in atoms]
    centre = reconstruct_filter(
        sum(pk * x for pk, x in zip(p, alpha64, strict=True)), sum(pk * x for pk, x in zip(p, atoms64, strict=True))
    )
    return float(
        sum(pk * ((reconstruct_filter(a, d) - centre) ** 2).sum() for pk, a, d in zip(p, alpha64, atoms64, strict=True))
    )


def test_streaming_effective_dispersion_equals_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    alpha = [torch.randn(C_OUT, C_IN, M_A, generator=gen, dtype=torch.float64) for _ in N_K]
    atoms = [torch.randn(M_A, K, K, generator=gen, dtype=torch.float64) for _ in N_K]
    tensors = WeightedMean()
    filters = WeightedMean()
    for a, d, n in zip(alpha, atoms, N_K, strict=True):
        client = {"conv.coefficients": a, "conv.atoms": d}
        tensors.add(client, n)
        filters.add(effective_filters(client), n)
    raw = tensors.mean(cast=False)
    got = effective_dispersion(
        filters.mean(cast=False)["conv"], filters.dispersion()["conv"], raw["conv.coefficients"], raw["conv.atoms"]
    )
    assert got == pytest.approx(batch_effective_dispersion(weights(N_K), alpha, atoms), rel=1e-12)


def test_aggregate_reports_effective_dispersion_of_aligned_filters() -> None:
    spec = ModelSpec("lenet-cifar10", 10, "atoms-lowrank")
    gen = torch.Generator().manual_seed(5)
    base = {t.name: torch.randn(t.shape, generator=gen) for t in spec.tensors}
    samples = [40, 10, 25]
    clients = []
    for i, tier in enumerate((1.0, 0.25, 0.5)):
        noisy = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
        clients.append((spec.at_tier(tier), refactorize(noisy, [spec.at_tier(tier)])[tier], samples[i]))
    updates = [ClientUpdate(f"c{i}", n, s.rank_ratio, s, t) for i, (s, t, n) in enumerate(clients)]
    strategy = FedAvg()
    acc = strategy.begin(base, list(base))
    for u in updates:
        strategy.fold(acc, u)
    result = strategy.finish(acc, base)
    assert atom_modules(base) == ["conv1", "conv2"]
    assert set(result.effective_dispersion) == {"conv1", "conv2"}
    aligned = [s.to_full(t) for s, t, _ in clients]
    p = weights(samples)
    for module in ("conv1", "conv2"):
        ref = batch_effective_dispersion(
            p, [x[f"{module}.coefficients"] for x in aligned], [x[f"{module}.atoms"] for x in aligned]
        )
        assert result.effective_dispersion[module] == pytest.approx(ref, rel=1e-9)

    # only atoms due: no effective-filter metric for that round
    acc = strategy.begin(base, ["conv1.atoms", "conv2.atoms"])
    for u in updates:
        strategy.fold(acc, u)
    assert strategy.finish(acc, base).effective_dispersion == {}


# --------------------------------------------------------------------------- bandwidth


def test_ledger_matches_encoded_bytes() -> None:
    spec = ModelSpec("digits-cnn", 10, "lowrank")
    gen = torch.Generator().manual_seed(6)
    full = {t.name: torch.randn(t.shape, generator=gen) for t in spec.tensors}
    tiers = refactorize(full, [spec.at_tier(1.0), spec.at_tier(0.25)])
    ledger = BandwidthLedger(fp16=True)
    actual: dict[tuple[int, str, str], int] = {}
    for round_ in (1, 2):
        for client, tier in (("a", 1.0), ("b", 0.25)):
            down, up = tiers[tier], {n: t for n, t in tiers[tier].items() if n.startswith("fc1")}
            ledger.record_tensors(round_, client, "down", down)
            ledger.record_tensors(round_, client, "up", up, fp16=False)
            actual[(round_, client, "down")] = sum(len(encode(t, fp16=True).data) for t in down.values())
            actual[(round_, client, "up")] = sum(len(encode(t).data) for t in up.values())
    ledger.record(2, "c", "up", "extra", 1)  # a hand-recorded transfer with int64 counters etc.
    actual[(2, "c", "up")] = 1

    for (round_, client, direction), nbytes in actual.items():
        assert ledger.total(round_=round_, client_id=client, direction=direction) == nbytes
    assert ledger.total() == sum(actual.values())
    for round_, per_dir in ledger.per_round().items():
        for direction in ("down", "up"):
            assert per_dir[direction] == sum(b for (r, _, d), b in actual.items() if r == round_ and d == direction)
    assert ledger.per_client(2)["c"] == {"down": 0, "up": 1}
    assert ledger.per_client()["a"]["down"] == 2 * actual[(1, "a", "down")]
    fc1_up = ledger.per_tensor(1)["fc1.lowrank_u"]["up"]
    assert fc1_up == len(encode(tiers[0.25]["fc1.lowrank_u"]).data)
    cumulative = ledger.cumulative()
    assert cumulative[2]["down"] == ledger.total(direction="down")
    assert cumulative[1]["up"] == ledger.total(round_=1, direction="up")
    assert sum(t.nbytes for t in ledger.records()) == ledger.total()
    assert Transfer(2, "c", "up", "extra", 1) in list(ledger.records())
    with pytest.raises(ValueError, match="direction"):
        ledger.record(1, "a", "sideways", "x", 1)
    with pytest.raises(ValueError, match="nbytes"):
        ledger.record(1, "a", "up", "x", -1)


def test_fedavg_equivalent_bytes_for_digits_cnn() -> None:
    # conv1 32·1·3·3 + 32, conv2 64·32·3·3 + 64, fc1 128·1024 + 128, head 10·128 + 10, all fp32
    params = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (128 * 1024 + 128) + (10 * 128 + 10)
    assert params == 151_306
    for factorization in ("none", "atoms-lowrank", "lowrank"):
        spec = ModelSpec("digits-cnn", 10, factorization, rank_ratio=0.25)
        assert fedavg_equivalent_bytes(spec, 5) == 2 * 5 * params * 4
    assert fedavg_equivalent_bytes(ModelSpec("digits-cnn", 10), 0) == 0
    with pytest.raises(ValueError):
        fedavg_equivalent_bytes(ModelSpec("digits-cnn", 10), -1)


def test_fedavg_equivalent_bytes_counts_buffers() -> None:
    spec = ModelSpec("resnet18", 10, "atoms")
    plain = ModelSpec("resnet18", 10, "none")
    int_bytes = sum(8 for t in plain.tensors if t.dtype == "int64")
    float_elems = sum(t.numel for t in plain.tensors if t.dtype == "float32")
    assert int_bytes > 0
    assert fedavg_equivalent_bytes(spec, 1) == 2 * (4 * float_elems + int_bytes)


def test_atom_modules_needs_both_factors() -> None:
    atoms, alpha = torch.randn(M_A, K, K), torch.randn(C_OUT, C_IN, M_A)
    assert atom_modules({"atoms": atoms, "coefficients": alpha}) == [""]  # a bare AtomConv2d
    assert atom_modules({"a.atoms": atoms, "b.coefficients": alpha}) == []
    assert atom_modules({"a.atoms": atoms, "a.coefficients": torch.randn(C_OUT, C_IN, M_A + 1)}) == []
    torch.testing.assert_close(
        effective_filters({"atoms": atoms, "coefficients": alpha})[""],
        reconstruct_filter(alpha.double(), atoms.double()),
    )
