"""Personalized FL's phase (filter-decomposition §3.3): the client's own atoms under the global coefficients.

Each client keeps atoms ``D_l`` of its own and trains only those on a frozen copy of the
received model; what the federation averages is untouched by it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from fedcore.layers import AtomConv2d
from fedcore.training.batchnorm import batchnorm_layers, recompute_statistics
from fedcore.training.config import TrainConfig
from fedcore.training.loop import Batches, Dataset, phase, resolve_device, seeded

__all__ = [
    "atom_names",
    "check_personal_atoms",
    "personal_evaluation_model",
    "personalized_model",
    "train_personal",
    "train_personal_atoms",
]

# Decorrelates the personal phase's shuffling from the global phase's (same client seed).
_PERSONAL_SEED_OFFSET = 0x9E3779B97F4A7C15


def atom_names(model: nn.Module) -> list[str]:
    """``state_dict`` names of every :class:`AtomConv2d`'s atoms, e.g. ``conv2.atoms``."""
    return [f"{name}.atoms" if name else "atoms" for name, m in model.named_modules() if isinstance(m, AtomConv2d)]


def check_personal_atoms(model: nn.Module, personal_atoms: Mapping[str, Tensor]) -> None:
    """Refuse atoms that do not name and shape exactly the model's atom tensors."""
    names = atom_names(model)
    if not names:
        raise ValueError(
            "personal atoms need a model with AtomConv2d layers (factorization 'atoms' or 'atoms-lowrank')"
        )
    if set(personal_atoms) != set(names):
        raise ValueError(
            f"personal_atoms must name exactly the model's atom tensors {sorted(names)}, got {sorted(personal_atoms)}"
        )
    state = model.state_dict()
    for name in names:
        if tuple(personal_atoms[name].shape) != tuple(state[name].shape):
            raise ValueError(
                f"personal atoms {name!r} have shape {tuple(personal_atoms[name].shape)}, "
                f"expected {tuple(state[name].shape)}"
            )


def personalized_model(model: nn.Module, personal_atoms: Mapping[str, Tensor]) -> nn.Module:
    """A deep copy whose filters are the global coefficients × the client's atoms (§3.3's evaluation model)."""
    check_personal_atoms(model, personal_atoms)
    personal = copy.deepcopy(model)
    params = dict(personal.named_parameters())
    with torch.no_grad():
        for name, atoms in personal_atoms.items():
            params[name].copy_(atoms)
    return personal


def personal_evaluation_model(
    model: nn.Module, personal_atoms: Mapping[str, Tensor], train_data: Dataset | None, config: TrainConfig, seed: int
) -> nn.Module:
    """:func:`personalized_model` ready to evaluate, on the config's device. The BatchNorm statistics the
    received model carries describe the global filters, not the coefficients × the client's atoms (their scale
    alone can differ by any factor), so a model with BatchNorm gets them recomputed for its own filters over
    the client's training split, as ``bn_statistics = "precise"`` does for a pushed model."""
    personal = personalized_model(model, personal_atoms)
    device = resolve_device(config.device)
    personal.to(device)
    if batchnorm_layers(personal):
        if train_data is None:
            raise ValueError(
                "personal atoms with BatchNorm are evaluated with statistics recomputed for the personal filters: "
                "that needs the client's training data"
            )
        with seeded(seed, device):
            recompute_statistics(personal, Batches(train_data, device), config.batch_size, seed)
    return personal


def train_personal_atoms(
    model: nn.Module,
    data: Dataset,
    config: TrainConfig,
    personal_atoms: Mapping[str, Tensor],
    *,
    seed: int,
) -> tuple[nn.Module, dict[str, float]]:
    """Train the client's atoms ``D_l`` with everything else frozen at the received values.

    Returns the trained personalized copy (on the config's device; the received model is
    untouched) and its metrics. SGD with the config's momentum and weight decay, the atoms' rate
    set as in the global update (``atom_lr``), for ``personal_epochs``; the FedProx, SCAFFOLD and
    Frobenius terms belong to the global update.
    """
    check_personal_atoms(model, personal_atoms)
    device = resolve_device(config.device)
    return train_personal(model, Batches(data, device), config, personal_atoms, seed, device)


def train_personal(
    model: nn.Module,
    batches: Batches,
    config: TrainConfig,
    personal_atoms: Mapping[str, Tensor],
    seed: int,
    device: torch.device,
) -> tuple[nn.Module, dict[str, float]]:
    """:func:`train_personal_atoms` on data already on the device (the local update shares its batches)."""
    personal = personalized_model(model, personal_atoms).to(device)
    for p in personal.parameters():
        p.requires_grad_(False)
    named = dict(personal.named_parameters())
    params = {name: named[name] for name in atom_names(personal)}
    for p in params.values():
        p.requires_grad_(True)
    pseed = (seed + _PERSONAL_SEED_OFFSET) % 2**64
    stats = phase(personal, params, batches, config, config.effective_personal_epochs, pseed)
    metrics = {
        "personal_train_loss": stats.loss,
        "personal_train_accuracy": stats.accuracy,
        "personal_steps": float(stats.steps),
    }
    return personal, metrics
