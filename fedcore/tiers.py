"""Capability profile → tier γ: the largest model a device can actually train.

FedHM leaves the mapping open (specs/fedhm.md §7); fedatoms compares each tier's training memory
(:func:`training_memory`: parameter state plus the activations a batch saves for backward) and forward
MACs per sample with the device's declared memory and compute budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from fedcore.spec import ModelSpec

__all__ = [
    "BYTES_PER_TRAINED_PARAMETER",
    "NESTED_BYTES_PER_PARAMETER",
    "TIERS",
    "CapabilityProfile",
    "NoTierFitsError",
    "assign_tier",
    "match_tier",
    "tier_costs",
    "training_memory",
]

TIERS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)
# fp32 weights + gradients + momentum buffer + the copy kept for the update/FedProx anchor.
BYTES_PER_TRAINED_PARAMETER = 16
# A nested step (fedcore.training.nested) runs the model twice, with weights derived from the parameters:
# the cut's and the residual's fp32 copies, which backward keeps.
NESTED_BYTES_PER_PARAMETER = 8


#: The largest integer a profile's counts may hold: the wire's int64.
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class CapabilityProfile:
    """What a client says (or measured) about itself; ``None`` means "no limit declared"."""

    device_name: str = "unknown"
    compute_macs: float | None = None  # forward MACs per sample the device accepts
    memory_bytes: int | None = None  # memory available for training state
    uplink_bps: float | None = None
    downlink_bps: float | None = None
    num_samples: int = 0
    preferred_tier: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device_name, str):
            raise ValueError(f"device_name must be a string, got {self.device_name!r}")
        for name in ("compute_macs", "memory_bytes", "uplink_bps", "downlink_bps"):
            value = getattr(self, name)
            if value is not None and (not _number(value) or not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number ≥ 0 (or left out: no limit), got {value!r}")
        for name in ("memory_bytes", "num_samples"):  # 64-bit integers on the wire (RegisterRequest)
            value = getattr(self, name)
            if isinstance(value, int) and value > INT64_MAX:
                raise ValueError(f"{name} = {value} is out of range: at most {INT64_MAX} (2^63 − 1)")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise ValueError(f"num_samples must be an integer ≥ 0, got {self.num_samples!r}")
        if self.preferred_tier is not None and not _number(self.preferred_tier):
            raise ValueError(f"preferred_tier must be a number (a tier such as 0.5), got {self.preferred_tier!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class NoTierFitsError(ValueError):
    """Even the smallest tier exceeds the declared budget; the client cannot take part."""


def match_tier(tier: float, tiers: Iterable[float]) -> float | None:
    """The tier of ``tiers`` that ``tier`` names, equal but for float rounding (a ``1/4`` a user wrote, read as a
    float); ``None`` where ``tiers`` has none."""
    return next((float(t) for t in tiers if math.isclose(float(t), tier, rel_tol=1e-9)), None)


def training_memory(spec: ModelSpec, batch_size: int, nested_rank_ratio: float | None = None) -> int:
    """Bytes a local update of ``spec``'s tier holds at its peak: the parameter state
    (:data:`BYTES_PER_TRAINED_PARAMETER` a parameter) and what a batch of ``batch_size`` saves for backward
    (``batch_size × per sample + per batch``, :attr:`ModelSpec.activation_bytes`, counted on the meta device).

    ``nested_rank_ratio``: the federation's smallest tier where mixed tiers train nested; a larger tier then
    takes two forward passes a step (twice the saved bytes) with :data:`NESTED_BYTES_PER_PARAMETER` more.
    The one figure of a tier's memory: enrollment compares it with a device's ``memory_bytes``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer ≥ 1, got {batch_size!r}")
    per_sample, per_batch = spec.activation_bytes
    saved = batch_size * per_sample + per_batch
    memory = spec.num_parameters * BYTES_PER_TRAINED_PARAMETER + saved
    if nested_rank_ratio is not None and spec.rank_ratio > nested_rank_ratio:
        memory += saved + spec.num_parameters * NESTED_BYTES_PER_PARAMETER
    return memory


def tier_costs(
    spec: ModelSpec, tiers: tuple[float, ...] = TIERS, *, batch_size: int, nested_rank_ratio: float | None = None
) -> dict[float, tuple[int, int]]:
    """``{γ: (training memory bytes, forward MACs per sample)}`` for each tier of ``spec`` trained in batches of
    ``batch_size`` (:func:`training_memory`)."""
    return {g: (training_memory(spec.at_tier(g), batch_size, nested_rank_ratio), spec.at_tier(g).macs) for g in tiers}


def assign_tier(
    profile: CapabilityProfile,
    spec: ModelSpec,
    tiers: tuple[float, ...] = TIERS,
    *,
    batch_size: int,
    nested_rank_ratio: float | None = None,
) -> float:
    """Largest γ in ``tiers`` (capped by the client's preference) whose training memory in batches of
    ``batch_size`` (:func:`training_memory`) and MACs fit."""
    if profile.preferred_tier is not None and profile.preferred_tier not in tiers:
        raise ValueError(
            f"preferred tier {profile.preferred_tier!r} is not one of {', '.join(f'{t:g}' for t in tiers)}"
        )
    costs = tier_costs(spec, tiers, batch_size=batch_size, nested_rank_ratio=nested_rank_ratio)
    for gamma in sorted(tiers, reverse=True):
        if profile.preferred_tier is not None and gamma > profile.preferred_tier:
            continue
        memory, macs = costs[gamma]
        if profile.memory_bytes is not None and memory > profile.memory_bytes:
            continue
        if profile.compute_macs is not None and macs > profile.compute_macs:
            continue
        return gamma
    smallest = min(tiers)
    memory, macs = costs[smallest]
    raise NoTierFitsError(
        f"{profile.device_name}: the smallest tier γ={smallest:g} of {spec.describe()} needs "
        f"{memory / 2**20:.1f} MiB to train in batches of {batch_size} and {macs / 1e6:.1f}M MACs per sample; "
        "the device declares "
        f"{'unlimited' if profile.memory_bytes is None else f'{profile.memory_bytes / 2**20:.1f} MiB'} and "
        f"{'unlimited' if profile.compute_macs is None else f'{profile.compute_macs / 1e6:.1f}M MACs'}"
    )
