"""FedRep's first phase (Collins et al. 2021): the personal head trained with the body frozen.

FedRep alternates within a client's round: ``head_epochs`` on the head (the body frozen at the
received global values), then ``local_epochs`` on the body with the head frozen; only the body
is averaged. :func:`~fedcore.training.update.local_update` runs this phase first and then
trains the body.
"""

from __future__ import annotations

from torch import nn

from fedcore.spec import tensor_roles
from fedcore.training.config import TrainConfig
from fedcore.training.loop import Batches, phase, training_only

__all__ = ["head_parameters", "train_head"]

# Decorrelates the head phase's shuffling from the body phase's (same client seed).
_HEAD_SEED_OFFSET = 0x632BE59BD9B4E019


def head_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of the model's ``head`` (its last Linear); refused when it has none."""
    heads = [n for n, role in tensor_roles(model).items() if role == "head"]
    if not heads:
        raise ValueError("FedRep needs a model whose last Linear is a module named 'head'")
    return heads


def train_head(model: nn.Module, batches: Batches, config: TrainConfig, seed: int) -> dict[str, float]:
    """Train the head in place for ``config.head_epochs`` with every other parameter frozen."""
    with training_only(model, head_parameters(model)) as params:
        stats = phase(model, params, batches, config, config.head_epochs, (seed + _HEAD_SEED_OFFSET) % 2**64)
    return {"head_train_loss": stats.loss, "head_train_accuracy": stats.accuracy, "head_steps": float(stats.steps)}
