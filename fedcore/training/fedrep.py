"""FedRep's first phase (Collins et al. 2021): the personal head trained with the body frozen.

FedRep alternates within a client's round: ``head_epochs`` on the head (the body frozen at the
received global values), then ``local_epochs`` on the body with the head frozen; only the body
is averaged. :func:`~fedcore.training.update.local_update` runs this phase first and then
trains the body.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from fedcore.spec import tensor_roles
from fedcore.training.config import TrainConfig
from fedcore.training.loop import Batches, phase, training_only

__all__ = ["head_parameters", "train_head"]

# Decorrelates the head phase's shuffling from the body phase's (same client seed).
_HEAD_SEED_OFFSET = 0x632BE59BD9B4E019


def head_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of the model's last Linear, the head when the federation names none; refused
    when it has none."""
    heads = [n for n, role in tensor_roles(model).items() if role == "head"]
    if not heads:
        raise ValueError("FedRep needs a classifier head: the model has no nn.Linear; name its head in [federation]")
    return heads


def train_head(
    model: nn.Module, batches: Batches, config: TrainConfig, seed: int, head: Collection[str] | None = None
) -> dict[str, float]:
    """Train the head (``head``'s parameters: the federation's, else the last Linear's) in place for
    ``config.head_epochs`` with every other parameter frozen."""
    names = list(head) if head is not None else head_parameters(model)
    with training_only(model, names) as params:
        stats = phase(model, params, batches, config, config.head_epochs, (seed + _HEAD_SEED_OFFSET) % 2**64)
    return {"head_train_loss": stats.loss, "head_train_accuracy": stats.accuracy, "head_steps": float(stats.steps)}
