"""A head/body split of a model whose head is tied to its embedding (``head.weight = embed.weight``): FedPer kept
``head.weight`` on the client while ``embed.weight``, the same Parameter, was averaged every round, so the personal
head was not personal. Refused at setup, naming both; the same model untied is accepted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aggregator_service.config import FederationConfig
from fedcore.spec import ModelSpec
from fedcore.training.personalization import personal_tensors


class TiedLM(nn.Module):
    def __init__(self, num_classes: int = 12, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, num_classes)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x.long()))
        return self.head(h[:, -1])


def untied(num_classes: int = 12) -> TiedLM:
    return TiedLM(num_classes, tie=False)


def federation(model: str, personalization: str) -> FederationConfig:
    return FederationConfig(
        model=f"test_personalization_ties:{model}", num_classes=12, input_shape=[6], personalization=personalization
    )


@pytest.mark.parametrize(
    ("method", "mine", "shared"),
    [
        ("fedper", "head.weight", "embed.weight"),
        ("fedrep", "head.weight", "embed.weight"),
        ("lg", "embed.weight", "head.weight"),
    ],
)
def test_a_split_through_a_tied_parameter_is_refused_naming_both(method, mine, shared):
    net = TiedLM()
    assert net.head.weight is net.embed.weight
    with pytest.raises(ValueError) as info:
        federation("TiedLM", method)
    message = str(info.value)
    assert f"keeps {mine} on each client" in message and f"tied parameter with {shared}" in message, message
    assert "\n" not in message


def test_the_untied_model_and_splits_that_keep_both_or_neither_are_accepted():
    spec = federation("untied", "fedper").spec
    assert personal_tensors(spec, "fedper") == ("head.weight", "head.bias")
    tied = ModelSpec("test_personalization_ties:TiedLM", 12, input_shape=(6,))
    assert personal_tensors(tied, "ditto") == () and set(personal_tensors(tied, "local")) == set(tied.names)
    federation("TiedLM", "ft")
