"""The personalization baselines' local training against hand-written full-batch SGD, and their limits.

With one minibatch holding the whole client data, SGD's shuffling cannot matter, so every phase
is checked against a plain ``torch.optim.SGD`` loop written here from the papers' objectives:
FedRep's head-then-body epochs, Ditto's ``F_k(v) + λ/2‖v − w‖²``, FT's plain fine-tuning.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcore.data import load_dataset
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig, local_update
from fedcore.training.finetune import fine_tune
from fedcore.training.personalization import PERSONALIZATIONS, personal_tensors

SPEC = ModelSpec("digits-cnn", 10)
N = 48  # one full batch


@pytest.fixture(scope="module")
def data():
    train, _ = load_dataset("digits")
    return train.subset(range(N))


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"batch_size": N, "lr": 0.05, "momentum": 0.0, "device": "cpu", **kw})


def _full_batch_sgd(model: nn.Module, names: list[str], data, steps: int, lr: float, reg=None) -> None:
    """The oracle: ``steps`` of gradient descent on the whole data, only ``names`` moving."""
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(data.x), data.y.long())
        if reg is not None:
            loss = loss + reg(params)
        loss.backward()
        opt.step()


def _close(a: dict, b: dict, names) -> None:
    for n in names:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_which_tensors_each_baseline_keeps_on_the_client() -> None:
    head = ("head.weight", "head.bias")
    assert personal_tensors(SPEC, "fedper") == head == personal_tensors(SPEC, "fedrep")
    assert set(personal_tensors(SPEC, "lg")) == set(SPEC.names) - set(head)
    assert personal_tensors(SPEC, "local") == tuple(SPEC.names)
    assert personal_tensors(SPEC, "ditto") == personal_tensors(SPEC, "ft") == personal_tensors(SPEC, "none") == ()
    # a user's shapes: ResNet-18's body holds BN statistics and their 0-d step counters
    resnet = ModelSpec("resnet18", 10)
    body = set(personal_tensors(resnet, "lg"))
    assert "bn1.num_batches_tracked" in body and "bn1.running_var" in body and "head.weight" not in body
    with pytest.raises(ValueError, match="personalization must be one of"):
        TrainConfig(personalization="fedbn")
    assert set(PERSONALIZATIONS) == {"none", "ft", "fedper", "fedrep", "lg", "ditto", "local"}


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen(data) -> None:
    start = SPEC.initial_model(1)
    got = local_update(
        copy.deepcopy(start), data, _config(personalization="fedrep", head_epochs=3, local_epochs=2), seed=7
    )

    oracle = copy.deepcopy(start)
    head = ["head.weight", "head.bias"]
    body = [n for n, _ in oracle.named_parameters() if n not in head]
    _full_batch_sgd(oracle, head, data, 3, 0.05)
    after_head = {n: t.detach().clone() for n, t in oracle.state_dict().items()}
    _full_batch_sgd(oracle, body, data, 2, 0.05)
    expected = oracle.state_dict()
    _close(got.tensors, expected, expected)
    _close(got.tensors, after_head, head)  # the body phase left the head where its own phase put it
    assert not torch.equal(got.tensors["head.weight"], start.state_dict()["head.weight"])


def test_ditto_trains_its_personal_model_on_the_regularized_loss_and_fedavg_on_the_plain_one(data) -> None:
    w = SPEC.initial_model(2)
    v0 = {n: t + 0.01 * torch.randn_like(t) for n, t in SPEC.initial_model(3).state_dict().items()}
    lam = 0.75
    got = local_update(
        copy.deepcopy(w),
        data,
        _config(personalization="ditto", personal_epochs=4, ditto_lambda=lam),
        seed=1,
        personal_model=v0,
    )
    reference = {n: p.detach().clone() for n, p in w.named_parameters()}
    v = copy.deepcopy(w)
    v.load_state_dict(v0)
    names = [n for n, _ in v.named_parameters()]
    _full_batch_sgd(v, names, data, 4, 0.05, lambda p: lam / 2 * sum((p[n] - reference[n]).pow(2).sum() for n in names))
    _close(got.personal_model, v.state_dict(), names)
    # the global update is FedAvg's, untouched by v
    plain = local_update(copy.deepcopy(w), data, _config(), seed=1)
    for n in plain.tensors:
        assert torch.equal(got.tensors[n], plain.tensors[n]), n


def test_ditto_personal_model_approaches_the_global_one_as_lambda_grows(data) -> None:
    w = SPEC.initial_model(2)
    v0 = {n: t.clone() for n, t in w.state_dict().items()}  # a fresh personal model starts at w

    def drift(lam: float) -> float:
        res = local_update(
            copy.deepcopy(w),
            data,
            _config(personalization="ditto", personal_epochs=20, ditto_lambda=lam, lr=0.005),
            seed=1,
            personal_model=v0,
        )
        return sum((res.personal_model[n] - t).pow(2).sum() for n, t in w.state_dict().items()).sqrt().item()

    free, tight, tighter = drift(0.0), drift(20.0), drift(200.0)
    # ‖v − w‖ ≤ ‖∇F‖/λ: ten times λ, a tenth (within the transient) of the distance; λ → ∞ gives v = w
    assert tighter < tight / 4 < free / 4
    assert tighter < free / 10


def test_fine_tuning_is_plain_sgd_on_a_copy(data) -> None:
    w = SPEC.initial_model(4)
    before = {n: t.clone() for n, t in w.state_dict().items()}
    tuned, metrics = fine_tune(w, data, _config(personalization="ft", personal_epochs=3), seed=0)
    oracle = copy.deepcopy(w)
    _full_batch_sgd(oracle, [n for n, _ in oracle.named_parameters()], data, 3, 0.05)
    _close(tuned.state_dict(), oracle.state_dict(), oracle.state_dict())
    assert all(torch.equal(w.state_dict()[n], before[n]) for n in before)  # the global model is untouched
    assert metrics["ft_steps"] == 3


def test_a_personal_model_only_with_ditto_and_no_control_variates_across_a_split(data) -> None:
    w = SPEC.initial_model(0)
    with pytest.raises(ValueError, match="only Ditto"):
        local_update(copy.deepcopy(w), data, _config(personalization="ditto"), seed=0)
    with pytest.raises(ValueError, match="only Ditto"):
        local_update(copy.deepcopy(w), data, _config(), seed=0, personal_model=w.state_dict())
    zeros = {n: torch.zeros_like(p) for n, p in w.named_parameters()}
    with pytest.raises(ValueError, match="SCAFFOLD"):
        local_update(copy.deepcopy(w), data, _config(personalization="fedper"), seed=0, server_control=zeros)
