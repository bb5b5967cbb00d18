"""BatchNorm statistics a client pushes: recomputed for its trained weights, and no crash on a 1-sample batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fedcore.data import ArrayDataset
from fedcore.training import TrainConfig, local_update
from fedcore.training.batchnorm import recompute_statistics
from fedcore.training.loop import Batches

CPU = "cpu"


def toy(n: int, seed: int = 0) -> ArrayDataset:
    """3-channel 8×8 inputs shifted by their class, so that every channel's statistics depend on the data."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
    return ArrayDataset(x, y, 3, "toy")


def bn_net(seed: int = 0) -> nn.Module:
    """conv → BN → pool to 1×1 → BN (1×1 maps: train-mode BN refuses one sample) → head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.BatchNorm2d(6),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def first_bn_input(model: nn.Module, x: Tensor) -> np.ndarray:
    """The first BatchNorm's input over the whole data as (N·H·W, C), computed without any BatchNorm."""
    with torch.no_grad():
        a = model[0](x)
    return a.permute(0, 2, 3, 1).reshape(-1, a.shape[1]).double().numpy()


def test_one_batch_gives_the_datas_mean_and_unbiased_variance() -> None:
    data = toy(40)
    model = bn_net()
    expected = first_bn_input(model, data.x)
    seen = recompute_statistics(model, Batches(data, torch.device(CPU)), batch_size=64, seed=0)
    assert seen == 40
    bn = model[1]
    np.testing.assert_allclose(bn.running_mean.double().numpy(), expected.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var.double().numpy(), expected.var(axis=0, ddof=1), rtol=1e-4)
    assert int(bn.num_batches_tracked) == 1


def test_several_batches_average_the_batch_statistics_and_leave_weights_and_mode() -> None:
    data = toy(30)
    model = bn_net()
    model.eval()
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    # batches of 10 in the seeded order: the running mean is the mean of the three batch means (equal sizes)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(5))
    acts = [first_bn_input(model, data.x[order[s : s + 10]]) for s in range(0, 30, 10)]
    recompute_statistics(model, Batches(data, torch.device(CPU)), batch_size=10, seed=5)
    bn = model[1]
    np.testing.assert_allclose(
        bn.running_mean.double().numpy(), np.mean([a.mean(axis=0) for a in acts], axis=0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        bn.running_var.double().numpy(), np.mean([a.var(axis=0, ddof=1) for a in acts], axis=0), rtol=1e-4
    )
    assert not model.training
    assert bn.momentum == 0.1
    for k, v in model.state_dict().items():
        if k in weights:
            assert torch.equal(v, weights[k]), k


def test_a_model_without_batchnorm_or_a_single_sample_is_left_alone() -> None:
    plain = nn.Sequential(nn.Flatten(), nn.Linear(192, 3))
    before = copy.deepcopy(plain.state_dict())
    assert recompute_statistics(plain, Batches(toy(12), torch.device(CPU)), 4, 0) == 0
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())
    model = bn_net()
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    assert recompute_statistics(model, Batches(toy(1), torch.device(CPU)), 4, 0) == 0
    assert all(torch.equal(stats[k], v) for k, v in model.state_dict().items())


def test_a_last_batch_of_one_sample_does_not_stop_a_batchnorm_model() -> None:
    data = toy(11)  # batches of 10 leave one sample, whose 1×1 maps train-mode BatchNorm cannot normalize
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn_net()(data.x[:1])
    result = local_update(bn_net(), data, TrainConfig(batch_size=10, lr=0.05, device=CPU), seed=0)
    assert result.num_samples == 11
    assert result.metrics["steps"] == 1.0  # the one-sample batch was skipped
    assert result.metrics["bn_samples"] == 10.0


def test_the_pushed_statistics_are_those_of_the_pushed_weights() -> None:
    data = toy(60)
    config = TrainConfig(batch_size=60, lr=0.1, local_epochs=3, device=CPU)  # one batch: exact statistics
    precise = local_update(bn_net(), data, config, seed=1)
    running = local_update(bn_net(), data, TrainConfig(**{**config.to_dict(), "bn_statistics": "running"}), seed=1)
    # the weights train the same way: only the statistics differ
    assert torch.equal(precise.tensors["0.weight"], running.tensors["0.weight"])
    trained = bn_net()
    trained.load_state_dict(precise.tensors)
    expected = first_bn_input(trained, data.x)
    got_mean, got_var = precise.tensors["1.running_mean"].double(), precise.tensors["1.running_var"].double()
    np.testing.assert_allclose(got_mean.numpy(), expected.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_var.numpy(), expected.var(axis=0, ddof=1), rtol=1e-4)
    # PyTorch's running averages (momentum 0.1 from mean 0, variance 1) are far from them after 3 steps
    ema_var = running.tensors["1.running_var"].double().numpy()
    assert np.abs(ema_var - expected.var(axis=0, ddof=1)).max() > 0.1


def test_bn_statistics_is_checked() -> None:
    with pytest.raises(ValueError, match="bn_statistics must be one of precise, running"):
        TrainConfig(bn_statistics="exact")
