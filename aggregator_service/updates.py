"""The records a round passes between clients, strategies and the caller: one push in, one close out.

The server keeps the global model as full-rank tensors named as in ``spec.full().tensors``;
a :class:`ClientUpdate` holds its tier's tensors (the due subset) and the strategy aligns them
back to full rank (FedHM eq. 1) when it folds them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from fedcore.spec import ModelSpec

__all__ = ["AggregateResult", "ClientUpdate"]


@dataclass(frozen=True)
class ClientUpdate:
    """One client's push for one round.

    ``tensors`` are named as in the client's tier ``spec`` (factor pairs whole) and hold the
    due subset; ``control_delta`` is SCAFFOLD's ``Δc_k = c_k⁺ − c_k``, keyed by the tier's
    trainable tensor names. ``aligned``, when set, are the full-rank values the server folds
    instead of ``spec.to_full(tensors)`` (an update clipped at full rank, :mod:`.update_bounds`).
    ``move_scale``, when set, is the factor its push was told the fold scales its move by; the fold
    applies it as told (``None``: the fold computes it from the bounds).
    """

    client_id: str
    num_samples: int
    tier: float
    spec: ModelSpec
    tensors: Mapping[str, Tensor]
    control_delta: Mapping[str, Tensor] | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    aligned: Mapping[str, Tensor] | None = None
    move_scale: float | None = None

    def full_tensors(self) -> dict[str, Tensor]:
        """The update at full rank (FedHM eq. 1): ``aligned`` when the server set it, else ``spec.to_full(tensors)``."""
        return dict(self.aligned) if self.aligned is not None else self.spec.to_full(self.tensors)

    def modules(self) -> list[list[str]]:
        """The update's tensor names grouped by module (``layer1.0.bn1.running_var`` → ``layer1.0.bn1``), in
        the spec's order: what a strategy folds at once, so a factor pair, a BatchNorm's statistics and a
        layer's atoms and coefficients stay together and the rest of the update need not be in memory."""
        names = (
            list(self.aligned)
            if self.aligned is not None
            else [t.name for t in self.spec.tensors if t.name in self.tensors]
        )
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(name.rpartition(".")[0], []).append(name)
        return list(groups.values())

    def full_module(self, names: Sequence[str]) -> dict[str, Tensor]:
        """:meth:`full_tensors` of one of :meth:`modules` (the tensors ``names`` reads, nothing else)."""
        if self.aligned is not None:
            return {n: self.aligned[n] for n in names}
        return self.spec.to_full({n: self.tensors[n] for n in names})

    def check_shapes(self) -> None:
        """Refuse tensors the client's tier does not have or whose shapes differ from it (before anything is
        folded: a refused update changes nothing); read from ``tensors.shapes`` when a lazy mapping has it."""
        if self.aligned is not None:
            return  # set by the server at full rank, from tensors checked here
        expected = {t.name: tuple(t.shape) for t in self.spec.tensors}
        unknown = sorted(set(self.tensors) - set(expected))
        if unknown:
            raise ValueError(f"client {self.client_id}: tensors {unknown[:5]} are not part of {self.spec.describe()}")
        shapes = getattr(self.tensors, "shapes", None)
        for name in self.tensors:
            shape = tuple(shapes[name]) if shapes is not None else tuple(self.tensors[name].shape)
            if shape != expected[name]:
                raise ValueError(
                    f"client {self.client_id}: {name!r} has shape {shape}, its tier ({self.spec.describe()}) has "
                    f"{expected[name]}"
                )

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"client {self.client_id}: num_samples must be ≥ 1, got {self.num_samples}")
        if not 0.0 < self.tier <= 1.0:
            raise ValueError(f"client {self.client_id}: tier must be in (0, 1], got {self.tier}")
        if not math.isclose(self.tier, self.spec.rank_ratio):
            raise ValueError(
                f"client {self.client_id}: tier {self.tier:g} differs from its spec's rank_ratio "
                f"{self.spec.rank_ratio:g} ({self.spec.describe()})"
            )


@dataclass
class AggregateResult:
    """What closing a round produced.

    Attributes
    ----------
    tensors
        Full-rank name → new global value, for the due tensors that received at least one
        contribution (local tensors such as kept BN buffers never appear).
    dispersion
        Full-rank name → ``Σ_k p_k ‖x_k − u‖²`` of the aligned client tensors around their
        weighted mean ``u`` (the variance the dashboard shows; FedLAMA's ``d_l`` builds on it).
    effective_dispersion
        Conv module → ``Σ_k p_k ‖α_k × D_k − ᾱ × D̄‖²`` (only modules whose atoms and
        coefficients were both due).
    num_clients, total_weight
        Updates folded and the sum of their (unnormalized) weights.
    weights
        Normalized ``p_k`` in fold order (for the latent-client count and the dashboard).
    client_ids
        Client ids in fold order.
    metrics
        Sample-weighted mean of each client metric, over the clients that reported it.
    """

    tensors: dict[str, Tensor]
    dispersion: dict[str, float]
    effective_dispersion: dict[str, float]
    num_clients: int
    total_weight: float
    weights: list[float]
    client_ids: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
