"""Ditto's personal model (Li et al. 2021): ``v_k`` trained on ``F_k(v) + λ/2‖v − w‖²``.

``w`` is the global model the client received this round; the global update that follows is
plain FedAvg (or the federation's strategy) and never sees ``v_k``. As λ → ∞ ``v_k`` is pulled
onto ``w``; at λ = 0 it is a local-only model. The decomposition paper uses λ = 0.75.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from torch import Tensor, nn

from fedcore.training.config import TrainConfig
from fedcore.training.loop import Batches, phase
from fedcore.training.terms import proximal_penalty

__all__ = ["check_personal_model", "train_ditto"]

# Decorrelates the personal model's shuffling from the global update's (same client seed).
_DITTO_SEED_OFFSET = 0x2545F4914F6CDD1D


def check_personal_model(model: nn.Module, personal: Mapping[str, Tensor]) -> None:
    """Refuse a personal model that does not name and shape exactly the model's ``state_dict``."""
    state = model.state_dict()
    if set(personal) != set(state):
        missing, extra = sorted(set(state) - set(personal)), sorted(set(personal) - set(state))
        raise ValueError(f"personal model must hold the model's tensors; missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in personal.items():
        if tuple(t.shape) != tuple(state[name].shape):
            raise ValueError(f"personal model {name!r} has shape {tuple(t.shape)}, expected {tuple(state[name].shape)}")


def train_ditto(
    model: nn.Module, batches: Batches, config: TrainConfig, personal: Mapping[str, Tensor], seed: int
) -> tuple[nn.Module, dict[str, float]]:
    """A trained copy of ``v_k`` (``personal`` loaded into a copy of ``model``); ``model`` is ``w``, untouched.

    ``personal_epochs`` of SGD with the config's rate and momentum on every trainable tensor.
    """
    check_personal_model(model, personal)
    reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    v = copy.deepcopy(model)
    v.load_state_dict(personal)
    params = {n: p for n, p in v.named_parameters() if p.requires_grad}
    penalty = proximal_penalty(params, reference, config.ditto_lambda)
    pseed = (seed + _DITTO_SEED_OFFSET) % 2**64
    stats = phase(v, params, batches, config, config.effective_personal_epochs, pseed, penalty)
    return v, {
        "personal_train_loss": stats.loss,
        "personal_train_accuracy": stats.accuracy,
        "personal_steps": float(stats.steps),
    }
