"""The streaming weighted mean against batch sums over stacked tensors, and the client weights."""

from __future__ import annotations

import math
import random

import pytest
import torch
from strategy_helpers import DIGITS, LENET, batch_mean, random_tensors, update

from aggregator_service.strategies import FedAvg
from aggregator_service.updates import ClientUpdate
from aggregator_service.weighted_mean import WeightedMean, client_weight


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_mean_equals_batch_for_every_role(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k = rng.randint(1, 20)
    roles = {t.role for t in LENET.tensors}
    assert {"atoms", "coefficients", "body", "head"} <= roles
    clients = []
    for _ in range(k):
        tensors = random_tensors(LENET, gen, torch.float64)
        tensors["bn.running_mean"] = torch.randn(64, generator=gen, dtype=torch.float64)  # a float buffer
        tensors["bn.num_batches_tracked"] = torch.randint(0, 10_000, (), generator=gen)  # an int64 buffer
        clients.append(tensors)
    weights = [rng.uniform(0.1, 100.0) for _ in range(k)]
    wm = WeightedMean()
    for tensors, w in zip(clients, weights, strict=True):
        wm.add(tensors, w)
    assert wm.count == k and wm.total_weight == pytest.approx(sum(weights), rel=1e-14)
    means, dispersion = wm.mean(), wm.dispersion()
    assert set(means) == set(clients[0])
    for name in clients[0]:
        ref, ref_disp = batch_mean([c[name] for c in clients], weights)
        assert means[name].dtype == clients[0][name].dtype
        if name.endswith("num_batches_tracked"):
            assert means[name].item() == round(ref.item())
        else:
            torch.testing.assert_close(means[name], ref, rtol=1e-12, atol=1e-12)
        assert dispersion[name] == pytest.approx(ref_disp, rel=1e-10, abs=1e-12)


def test_float32_in_float32_out_and_missing_tensors_weighted_separately() -> None:
    wm = WeightedMean()
    wm.add({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, 1.0)
    wm.add({"a": torch.tensor([3.0, 4.0])}, 3.0)  # "b" missing from this contribution
    wm.add({"flag": torch.tensor([True, False])}, 2.0)
    means = wm.mean()
    assert means["a"].dtype == torch.float32
    torch.testing.assert_close(means["a"], torch.tensor([2.5, 3.5]))
    torch.testing.assert_close(means["b"], torch.tensor([3.0]))  # only its own contributor
    assert means["flag"].dtype == torch.bool
    assert wm.weight("a") == 4.0 and wm.weight("b") == 1.0 and wm.total_weight == 6.0
    assert wm.dispersion()["a"] == pytest.approx(0.25 * 2 * (1.5**2) + 0.75 * 2 * (0.5**2))
    assert wm.dispersion()["b"] == 0.0


def test_weighted_mean_rejects_bad_input() -> None:
    wm = WeightedMean()
    with pytest.raises(ValueError, match="positive"):
        wm.add({"a": torch.zeros(2)}, 0.0)
    with pytest.raises(ValueError, match="positive"):
        wm.add({"a": torch.zeros(2)}, math.nan)
    wm.add({"a": torch.zeros(2), "b": torch.zeros(1)}, 1.0)
    with pytest.raises(ValueError, match="shape"):
        wm.add({"b": torch.ones(1), "a": torch.zeros(3)}, 1.0)
    assert wm.count == 1 and wm.weight("b") == 1.0 and wm.mean()["b"].item() == 0.0  # nothing was folded


def test_client_weight_validation() -> None:
    u = update(DIGITS, {}, 7, "c")
    assert client_weight(u) == 7.0
    assert client_weight(u, "tier-softmax", math.inf) == 7.0
    with pytest.raises(ValueError, match="temperature"):
        client_weight(u, "tier-softmax", 0.0)
    assert client_weight(u, "uniform") == 1.0
    with pytest.raises(ValueError, match="weighting"):
        client_weight(u, "by-size")
    with pytest.raises(ValueError, match="temperature"):
        FedAvg("tier-softmax", -1.0)
    with pytest.raises(ValueError, match="num_samples"):
        update(DIGITS, {}, 0, "c")
    with pytest.raises(ValueError, match="rank_ratio"):
        ClientUpdate("c", 5, 0.5, DIGITS, {})
