"""A factorized model loaded from a plain one, so every factorization starts from the same function.

Comparisons between ``none``, ``atoms``, ``lowrank`` and ``atoms-lowrank`` are fair only when
round 0's effective filters are equal. The plain model is built once from the seed (PyTorch's
default initialization, the one :mod:`fedcore.models` documents), and each factorized layer is
fitted to the plain layer at the same path: an :class:`AtomConv2d` by the SVD of the stacked
``k×k`` filters (exact when ``num_atoms ≥ k²``), low-rank factors by truncated SVD (the best
rank-``r`` approximation, FedHM's spectral initialization). Every other tensor (BatchNorm,
heads, 1×1 convs, biases) is copied as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear

__all__ = ["load_from_plain"]

_FACTORIZED = (AtomConv2d, LowRankConv2d, LowRankLinear)


@torch.no_grad()
def load_from_plain(model: nn.Module, plain: nn.Module) -> nn.Module:
    """Set ``model``'s tensors from ``plain`` (the same architecture, unfactorized); returns ``model``.

    Raises
    ------
    ValueError
        When a factorized layer has no plain layer of matching shape at its path.
    """
    plain_modules = dict(plain.named_modules())
    covered: set[str] = set()
    for path, layer in model.named_modules():
        if not isinstance(layer, _FACTORIZED):
            continue
        source = plain_modules.get(path)
        expected = nn.Linear if isinstance(layer, LowRankLinear) else nn.Conv2d
        if not isinstance(source, expected) or source.weight.shape != _full_shape(layer):
            raise ValueError(f"{path}: no plain {expected.__name__} of shape {tuple(_full_shape(layer))} to fit")
        _fit(layer, source)
        covered.update(f"{path}.{name}" if path else name for name, _ in layer.named_parameters())
    plain_state = plain.state_dict()
    for name, tensor in model.state_dict().items():
        if name in covered:
            continue
        if name not in plain_state or plain_state[name].shape != tensor.shape:
            raise ValueError(f"{name}: the plain model has no tensor of shape {tuple(tensor.shape)}")
        tensor.copy_(plain_state[name])
    return model


def _full_shape(layer: nn.Module) -> torch.Size:
    if isinstance(layer, LowRankLinear):
        return torch.Size((layer.out_features, layer.in_features))
    k = layer.kernel_size
    return torch.Size((layer.out_channels, layer.in_channels, k, k))  # type: ignore[arg-type]  # nn.Module attributes type as Tensor | Module


def _fit(layer: nn.Module, source: nn.Conv2d | nn.Linear) -> None:
    """Copy into ``layer`` the fit its own converter makes of ``source`` (layer identities are kept)."""
    if isinstance(layer, AtomConv2d):
        fitted: nn.Module = AtomConv2d.from_conv(source, layer.num_atoms, rank=layer.rank)  # type: ignore[arg-type]
    elif isinstance(layer, LowRankConv2d):
        fitted = LowRankConv2d.from_full(source, layer.rank)  # type: ignore[arg-type]
    else:
        fitted = LowRankLinear.from_full(source, layer.rank)  # type: ignore[arg-type]
    if (layer.bias is None) != (source.bias is None):
        raise ValueError(f"{type(layer).__name__} and the plain layer disagree on a bias")
    layer.load_state_dict(fitted.state_dict())
