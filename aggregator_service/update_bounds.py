"""Bounds on how far one client's update may move the global model, measured at full rank.

Validation proves an update well formed (names, shapes, finite values); it does not stop an
enrolled client from pushing a well-formed update that drags the average wherever it likes.
Two bounds act on the update *aligned to full rank* (FedHM eq. 1), the values the strategy
averages, so a tier-1/4 client's factors count through their product ``U Vᵀ``:

* a magnitude bound (always on): every aligned value within ``max_value`` of the global value
  the round began from, ``|x − g| ≤ max_value``. Finite factors whose product overflows float32
  (or merely dwarfs any trained weight) are refused at push, instead of failing the round's close.
  It bounds the change, not the value: a global model that a bad round (or a tier average, which
  is not convex entry by entry) put past ``max_value`` still takes every honest update after it.
* a norm bound (the operator's option): ``‖Δ‖₂ ≤ max_norm`` for the client's move
  ``Δ = aligned − received`` over the update's floating-point tensors, where ``received`` is the model
  the client started from: its tier's cut of the global model as the wire delivered it, aligned to
  full rank (``Federation.received``). Measured from the global model instead, a low tier's move
  would count the cut's residual, which it never held (8.3 for the digits CNN with atoms-lowrank at
  tier 1/8, round 0), and fp16 transport's rounding. ``reject`` refuses the push; ``clip`` folds
  ``received + Δ · min(1, max_norm/‖Δ‖)``, the fixed clipping of DP-FedAvg (McMahan et al. 2018,
  Flower's ``DifferentialPrivacyServerSideFixedClipping`` without the noise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from aggregator_service.errors import InvalidArgument
from aggregator_service.updates import ClientUpdate
from fedcore.spec import ModelSpec, pair_v

__all__ = ["NORM_MODES", "UpdateBounds"]

NORM_MODES = ("reject", "clip")


@dataclass(frozen=True)
class UpdateBounds:
    """``max_value`` bounds every aligned value's change from the global; ``max_norm`` (None: off) the client's move,
    the update's L2 distance to the model it started from."""

    max_value: float = 1e9
    max_norm: float | None = None
    mode: str = "reject"

    def __post_init__(self) -> None:
        if self.mode not in NORM_MODES:
            raise ValueError(f"update_norm_mode must be one of {', '.join(NORM_MODES)}, got {self.mode!r}")
        if not self.max_value > 0:
            raise ValueError(f"max_update_value must be > 0, got {self.max_value}")
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"max_update_norm must be a finite number > 0, got {self.max_norm}")

    def check(
        self,
        spec: ModelSpec,
        tensors: Mapping[str, Tensor],
        global_tensors: Mapping[str, Tensor],
        received: Mapping[str, Tensor],
    ) -> None:
        """At push: refuse (InvalidArgument) an update over the magnitude bound (from ``global_tensors``), or the
        norm bound in reject mode (its move from ``received``, the model the client started from)."""
        for name, peak in _peaks(spec, tensors, global_tensors, self.max_value).items():
            if not peak <= self.max_value:  # NaN and inf fail too
                raise InvalidArgument(
                    f"tensor {name!r} (aligned to full rank) moves a value by {peak:.3g} from the global model, "
                    f"over max_update_value = {self.max_value:g}: no training step moves a weight that far"
                )
        if self.max_norm is not None and self.mode == "reject":
            norm = delta_norm(_aligned(spec, tensors), received)
            if norm > self.max_norm:
                raise InvalidArgument(
                    f"the update moves the model by ‖Δ‖₂ = {norm:.4g}, over max_update_norm = {self.max_norm:g}: "
                    "train with a smaller learning rate or fewer local steps"
                )

    @property
    def clips(self) -> bool:
        return self.max_norm is not None and self.mode == "clip"

    def move_scale(self, spec: ModelSpec, tensors: Mapping[str, Tensor], received: Mapping[str, Tensor]) -> float:
        """The factor the fold scales this update's ``Δ`` by: ``max_norm/‖Δ‖`` in clip mode when it is longer, else
        1. Told to the client at push (``PushReply.move_scale``): its strategy state follows the move folded."""
        if not self.clips:
            return 1.0
        return self._scale(_aligned(spec, tensors), received)

    def _scale(self, aligned: Mapping[str, Tensor], received: Mapping[str, Tensor]) -> float:
        assert self.max_norm is not None
        norm = delta_norm(aligned, received)
        return 1.0 if norm <= self.max_norm else self.max_norm / norm

    def folds_scaled(self, update: ClientUpdate) -> bool:
        """Whether :meth:`clip` may change ``update``: its push was told a scale below 1, or, told none, the
        bounds clip."""
        return update.move_scale != 1.0 if update.move_scale is not None else self.clips

    def clip(self, update: ClientUpdate, received: Mapping[str, Tensor]) -> ClientUpdate:
        """At fold: the update with its move from ``received`` scaled by what its push was told
        (``update.move_scale``), so the client's strategy state and the fold agree even when the
        aggregator restarted with other bounds in between; an update told nothing (the in-process
        simulator, a row an older version stored) is scaled to ``max_norm`` in clip mode when longer."""
        if not self.folds_scaled(update):
            return update
        aligned = _aligned(update.spec, update.tensors)
        scale = update.move_scale if update.move_scale is not None else self._scale(aligned, received)
        if scale == 1.0:
            return update
        clipped = {}
        for name, t in aligned.items():
            g = received[name]
            clipped[name] = (g.double() + (t.double() - g.double()) * scale).to(g.dtype) if t.is_floating_point() else t
        return replace(update, aligned=clipped)


def _peaks(
    spec: ModelSpec, tensors: Mapping[str, Tensor], global_tensors: Mapping[str, Tensor], limit: float
) -> dict[str, float]:
    """Full-rank name → the largest ``|aligned − global|``, without aligning when a bound already shows it small.

    A factor pair's product ``U V`` has ``|(U V)_ij| ≤ ‖U_i,:‖₂ ‖V_:,j‖₂`` (Cauchy–Schwarz), so ``|U V − G|`` is at
    most that plus ``max |G|``: only a pair whose bound exceeds ``limit`` is multiplied out, so an honest push
    costs O(its size), not a matrix product per layer.
    """
    peaks: dict[str, float] = {}
    for t in spec.tensors:
        tensor = tensors.get(t.name)
        if tensor is None or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if t.full_name is None:
            peaks[t.name] = float((tensor.double() - global_tensors[t.name].double()).abs().max())
        elif t.role.endswith("_u"):
            v_name = pair_v(t.name)
            u, v = tensor.double(), tensors[v_name].double()
            g = global_tensors[t.full_name].double()
            bound = float(torch.linalg.vector_norm(u, dim=1).max() * torch.linalg.vector_norm(v, dim=0).max())
            bound += float(g.abs().max())
            if bound <= limit:
                peaks[t.full_name] = bound
            else:
                pair = spec.to_full({t.name: u, v_name: v})  # float64: the exact magnitude, even past float32's range
                peaks[t.full_name] = float((pair[t.full_name] - g).abs().max())
    return peaks


def _aligned(spec: ModelSpec, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors at full rank as the strategy folds them; a product that overflows float32 is inf, over any bound."""
    return spec.to_full(tensors)


def delta_norm(aligned: Mapping[str, Tensor], start: Mapping[str, Tensor]) -> float:
    """``‖aligned − start‖₂`` over the floating-point tensors, in float64 (integer counters do not count); a
    tensor ``start`` lacks is an error, never a part of the move left uncounted."""
    total = 0.0
    for name, tensor in aligned.items():
        if tensor.is_floating_point():
            total += float(torch.sum((tensor.double() - start[name].double()) ** 2))
    return math.sqrt(total)
