"""FedMedian and FedTrimmedAvg against values worked by hand, trimming 0 as FedAvg, and their refusal of factors."""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import DIGITS, random_tensors, run_round, update

from aggregator_service.strategies import FedAvg, FedMedian, FedTrimmedAvg, Setting

CLIENTS = {"a": (10, [1.0, 4.0]), "b": (20, [5.0, 0.0]), "c": (30, [2.0, 8.0]), "d": (40, [10.0, 6.0])}


def four_clients(strategy, names=("a", "b", "c", "d")) -> list[float]:
    name = "head.bias"
    pad = torch.zeros(8)
    ups = [update(DIGITS, {name: torch.cat([torch.tensor(CLIENTS[c][1]), pad])}, CLIENTS[c][0], c) for c in names]
    return run_round(strategy, {name: torch.zeros(10)}, ups).tensors[name][:2].tolist()


def test_fedmedian_by_hand() -> None:
    # coordinate 0: 1 2 5 10 → (2 + 5)/2; coordinate 1: 0 4 6 8 → (4 + 6)/2
    assert four_clients(FedMedian()) == pytest.approx([3.5, 5.0])
    # three clients a, b, c: coordinate 0: 1 2 5 → 2; coordinate 1: 0 4 8 → 4
    assert four_clients(FedMedian(), ("a", "b", "c")) == pytest.approx([2.0, 4.0])


def test_fedtrimmedavg_by_hand() -> None:
    # β = 0.25 of 4 cuts one value each end, per coordinate, and keeps the survivors' sample weights:
    # coordinate 0 keeps c (2, n=30) and b (5, n=20): 160/50; coordinate 1 keeps a (4, n=10) and d (6, n=40): 280/50
    assert four_clients(FedTrimmedAvg(beta=0.25)) == pytest.approx([3.2, 5.6])
    # β = 0.2 (Flower's default) of 4 cuts ⌊0.8⌋ = 0: the weighted mean
    assert four_clients(FedTrimmedAvg()) == pytest.approx([(10 + 100 + 60 + 400) / 100, (40 + 0 + 240 + 240) / 100])


def test_trimming_nothing_is_fedavg() -> None:
    gen = torch.Generator().manual_seed(2)
    x = random_tensors(DIGITS, gen)
    ups = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (3, 7, 11)]
    ref, got = run_round(FedAvg(), x, ups), run_round(FedTrimmedAvg(beta=0.0), x, ups)
    assert ref.tensors.keys() == got.tensors.keys()
    for name in ref.tensors:
        torch.testing.assert_close(got.tensors[name], ref.tensors[name], rtol=1e-6, atol=1e-6)
    assert got.dispersion == ref.dispersion and got.weights == ref.weights


def test_robust_rules_refuse_low_rank_factors() -> None:
    for cls in (FedMedian, FedTrimmedAvg):
        assert cls.refuse(Setting("lowrank", (1.0, 0.5))) is not None
        assert cls.refuse(Setting("atoms", (1.0,))) is None
    with pytest.raises(ValueError, match="beta"):
        FedTrimmedAvg(beta=0.5)
