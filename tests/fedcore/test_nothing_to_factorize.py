"""A factorization that would factorize nothing is refused, as 'atoms' already was: lowrank and atoms-lowrank on an
LSTM or a Conv1d text model ran with records identical to 'none' (and tiers below 1 trained the full model at
FedAvg's bytes while the log said "cut to tier 0.25"); so did tiers that cut no tensor of a model that has a
factorizable layer. Models that have something to factorize are accepted as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aggregator_service.config import FederationConfig
from fedcore.spec import ModelSpec


class CharLSTM(nn.Module):
    """Embedding, LSTM, linear head: the head is the only Linear, and it is kept whole."""

    def __init__(self, num_classes: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x.long()))
        return self.head(h[:, -1])


class ConvText(nn.Module):
    """Conv1d layers only (no nn.Conv2d), then the head."""

    def __init__(self, num_classes: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 16, 5, padding=2)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(self.embed(x.long()).transpose(1, 2))).amax(-1))


class SmallCNN(nn.Module):
    """A normal CNN: two 3×3 convs, a body linear, the head (on 1×8×8)."""

    def __init__(self, num_classes: int = 7) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))))


class Widening(nn.Sequential):
    """One body linear 4 → 16: rank-r factors hold r·20 numbers against its 64, smaller only for r ≤ 3."""

    def __init__(self, num_classes: int = 7) -> None:
        super().__init__(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, num_classes))


def config(model: str, factorization: str, tiers: list[float], shape: list[int]) -> FederationConfig:
    return FederationConfig(
        model=f"test_nothing_to_factorize:{model}",
        num_classes=7,
        factorization=factorization,
        tiers=tiers,
        input_shape=shape,
    )


@pytest.mark.parametrize("factorization", ["lowrank", "atoms-lowrank"])
@pytest.mark.parametrize(("model", "looked"), [("CharLSTM", ["head (the head"]), ("ConvText", ["conv (a Conv1d"])])
def test_a_model_with_nothing_to_factorize_is_refused_naming_the_layers_and_none(model, looked, factorization):
    for tiers in ([1.0], [1.0, 0.25]):
        with pytest.raises(ValueError) as info:
            config(model, factorization, tiers, [12])
        message = str(info.value)
        assert f"factorization {factorization!r} finds nothing" in message, message
        assert "use factorization 'none'" in message and "\n" not in message
        for name in [*looked, "head (the head"]:
            assert name in message, message
    spec = config(model, "none", [1.0], [12]).spec  # what the message suggests runs
    assert {t.role for t in spec.tensors} <= {"body", "head", "buffer"}


@pytest.mark.parametrize("factorization", ["lowrank", "atoms-lowrank"])
def test_a_normal_cnn_is_still_accepted_and_its_low_tier_is_cut(factorization):
    conf = config("SmallCNN", factorization, [1.0, 0.25], [1, 8, 8])
    full = sum(t.numel for t in conf.spec.tensors)
    low = sum(t.numel for t in conf.spec.at_tier(0.25).tensors)
    assert low < full
    assert ModelSpec("digits-cnn", 10, factorization).tensors  # the zoo's as before


def test_tiers_that_cut_no_tensor_are_refused_and_one_that_cuts_is_accepted():
    # the oracle, by hand: at γ the linear's rank is ⌈γ·16⌉ (at most its 4 inputs), smaller than it only for r ≤ 3
    for tiers in ([1.0, 0.5], [1.0, 0.5, 0.25]):
        with pytest.raises(ValueError, match=r"tiers .*cut no tensor of model .*use tiers = \[1\]"):
            config("Widening", "lowrank", tiers, [4])
    conf = config("Widening", "lowrank", [1.0, 0.25, 0.125], [4])
    shapes = {t.name: t.shape for t in conf.spec.at_tier(0.125).tensors}
    assert shapes["0.lowrank_u"] == (16, 2) and shapes["0.lowrank_v"] == (2, 4)
