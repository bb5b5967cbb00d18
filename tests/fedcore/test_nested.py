"""Nested tiers: a larger tier's step on the smallest tier's part is the smallest model's step.

The oracle for each case is plain autograd on separate models: the smallest tier's own model (the
spec at ⅛, holding the cut) and the larger tier's model as it is. With one full-batch step of plain SGD
(no momentum, one rate) the nested step must move the cut's entries and every unfactorized tensor by the
smallest model's gradient, and the entries past the cut by the whole model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aggregator_service.config import FederationConfig
from fedcore.data import load_dataset
from fedcore.spec import ModelSpec, factored_matrix, tensor_from_matrix
from fedcore.training import TrainConfig
from fedcore.training.loop import Batches, sgd
from fedcore.training.nested import NestedCut, NestedPasses, nested_cut

LR = 0.1
N = 20


def _batch() -> tuple[Tensor, Tensor]:
    train, _ = load_dataset("digits")
    idx = np.arange(N)
    return train.x[idx], train.y[idx]


class _Data:
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)


def _one_step(model: nn.Module, cut: NestedCut | None, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """One full-batch step of plain SGD (no momentum, one rate for every factor)."""
    config = TrainConfig(batch_size=N, lr=LR, momentum=0.0, atom_lr="shared", device="cpu")
    params = dict(model.named_parameters())
    sgd(model, params, Batches(_Data(x, y), torch.device("cpu")), config, 1, 0, nested=cut)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _gradients(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _held(grad: Tensor, weight: Tensor, rank: int) -> Tensor:
    """``grad``'s entries with ``min(i, j) < rank`` in ``weight``'s full singular basis (square ``L``, ``R``)."""
    left, _, right_t = torch.linalg.svd(factored_matrix(weight).double(), full_matrices=True)
    coords = left.T @ factored_matrix(grad).double() @ right_t.T
    i = torch.arange(coords.shape[0])[:, None]
    j = torch.arange(coords.shape[1])[None, :]
    kept = torch.where(torch.minimum(i, j) < rank, coords, 0.0)
    return tensor_from_matrix((left @ kept @ right_t).float(), grad.shape)


def _truncated(weight: Tensor, rank: int) -> Tensor:
    u, s, vh = torch.linalg.svd(factored_matrix(weight).double(), full_matrices=False)
    return tensor_from_matrix((u[:, :rank] * s[:rank]) @ vh[:rank], weight.shape).float()


def test_the_cut_names_the_smallest_tiers_ranks() -> None:
    # hand-derived: r = round(γ·c_out): conv2 64 → 8 at ⅛, 32 at ½; fc1 128 → 16 and 64; conv1 is the stem
    full = ModelSpec("digits-cnn", 10, "lowrank")
    assert nested_cut(full, 0.125) == NestedCut({"conv2.weight": 8, "fc1.weight": 16}, {})
    assert nested_cut(full.at_tier(0.5), 0.125) == NestedCut(
        {}, {"conv2.lowrank_u": ("conv2.lowrank_v", 8), "fc1.lowrank_u": ("fc1.lowrank_v", 16)}
    )
    assert nested_cut(full.at_tier(0.125), 0.125) is None  # the smallest tier trains its own model
    atoms = ModelSpec("digits-cnn", 10, "atoms-lowrank")
    assert nested_cut(atoms, 0.125) == NestedCut({"conv2.coefficients": 8, "fc1.weight": 16}, {})


def test_a_dense_tier_steps_the_cut_as_the_smallest_model_and_the_rest_as_the_whole() -> None:
    x, y = _batch()
    spec = ModelSpec("digits-cnn", 10, "lowrank")
    torch.manual_seed(0)
    model = spec.build()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ranks = {"conv2.weight": 8, "fc1.weight": 16}
    # the oracle's two models: the smallest tier's (the plain model holding the truncated SVDs) and the whole
    small = spec.build()
    small.load_state_dict({**start, **{n: _truncated(start[n], r) for n, r in ranks.items()}})
    whole = spec.build()
    whole.load_state_dict(start)
    g_small, g_whole = _gradients(small, x, y), _gradients(whole, x, y)

    after = _one_step(model, nested_cut(spec, 0.125), x, y)
    for name, value in start.items():
        if name in ranks:
            r = ranks[name]
            expected = value - LR * (_held(g_small[name], value, r) + g_whole[name] - _held(g_whole[name], value, r))
        else:
            expected = value - LR * g_small[name]  # unfactorized: the smallest model's gradient alone
        torch.testing.assert_close(after[name], expected, atol=2e-5, rtol=1e-4, msg=name)


def test_a_factor_pair_steps_its_first_components_as_the_smallest_pair() -> None:
    x, y = _batch()
    spec = ModelSpec("digits-cnn", 10, "lowrank").at_tier(0.5)
    torch.manual_seed(1)
    model = spec.build()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ranks = {"conv2": 8, "fc1": 16}
    small_spec = ModelSpec("digits-cnn", 10, "lowrank").at_tier(0.125)
    small = small_spec.build()
    sliced = dict(start)
    for layer, r in ranks.items():
        sliced[f"{layer}.lowrank_u"] = start[f"{layer}.lowrank_u"][:, :r]
        sliced[f"{layer}.lowrank_v"] = start[f"{layer}.lowrank_v"][:r]
    small.load_state_dict(sliced)
    whole = spec.build()
    whole.load_state_dict(start)
    g_small, g_whole = _gradients(small, x, y), _gradients(whole, x, y)

    after = _one_step(model, nested_cut(spec, 0.125), x, y)
    for name, value in start.items():
        layer, _, factor = name.rpartition(".")
        if layer in ranks and factor in ("lowrank_u", "lowrank_v"):
            r = ranks[layer]
            grad = g_whole[name].clone()
            if factor == "lowrank_u":
                grad[:, :r] = g_small[name]
            else:
                grad[:r] = g_small[name]
        else:
            grad = g_small[name]
        torch.testing.assert_close(after[name], value - LR * grad, atol=2e-5, rtol=1e-4, msg=name)


def test_without_a_cut_the_step_is_the_plain_one_to_the_bit() -> None:
    x, y = _batch()
    spec = ModelSpec("digits-cnn", 10, "lowrank").at_tier(0.125)
    torch.manual_seed(2)
    a = spec.build()
    b = spec.build()
    b.load_state_dict(a.state_dict())
    plain, none = _one_step(a, None, x, y), _one_step(b, nested_cut(spec, 0.125), x, y)
    assert all(torch.equal(plain[n], none[n]) for n in plain)


def test_the_cut_pass_leaves_batchnorm_statistics_as_the_whole_model_leaves_them() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    twin = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    params = dict(model.named_parameters())
    passes = NestedPasses(NestedCut({"0.weight": 2}, {}), params)
    logits, loss, cut_loss = passes.losses(model, params, x, y)
    expected = twin(x)  # train mode: one update of the running statistics
    torch.testing.assert_close(logits, expected)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, dict(twin.named_buffers())[name], msg=name)
    assert cut_loss.item() != pytest.approx(loss.item())  # the cut is another model


def test_the_federation_tells_larger_tiers_the_smallest_one_only_when_tiers_mix() -> None:
    def told(**keys) -> float | None:
        config = FederationConfig(factorization="lowrank", **keys)
        # the server cuts every tier's first download from the same smallest tier it tells the clients
        assert config.build_federation(num_clients_total=4).nested_rank_ratio == config.train_config().nested_rank_ratio
        return config.train_config().nested_rank_ratio

    assert told(tiers=[1.0, 0.5, 0.25, 0.125]) == 0.125
    assert told(tiers=[0.5, 0.25]) == 0.25
    assert told(tiers=[0.125]) is None and told(tiers=[1.0]) is None
    assert told(tiers=[1.0, 0.125], tier_training="own") is None
    with pytest.raises(ValueError, match="tier_training must be one of nested, own"):
        FederationConfig(factorization="lowrank", tiers=[1.0, 0.125], tier_training="sandwich")
    with pytest.raises(ValueError, match="nested_rank_ratio must be < 1"):
        TrainConfig(nested_rank_ratio=1.0)
    config = TrainConfig(nested_rank_ratio=0.125)
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_a_frozen_cut_trains_the_plain_way() -> None:
    """A user's model whose factorized layers are frozen (a fine-tuned backbone) trains as without the rule."""
    x, y = _batch()
    spec = ModelSpec("digits-cnn", 10, "lowrank")
    torch.manual_seed(4)
    a = spec.build()
    b = spec.build()
    b.load_state_dict(a.state_dict())
    for model in (a, b):
        for name in ("conv2.weight", "fc1.weight"):
            model.get_parameter(name).requires_grad_(False)
    config = TrainConfig(batch_size=N, lr=LR, momentum=0.0, device="cpu")
    for model, cut in ((a, None), (b, nested_cut(spec, 0.125))):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        sgd(model, params, Batches(_Data(x, y), torch.device("cpu")), config, 1, 0, nested=cut)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
