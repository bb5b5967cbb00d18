"""FedHM re-factorization against ``spec.from_full`` per tier, with one SVD per factorized tensor."""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import LENET, TIERS, random_tensors
from torch import Tensor

from aggregator_service.refactorization import refactorize
from fedcore.spec import ModelSpec


@pytest.mark.parametrize("spec", [LENET, ModelSpec("digits-cnn", 10, "lowrank")])
def test_refactorize_equals_from_full_with_one_svd_per_tensor(spec: ModelSpec, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(12)
    global_tensors = random_tensors(spec, gen)
    tier_specs = [spec.at_tier(g) for g in TIERS]
    expected = {g: s.from_full(global_tensors) for g, s in zip(TIERS, tier_specs, strict=True)}

    calls: list[tuple[int, ...]] = []
    svd = torch.linalg.svd

    def counting_svd(matrix: Tensor, **kwargs):
        calls.append(tuple(matrix.shape))
        return svd(matrix, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    tiers = refactorize(global_tensors, tier_specs)
    monkeypatch.undo()
    factorized = {t.full_name for s in tier_specs for t in s.tensors if t.full_name}
    assert factorized and len(calls) == len(factorized)

    assert set(tiers) == set(TIERS)
    for g in TIERS:
        assert list(tiers[g]) == spec.at_tier(g).names
        for name, tensor in expected[g].items():
            assert torch.equal(tiers[g][name], tensor), (g, name)
    # γ = 1 receives the global tensors unchanged
    assert all(tiers[1.0][n] is global_tensors[n] for n in global_tensors)


def test_keep_energy_scales_the_cut_to_the_whole_tensors_norm() -> None:
    """Same singular directions as the truncated cut, the whole tensor's Frobenius norm; a zero tensor stays zero."""
    spec = ModelSpec("digits-cnn", 10, "lowrank")
    global_tensors = random_tensors(spec, torch.Generator().manual_seed(5))
    global_tensors["conv2.weight"] = torch.zeros_like(global_tensors["conv2.weight"])
    tier = spec.at_tier(0.125)
    truncated = refactorize(global_tensors, [tier])[0.125]
    energy = refactorize(global_tensors, [tier], keep_energy={"fc1.weight", "conv2.weight"})[0.125]

    whole = torch.linalg.matrix_norm(global_tensors["fc1.weight"].double())
    cut = energy["fc1.lowrank_u"].double() @ energy["fc1.lowrank_v"].double()
    assert float(torch.linalg.matrix_norm(cut)) == pytest.approx(float(whole), rel=1e-5)
    plain_cut = truncated["fc1.lowrank_u"].double() @ truncated["fc1.lowrank_v"].double()
    assert float(torch.linalg.matrix_norm(plain_cut)) < 0.6 * float(whole)  # a random 128×1024 at rank 16
    ratio = float(torch.linalg.matrix_norm(cut) / torch.linalg.matrix_norm(plain_cut))
    torch.testing.assert_close(cut, ratio * plain_cut, rtol=0, atol=1e-5)  # float32 factors
    for name in ("conv2.lowrank_u", "conv2.lowrank_v"):
        assert torch.count_nonzero(energy[name]) == 0
    for name in tier.names:  # tensors not named are cut exactly as before
        if not name.startswith(("fc1.lowrank", "conv2.lowrank")):
            assert torch.equal(energy[name], truncated[name]), name
