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
