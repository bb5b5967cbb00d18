"""Multiply-accumulates per sample, counted from what a module's forward pass actually runs.

Tier assignment compares a tier's MACs with a device's budget, so the count must hold for any
model, not only layers fedatoms knows. PyTorch's FLOP counter sees every matrix multiply and
convolution the forward pass dispatches (FLOPs = 2 × MACs). A pass of two samples minus a pass
of one leaves exactly the per-sample work: what runs once per batch (an atom layer rebuilding
its filters ``α × D``) cancels out. Elementwise work (BatchNorm, activations, pooling) is not
counted, as in the papers' MAC tables.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_macs"]


def _flops(model: nn.Module, input_shape: tuple[int, ...], batch: int, device: torch.device, dtype: torch.dtype) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(batch, *input_shape, dtype=dtype, device=device))
    return int(counter.get_total_flops())


def count_macs(model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype = torch.float32) -> int:
    """Forward multiply-accumulates of one sample of ``input_shape`` in ``input_dtype`` (zeros: token id 0 for
    an integer model), on the model's device (works on the meta device)."""
    was_training = model.training
    model.eval()  # BatchNorm in training mode refuses a single sample
    try:
        device = next(iter(model.parameters())).device
        two = _flops(model, input_shape, 2, device, input_dtype)
        return (two - _flops(model, input_shape, 1, device, input_dtype)) // 2
    finally:
        model.train(was_training)
