"""FedAvg+FT / FedProx+FT: the received global model fine-tuned on the client's data before evaluation.

The global update itself is unchanged; the fine-tuned copy is evaluated and dropped (the
decomposition paper fine-tunes for 10 epochs: ``personal_epochs``). Plain SGD, no proximal term:
the fine-tuning is the client's own.
"""

from __future__ import annotations

import copy

from torch import nn

from fedcore.training.config import TrainConfig
from fedcore.training.loop import Batches, Dataset, phase, resolve_device

__all__ = ["fine_tune"]

# Decorrelates fine-tuning's shuffling from the round's training (same client seed).
_FT_SEED_OFFSET = 0x4F1BBCDCBFA53E0B


def fine_tune(model: nn.Module, data: Dataset, config: TrainConfig, *, seed: int) -> tuple[nn.Module, dict[str, float]]:
    """A copy of ``model`` trained ``personal_epochs`` on ``data`` (every trainable tensor); ``model`` is untouched."""
    device = resolve_device(config.device)
    tuned = copy.deepcopy(model).to(device)
    params = {n: p for n, p in tuned.named_parameters() if p.requires_grad}
    stats = phase(
        tuned, params, Batches(data, device), config, config.effective_personal_epochs, (seed + _FT_SEED_OFFSET) % 2**64
    )
    return tuned, {"ft_train_loss": stats.loss, "ft_train_accuracy": stats.accuracy, "ft_steps": float(stats.steps)}
