"""Accuracy and loss of a model on a dataset: the clients' and the server's evaluations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedcore.training.config import EvalResult, check_int
from fedcore.training.loop import Batches, Dataset, resolve_device

__all__ = ["evaluate"]


def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256, device: str = "auto") -> EvalResult:
    """Accuracy and mean cross-entropy in eval mode; the model's train/eval mode is restored after."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    check_int("batch_size", batch_size, 1)
    dev = resolve_device(device)
    batches = Batches(data, dev)
    model.to(dev)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
    correct = torch.zeros((), device=dev, dtype=torch.long)
    try:
        with torch.no_grad():
            for xb, yb in batches.epoch(batch_size, None):
                logits = model(xb)
                batches.check_classes(logits.shape[-1])
                loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
                correct += (logits.argmax(dim=1) == yb).sum()
    finally:
        model.train(was_training)
    return EvalResult(accuracy=float(correct) / batches.n, loss=float(loss_sum) / batches.n, num_samples=batches.n)
