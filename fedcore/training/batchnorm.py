"""BatchNorm's running statistics, recomputed for the weights a client pushes ("precise BN").

PyTorch tracks ``running_mean``/``running_var`` as an exponential average over the batches of
training, taken while the weights move. After a few local steps those averages describe
weights the client no longer has: on MobileNetV3 at 32×32 they were 10²–10⁹× off the
activations' real variance, and a federation that averaged them stayed at chance in eval mode
while the same weights classified 99% right in train mode. With ``bn_statistics = "precise"``
a client recomputes them once after local training, in one no-grad pass over its training
split in train mode, as a cumulative average over shuffled minibatches (the rule of
``torch.optim.swa_utils.update_bn`` and Precise-BN), so what it pushes are the statistics of
the weights it pushes. The server then pools them over the clients' data
(:func:`aggregator_service.batchnorm_pooling`). ``"running"`` keeps PyTorch's running averages
as trained: FedAvg's literal behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

from fedcore.training.loop import Batches

__all__ = ["batchnorm_layers", "recompute_statistics"]


def batchnorm_layers(model: nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def recompute_statistics(model: nn.Module, batches: Batches, batch_size: int, seed: int) -> int:
    """Replace the model's BatchNorm running statistics by their cumulative average over one shuffled
    pass of ``batches`` (no gradients, weights untouched); returns the number of samples seen.

    A model without BatchNorm, or data too small for a minibatch of two, is left as it is (returns 0).
    The caller seeds torch's global RNG (dropout draws in train mode).
    """
    if not batchnorm_layers(model) or batches.n < 2:
        return 0
    size = max(2, batch_size)
    seen = 0

    def inputs() -> Iterator[Tensor]:
        nonlocal seen
        for xb, _ in batches.epoch(size, torch.Generator().manual_seed(seed), min_batch=2):
            seen += len(xb)
            yield xb

    # update_bn resets every BatchNorm's statistics, runs the model in train mode with momentum=None
    # (a cumulative average of the batches' means and unbiased variances) and restores mode and momenta
    update_bn(inputs(), model)
    return seen
