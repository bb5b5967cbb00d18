"""Bytes a training step keeps for backward, counted from what autograd actually saves.

A tier's training memory is its parameter state plus the activations the forward pass saves for
backward, and for a conv net the activations dominate (ResNet-18 at γ = ⅛, 32×32 inputs: 19 MiB of
parameter state, 4.7 MiB of saved tensors per sample). Like :mod:`fedcore.macs`, the count holds for any
model: one forward pass, on the meta device (shapes only, no memory), runs inside
``torch.autograd.graph.saved_tensors_hooks`` and sums the storages autograd saves.

What counts:

- each saved storage once, with its whole size: a tensor two backward functions save (a ReLU's output,
  which the next layer saves as its input too) is one allocation, and a saved view (a linear's
  ``weight.t()``) keeps its whole storage alive. Storages are told apart by the identity of their
  ``StorageImpl`` (``untyped_storage()._cdata``), the one identity a meta tensor has: meta tensors have
  no data pointer, and the tensor objects the hook receives are new wrappers, views distinct from
  their base;
- not the model's parameters and buffers, which the parameter state already counts
  (:data:`fedcore.tiers.BYTES_PER_TRAINED_PARAMETER`); what a forward pass derives from them (an atom
  layer's filters ``α × D``) is counted, once per batch;
- the input batch and the loss (cross-entropy, as the local update takes it), which a step holds too.

The pass runs in training mode (dropout saves its mask, BatchNorm its batch statistics), which
BatchNorm refuses for one sample: saved bytes are linear in the batch (every activation has the batch
as its leading size), so passes of 2 and 4 samples give the bytes per sample (their difference / 2)
and the bytes per batch (what 2 samples leave beyond 2 × per sample). Not counted: the transient
tensors of backward (each layer's input gradient, freed as the next is made) and kernels' workspaces,
which the caller's margin covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["saved_bytes", "saved_bytes_per_sample"]


def saved_bytes(
    model: nn.Module, input_shape: tuple[int, ...], batch: int, input_dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of the distinct storages autograd saves in one forward pass and loss of ``batch`` samples of
    ``input_dtype``, the model's own parameters and buffers left out (works on the meta device)."""
    device = next(iter(model.parameters())).device
    own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    kept: list[Tensor] = []  # alive until counted, so no storage's identity is reused by another

    def pack(t: Tensor) -> Tensor:
        kept.append(t)
        storage = t.untyped_storage()
        saved.setdefault(storage._cdata, storage.nbytes())
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(torch.zeros(batch, *input_shape, dtype=input_dtype, device=device))
        F.cross_entropy(logits, torch.zeros(batch, dtype=torch.long, device=device))
    return sum(n for key, n in saved.items() if key not in own)


def saved_bytes_per_sample(
    model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype = torch.float32
) -> tuple[int, int]:
    """``(bytes per sample, bytes per batch)`` autograd saves in a training step: a batch of ``b`` samples
    keeps ``b × per sample + per batch``. The model's mode is left as it was."""
    was_training = model.training
    model.train()
    try:
        two = saved_bytes(model, input_shape, 2, input_dtype)
        four = saved_bytes(model, input_shape, 4, input_dtype)
    finally:
        model.train(was_training)
    per_sample = max(0, (four - two) // 2)
    return per_sample, max(0, two - 2 * per_sample)
