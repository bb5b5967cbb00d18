"""Tests for aggregator_service.metrics: latent clients, effective-filter dispersion, bandwidth.

The dispersion oracles are small cases worked out by hand in the comments (two clients, one
1×1 atom), plus references computed another way (a batch sum over reconstructed filters) for
larger random cases; the expansion identity of specs/filter-decomposition.md §2.5 is checked on
fedcore's ``reconstruct_filter``.
"""

from __future__ import annotations

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
    fedavg_transfer_bytes,
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
    # §2.4: m clients give m² − m ordered (α_k1, D_k2) pairs, k1 ≠ k2: 2 clients → (1,2), (2,1)
    assert [latent_clients(m) for m in (0, 1, 2, 3, 4, 5)] == [0, 0, 2, 6, 12, 20]
    with pytest.raises(ValueError):
        latent_clients(-1)
    assert total_dispersion({"a": 0.5, "b": 1.25}) == 1.75
    assert total_dispersion({}) == 0.0


# --------------------------------------------------------------------------- variance (spec §2.5)


def weights(n_k: list[int]) -> Tensor:
    n = torch.tensor(n_k, dtype=torch.float64)
    return n / n.sum()


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


def test_effective_filters_by_hand() -> None:
    """One output, one input channel, two 2×2 atoms: W = 1·[[1,0],[0,1]] + (−1)·[[0,1],[1,0]]."""
    alpha = torch.tensor([[[1.0, -1.0]]])  # (o=1, i=1, m=2)
    atoms = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]])  # (m=2, 2, 2)
    got = effective_filters({"conv.coefficients": alpha, "conv.atoms": atoms, "conv.bias": torch.zeros(1)})
    assert set(got) == {"conv"}
    assert got["conv"].dtype == torch.float64
    assert got["conv"].tolist() == [[[[1.0, -1.0], [-1.0, 1.0]]]]


# Two clients, one 1×1 atom, one channel: every tensor is a scalar.
#   client 1: α = 1, D = 1 → W = 1;   client 2: α = 3, D = 3 → W = 9.
# Equal weights p = (½, ½):
#   average of products Σp W_k = 5, its dispersion ½(1−5)² + ½(9−5)² = 16;
#   product of averages ᾱ·D̄ = 2·2 = 4, so Σp ‖W_k − 4‖² = ½·9 + ½·25 = 17 (= 16 + (5−4)²).
# Weights 1 : 3, p = (¼, ¾):
#   Σp W_k = ¼ + 27/4 = 7, dispersion ¼·36 + ¾·4 = 12; ᾱ = D̄ = ¼ + 9/4 = 5/2, ᾱ·D̄ = 25/4;
#   Σp ‖W_k − 25/4‖² = ¼·(21/4)² + ¾·(11/4)² = 441/64 + 363/64 = 804/64 = 12.5625.
# Per-tensor dispersion of α (and of D): ½·1 + ½·1 = 1 with equal weights, ¼·(3/2)² + ¾·(1/2)² = 3/4
# with 1 : 3; the model-wide total adds α's and D's.
TWO_CLIENTS = [(1.0, 1.0), (3.0, 3.0)]  # (α, D) per client


def _scalar_client(alpha: float, atom: float) -> dict[str, Tensor]:
    return {"conv.coefficients": torch.tensor([[[alpha]]]), "conv.atoms": torch.tensor([[[atom]]])}


def test_effective_dispersion_two_clients_one_atom_by_hand() -> None:
    t = torch.tensor
    assert effective_dispersion(t([[[[5.0]]]]), 16.0, t([[[2.0]]]), t([[[2.0]]])) == 17.0
    assert effective_dispersion(t([[[[7.0]]]]), 12.0, t([[[2.5]]]), t([[[2.5]]])) == 12.5625


@pytest.mark.parametrize(("samples", "expected", "per_tensor"), [((10, 10), 17.0, 1.0), ((1, 3), 12.5625, 0.75)])
def test_streamed_dispersions_two_clients_one_atom_by_hand(
    samples: tuple[int, int], expected: float, per_tensor: float
) -> None:
    tensors, filters = WeightedMean(), WeightedMean()
    for (alpha, atom), n in zip(TWO_CLIENTS, samples, strict=True):
        client = _scalar_client(alpha, atom)
        tensors.add(client, n)
        filters.add(effective_filters(client), n)
    raw = tensors.mean(cast=False)
    got = effective_dispersion(
        filters.mean(cast=False)["conv"], filters.dispersion()["conv"], raw["conv.coefficients"], raw["conv.atoms"]
    )
    assert got == pytest.approx(expected, abs=1e-12)
    assert tensors.dispersion() == pytest.approx({"conv.coefficients": per_tensor, "conv.atoms": per_tensor})
    assert total_dispersion(tensors.dispersion()) == pytest.approx(2 * per_tensor)


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
    assert Transfer(2, "c", "up", "extra", 1, "push") in list(ledger.records())
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
        assert fedavg_equivalent_bytes(spec, 5) == 5 * params * 4  # five transfers of the plain fp32 model
        assert fedavg_transfer_bytes(spec) == params * 4
    assert fedavg_equivalent_bytes(ModelSpec("digits-cnn", 10), 0) == 0
    with pytest.raises(ValueError):
        fedavg_equivalent_bytes(ModelSpec("digits-cnn", 10), -1)


def test_fedavg_equivalent_bytes_counts_buffers() -> None:
    spec = ModelSpec("resnet18", 10, "atoms")
    plain = ModelSpec("resnet18", 10, "none")
    int_bytes = sum(8 for t in plain.tensors if t.dtype == "int64")
    float_elems = sum(t.numel for t in plain.tensors if t.dtype == "float32")
    assert int_bytes > 0
    assert fedavg_equivalent_bytes(spec, 2) == 2 * (4 * float_elems + int_bytes)


def test_atom_modules_needs_both_factors() -> None:
    atoms, alpha = torch.randn(M_A, K, K), torch.randn(C_OUT, C_IN, M_A)
    assert atom_modules({"atoms": atoms, "coefficients": alpha}) == [""]  # a bare AtomConv2d
    assert atom_modules({"a.atoms": atoms, "b.coefficients": alpha}) == []
    assert atom_modules({"a.atoms": atoms, "a.coefficients": torch.randn(C_OUT, C_IN, M_A + 1)}) == []
    torch.testing.assert_close(
        effective_filters({"atoms": atoms, "coefficients": alpha})[""],
        reconstruct_filter(alpha.double(), atoms.double()),
    )
