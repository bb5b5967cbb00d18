"""What a local update is asked to do (:class:`TrainConfig`) and what it hands back.

The config travels to clients as JSON, so its checks run wherever one is built or decoded:
a bad value fails where it is written, not epochs into a client's round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from torch import Tensor

from fedcore.training.atom_steps import ATOM_LR_RULES
from fedcore.training.personalization import PERSONALIZATIONS

__all__ = ["BN_STATISTICS", "EvalResult", "LocalResult", "TrainConfig", "check_int"]

#: How a client obtains the BatchNorm statistics it pushes (fedcore.training.batchnorm).
BN_STATISTICS = ("precise", "running")


def check_int(name: str, value: Any, minimum: int) -> None:
    """Refuse anything but an integer ≥ ``minimum`` (``bool`` included, though Python calls it an int)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def _check_float(name: str, value: Any, *, positive: bool = False, below_one: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be ≥ 0, got {value!r}")
    if below_one and value >= 1:
        raise ValueError(f"{name} must be < 1, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one local update; travels to clients as JSON (:meth:`to_dict`)."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    frobenius_decay: float = 0.0
    #: epochs of the personal phase: personal atoms, Ditto's personal model, FT's fine-tuning (None: local_epochs)
    personal_epochs: int | None = None
    #: step sizes of filter atoms, coefficients and low-rank factor pairs (fedcore.training.atom_steps):
    #: "preconditioned" (scaled atoms, ScaledGD pairs), "scaled" or "shared" (the papers' one rate)
    atom_lr: str = "preconditioned"
    #: a personalization baseline (fedcore.training.personalization): none, ft, fedper, fedrep, lg, ditto, local
    personalization: str = "none"
    #: FedRep: epochs of the personal head (body frozen) before the body's local_epochs (head frozen)
    head_epochs: int = 10
    #: Ditto: λ of the personal model's proximal term λ/2‖v − w‖² (the decomposition paper: 0.75)
    ditto_lambda: float = 0.75
    #: BatchNorm statistics pushed: "precise" (recomputed for the trained weights) or "running" (as trained)
    bn_statistics: str = "precise"
    #: a mixed-tier federation's smallest tier: a larger tier trains that tier's part of its model as that
    #: model (fedcore.training.nested); None: every tier trains its own model (FedHM as printed)
    nested_rank_ratio: float | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        check_int("local_epochs", self.local_epochs, 1)
        check_int("batch_size", self.batch_size, 1)
        _check_float("lr", self.lr, positive=True)
        _check_float("momentum", self.momentum, below_one=True)
        _check_float("weight_decay", self.weight_decay)
        _check_float("prox_mu", self.prox_mu)
        _check_float("frobenius_decay", self.frobenius_decay)
        if self.personal_epochs is not None:
            check_int("personal_epochs", self.personal_epochs, 1)
        if self.atom_lr not in ATOM_LR_RULES:
            raise ValueError(f"atom_lr must be one of {', '.join(ATOM_LR_RULES)}, got {self.atom_lr!r}")
        if self.personalization not in PERSONALIZATIONS:
            raise ValueError(
                f"personalization must be one of {', '.join(PERSONALIZATIONS)}, got {self.personalization!r}"
            )
        check_int("head_epochs", self.head_epochs, 1)
        _check_float("ditto_lambda", self.ditto_lambda)
        if self.bn_statistics not in BN_STATISTICS:
            raise ValueError(f"bn_statistics must be one of {', '.join(BN_STATISTICS)}, got {self.bn_statistics!r}")
        if self.nested_rank_ratio is not None:
            _check_float("nested_rank_ratio", self.nested_rank_ratio, positive=True, below_one=True)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")

    @property
    def effective_personal_epochs(self) -> int:
        return self.local_epochs if self.personal_epochs is None else self.personal_epochs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are errors so a typo cannot pass silently."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {', '.join(sorted(unknown))}")
        return cls(**dict(data))


@dataclass
class LocalResult:
    """A client's round: the full trained ``state_dict`` (CPU) plus what the optional methods produce.

    ``strategy_state`` is the client's per-client state after the round, by group
    (:data:`fedcore.training.terms.STATE_GROUPS`); ``control_delta`` is SCAFFOLD's ``Δc_i``.
    """

    tensors: dict[str, Tensor]
    num_samples: int
    metrics: dict[str, float]
    strategy_state: dict[str, dict[str, Tensor]] | None = None
    control_delta: dict[str, Tensor] | None = None
    personal_atoms: dict[str, Tensor] | None = None
    personal_model: dict[str, Tensor] | None = None  # Ditto's v_k, the whole state_dict


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    num_samples: int
