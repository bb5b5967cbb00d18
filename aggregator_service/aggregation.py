"""Aggregation strategies: aligned weighted averages, FedHM weights, SCAFFOLD controls, re-factorization.

The server keeps the global model as full-rank tensors named as in ``spec.full().tensors``.
A client of tier γ pushes its tier's tensors (the due subset); :meth:`ModelSpec.to_full`
aligns them back to full rank (FedHM eq. 1) and the strategy folds them, one client at a
time, into streaming float64 accumulators, so closing a round costs O(model) memory
whatever the number of clients (the gRPC service reads updates from the database one by
one; the simulator passes them straight from training).

A strategy is a small object with few verbs, in Flower's style; the round template (plan,
fold every reported update, close) lives with the caller (``aggregator_service.rounds``)::

    acc = strategy.begin(global_tensors, due)
    for update in updates:            # any order, one at a time
        strategy.fold(acc, update)
    result = strategy.finish(acc, global_tensors)   # new values of the due tensors + metrics

Decomposed layers need nothing special: atoms ``D`` and coefficients ``α`` are separate
tensors, so averaging them separately *is* the product of averages ``ᾱ × D̄`` (the
decomposition paper's eq. 5–6, with its ``m² − m`` latent clients); the accumulator also
folds each client's effective filters ``α_k × D_k`` to report their dispersion around
``ᾱ × D̄`` (:mod:`aggregator_service.metrics`).

Adding a strategy (FedDyn, FedDC, …) touches nothing else: subclass :class:`FedAvg` (or
:class:`Strategy`), give it a ``name``, return its client hyper-parameters from
:meth:`~Strategy.client_config`, extend :class:`RoundAccumulator` if it needs more running
sums (as :class:`Scaffold` does with :class:`ScaffoldAccumulator`), override
:meth:`~Strategy.fold` to add them and :meth:`~Strategy.finish` to turn the averages into
the new global values — FedDyn, e.g., keeps a server state ``h`` updated from the mean
drift and returns ``ȳ − h/α`` — keep that server state in :meth:`~Strategy.state_dict` /
:meth:`~Strategy.load_state_dict` so it survives a restart, and register the class in
:data:`STRATEGIES`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from aggregator_service.metrics import effective_dispersion, effective_filters
from fedcore.spec import ModelSpec, factored_matrix

__all__ = [
    "STRATEGIES",
    "WEIGHTINGS",
    "AggregateResult",
    "ClientUpdate",
    "FedAvg",
    "FedProx",
    "RoundAccumulator",
    "Scaffold",
    "ScaffoldAccumulator",
    "Strategy",
    "WeightedMean",
    "build_strategy",
    "client_weight",
    "refactorize",
]

WEIGHTINGS = ("samples", "tier-softmax")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ClientUpdate:
    """One client's push for one round.

    ``tensors`` are named as in the client's tier ``spec`` (factor pairs whole) and hold the
    due subset; ``control_delta`` is SCAFFOLD's ``Δc_k = c_k⁺ − c_k``, keyed by the tier's
    trainable tensor names.
    """

    client_id: str
    num_samples: int
    tier: float
    spec: ModelSpec
    tensors: Mapping[str, Tensor]
    control_delta: Mapping[str, Tensor] | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

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


# --------------------------------------------------------------------------- streaming mean


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class WeightedMean:
    """Streaming weighted mean and dispersion of named tensors, in float64, in one pass.

    Uses West's weighted form of Welford's update, per tensor::

        W' = W + w;   δ = x − u;   u ← u + (w/W')·δ;   M2 ← M2 + w·(W/W')·‖δ‖²

    (``w·(W/W')·‖δ‖²`` is West's ``w·⟨δ, x − u_new⟩``, since ``x − u_new = (W/W')·δ``), so
    ``mean()`` is ``Σ w_k x_k / Σ w_k`` and ``dispersion()`` is ``M2/W = Σ p_k ‖x_k − u‖²``
    without keeping the clients' tensors or cancelling large sums. Each tensor has its own
    weight sum, so an update may omit tensors. Integer and bool tensors are averaged in
    float and rounded back in :meth:`mean`; results take the dtype of each tensor's first
    contribution.

    Memory is the float64 running means plus one scratch buffer of at most :attr:`CHUNK`
    elements (and no larger than the largest tensor): ``δ`` is formed chunk by chunk in that
    buffer, converting the incoming tensor to float64 once, so folding allocates nothing per
    contribution and each chunk stays in cache between the subtraction, the mean update and
    the dot product.
    """

    CHUNK: ClassVar[int] = 1 << 18  # elements of the float64 scratch buffer (2 MiB)

    def __init__(self) -> None:
        self._mean: dict[str, Tensor] = {}
        self._m2: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._dtype: dict[str, torch.dtype] = {}
        self._scratch: Tensor | None = None
        self.total_weight = 0.0
        self.count = 0

    def _buffer(self, like: Tensor, numel: int) -> Tensor:
        """A float64 scratch of ``numel ≤ CHUNK`` elements on ``like``'s device, reused across calls."""
        scratch = self._scratch
        if scratch is None or scratch.device != like.device or scratch.numel() < numel:
            size = numel if scratch is None else max(numel, min(2 * scratch.numel(), self.CHUNK))
            scratch = self._scratch = torch.empty(size, dtype=torch.float64, device=like.device)
        return scratch[:numel]

    def _fold(self, mean: Tensor, x: Tensor, weight: float, old_weight: float, total: float) -> float:
        """``mean += (w/W')·(x − mean)`` in place; returns ``w·(W/W')·‖x − mean_old‖²``."""
        flat_mean, flat_x = mean.view(-1), x.reshape(-1)
        numel = flat_mean.numel()
        alpha = weight / total
        convert = flat_x.dtype != torch.float64
        chunk = self.CHUNK
        squares = 0.0
        for start in range(0, numel, chunk):
            u, v = (
                (flat_mean, flat_x)
                if numel <= chunk
                else (flat_mean[start : start + chunk], flat_x[start : start + chunk])
            )
            delta = self._buffer(u, u.numel())
            if convert:
                delta.copy_(v)  # the one conversion to float64
                delta.sub_(u)
            else:
                torch.sub(v, u, out=delta)
            u.add_(delta, alpha=alpha)
            squares += float(torch.dot(delta, delta))
        return weight * (old_weight / total) * squares

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Fold one contribution (e.g. one client's aligned tensors) with ``weight > 0``."""
        weight = float(weight)
        if not (weight > 0.0 and math.isfinite(weight)):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        for name, tensor in tensors.items():  # check every shape first, so a rejected add changes nothing
            known = self._mean.get(name)
            if known is not None and tuple(tensor.shape) != tuple(known.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, earlier ones {tuple(known.shape)}")
        for name, tensor in tensors.items():
            x = tensor.detach()
            mean = self._mean.get(name)
            if mean is None:
                self._mean[name] = torch.empty(x.shape, dtype=torch.float64, device=x.device).copy_(x)
                self._m2[name] = 0.0
                self._weight[name] = weight
                self._dtype[name] = tensor.dtype
                continue
            old_weight = self._weight[name]
            total = old_weight + weight
            self._m2[name] += self._fold(mean, x, weight, old_weight, total)
            self._weight[name] = total
        self.total_weight += weight
        self.count += 1

    @property
    def names(self) -> list[str]:
        return list(self._mean)

    def weight(self, name: str) -> float:
        """Sum of the weights of the contributions that held ``name``."""
        return self._weight[name]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of ``name``'s first contribution (the dtype :meth:`mean` returns)."""
        return self._dtype[name]

    def mean(self, cast: bool = True) -> dict[str, Tensor]:
        """Weighted means; with ``cast=False`` the float64 running means themselves (do not modify)."""
        if not cast:
            return dict(self._mean)
        out: dict[str, Tensor] = {}
        for name, mean in self._mean.items():
            dtype = self._dtype[name]
            if _is_float(dtype):
                out[name] = mean.to(dtype)
            elif dtype == torch.bool:
                out[name] = mean.round().to(torch.bool)
            else:
                out[name] = mean.round().to(dtype)
        return out

    def dispersion(self) -> dict[str, float]:
        """``Σ_k p_k ‖x_k − u‖²`` per tensor, ``p_k = w_k / Σ w`` over the contributions holding it."""
        return {name: max(0.0, self._m2[name] / self._weight[name]) for name in self._mean}


# --------------------------------------------------------------------------- weights


def client_weight(update: ClientUpdate, weighting: str = "samples", temperature: float = math.inf) -> float:
    """Unnormalized aggregation weight of one update.

    - ``"samples"``: ``n_k`` (FedAvg's ``p_k = n_k / n`` after normalization).
    - ``"tier-softmax"``: ``n_k · exp(γ_k / τ)`` (FedHM eq. 2). FedHM's clients hold
      equal-sized shards, where this is exactly eq. 2's ``softmax(γ/τ)``; with unequal data it
      keeps FedAvg's ``n_k`` weighting and tilts it towards larger tiers. ``τ = ∞`` is FedAvg.
      Computed as ``n_k · exp((γ_k − 1)/τ)`` — the common factor ``exp(1/τ)`` cancels in the
      normalization and the shift keeps small temperatures from overflowing.
    """
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weighting == "samples":
        return float(update.num_samples)
    if weighting == "tier-softmax":
        weight = update.num_samples * math.exp((update.tier - 1.0) / temperature)
        if weight <= 0.0:
            raise ValueError(f"temperature {temperature:g} is so small that tier {update.tier:g} gets weight 0")
        return weight
    raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")


# --------------------------------------------------------------------------- strategies


@dataclass
class RoundAccumulator:
    """Running sums of one round: aligned tensors, effective filters, weights, client metrics."""

    due: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    tensors: WeightedMean = field(default_factory=WeightedMean)
    filters: WeightedMean = field(default_factory=WeightedMean)
    weights: list[float] = field(default_factory=list)
    client_ids: list[str] = field(default_factory=list)
    reported: set[str] = field(default_factory=set)  # O(1) duplicate check in fold
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_weights: dict[str, float] = field(default_factory=dict)


@dataclass
class ScaffoldAccumulator(RoundAccumulator):
    """Adds the uniform mean of the clients' control deltas ``Δc_k``."""

    controls: WeightedMean = field(default_factory=WeightedMean)


def _trainable(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in spec.tensors if t.role != "buffer"}


class Strategy(ABC):
    """A server-side aggregation rule; the caller owns the round template (begin → fold… → finish)."""

    name: ClassVar[str]

    def client_config(self) -> dict[str, Any]:
        """Hyper-parameters clients need for their local update (sent with every TRAIN task)."""
        return {}

    def local_tensors(self, spec: ModelSpec) -> frozenset[str]:
        """Full-rank names this strategy never aggregates (they stay on the clients)."""
        return frozenset()

    def server_control(self, spec: ModelSpec | None = None) -> dict[str, Tensor] | None:
        """Per-tensor server state clients need for their local update (SCAFFOLD's ``c``); ``None`` if none."""
        return None

    @abstractmethod
    def begin(self, global_tensors: Mapping[str, Tensor], due: Sequence[str]) -> RoundAccumulator:
        """Open a round that aggregates the full-rank tensors ``due``."""

    @abstractmethod
    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        """Add one client's update to the round's running sums (O(model) memory)."""

    @abstractmethod
    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        """New global values of the due tensors, and the round's dispersion metrics."""

    def state_dict(self) -> dict[str, Any]:
        """Server state that must survive a restart (tensors are left for the caller to encode)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")


class FedAvg(Strategy):
    """Aligned weighted average of the due tensors (FedAvg; FedHM with ``weighting="tier-softmax"``).

    Parameters
    ----------
    weighting, temperature
        Client weights, see :func:`client_weight`. FedHM's dynamic setting is
        ``weighting="tier-softmax", temperature=5``; its fixed setting is ``τ = ∞`` (FedAvg).
    keep_local_buffers
        Never aggregate ``buffer`` tensors (BN running statistics stay on each client, as in
        FedBN/SiloBN); they keep their global value.
    """

    name: ClassVar[str] = "fedavg"

    def __init__(
        self, weighting: str = "samples", temperature: float = math.inf, keep_local_buffers: bool = False
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
        if not temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.weighting = weighting
        self.temperature = float(temperature)
        self.keep_local_buffers = keep_local_buffers

    def local_tensors(self, spec: ModelSpec) -> frozenset[str]:
        if not self.keep_local_buffers:
            return frozenset()
        return frozenset(t.name for t in spec.full().tensors if t.role == "buffer")

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return RoundAccumulator(due, shapes)

    def begin(self, global_tensors: Mapping[str, Tensor], due: Sequence[str]) -> RoundAccumulator:
        missing = [n for n in due if n not in global_tensors]
        if missing:
            raise KeyError(f"due tensors {missing[:5]} are not part of the global model")
        names = tuple(dict.fromkeys(due))
        return self._accumulator(names, {n: tuple(global_tensors[n].shape) for n in names})

    def _aligned(self, acc: RoundAccumulator, update: ClientUpdate) -> dict[str, Tensor]:
        """The update's due tensors at full rank, minus local ones; shapes checked."""
        try:
            full = update.spec.to_full(update.tensors)
        except KeyError as exc:
            raise ValueError(f"client {update.client_id}: {exc.args[0]}") from exc
        local = self.local_tensors(update.spec)
        out: dict[str, Tensor] = {}
        for name, tensor in full.items():
            if name not in acc.shapes or name in local:
                continue  # not due this round (or never aggregated): ignored
            if tuple(tensor.shape) != acc.shapes[name]:
                raise ValueError(
                    f"client {update.client_id}: {name!r} aligns to shape {tuple(tensor.shape)}, "
                    f"the global model has {acc.shapes[name]}"
                )
            out[name] = tensor
        return out

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if update.client_id in acc.reported:
            raise ValueError(f"client {update.client_id} was already folded into this round")
        aligned = self._aligned(acc, update)
        weight = client_weight(update, self.weighting, self.temperature)
        acc.tensors.add(aligned, weight)
        acc.filters.add(effective_filters(aligned), weight)
        acc.weights.append(weight)
        acc.client_ids.append(update.client_id)
        acc.reported.add(update.client_id)
        for key, value in update.metrics.items():
            acc.metric_sums[key] = acc.metric_sums.get(key, 0.0) + update.num_samples * float(value)
            acc.metric_weights[key] = acc.metric_weights.get(key, 0.0) + update.num_samples

    def _new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        """The new global value from the clients' weighted mean (cast to the tensor's dtype, and in float64).

        FedAvg: the mean itself.
        """
        return mean

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        means, raw = acc.tensors.mean(), acc.tensors.mean(cast=False)
        tensors = {
            name: self._new_value(name, means[name], raw[name], global_tensors[name]).to(global_tensors[name].dtype)
            for name in acc.due
            if name in means
        }
        filters = acc.filters.mean(cast=False)
        filter_dispersion = acc.filters.dispersion()
        effective: dict[str, float] = {}
        for module, filter_mean in filters.items():
            prefix = f"{module}." if module else ""
            a_name, d_name = f"{prefix}coefficients", f"{prefix}atoms"
            w = acc.filters.weight(module)
            if w == acc.tensors.weight(a_name) == acc.tensors.weight(d_name):  # the same clients held all three
                effective[module] = effective_dispersion(
                    filter_mean, filter_dispersion[module], raw[a_name], raw[d_name]
                )
        total = math.fsum(acc.weights)
        return AggregateResult(
            tensors=tensors,
            dispersion=acc.tensors.dispersion(),
            effective_dispersion=effective,
            num_clients=len(acc.weights),
            total_weight=total,
            weights=[w / total for w in acc.weights],
            client_ids=list(acc.client_ids),
            metrics={k: acc.metric_sums[k] / acc.metric_weights[k] for k in acc.metric_sums},
        )


class FedProx(FedAvg):
    """FedProx: the server is FedAvg; clients add ``(μ/2)‖w − w_global‖²`` to their loss."""

    name: ClassVar[str] = "fedprox"

    def __init__(
        self,
        mu: float = 0.01,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers)
        if not (mu >= 0.0 and math.isfinite(mu)):
            raise ValueError(f"mu must be ≥ 0, got {mu}")
        self.mu = float(mu)

    def client_config(self) -> dict[str, Any]:
        return {"prox_mu": self.mu}


class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al., option II) with server step ``η_g`` and control variates.

    ``x ← x + η_g · Σ_k p_k (y_k − x)`` over the due tensors (``η_g = 1`` is FedAvg exactly) and,
    for every tensor the clients report a delta for, ``c ← c + (|S|/N) · (1/|S|) Σ_k Δc_k`` — a
    uniform mean over the reporting clients ``S`` of ``N`` in the federation. The control
    update covers all trainable tensors, due or not, since clients update ``c_k`` every round.
    ``N`` below the cohort size is treated as full participation (ratio 1). Controls start at
    zero and are stored sparsely: :meth:`server_control` fills zeros for tensors never updated.

    Only full-rank (γ = 1) clients are supported: controls live in the full model's
    parameter space and a low-rank client's gradients do not.
    """

    name: ClassVar[str] = "scaffold"

    def __init__(
        self,
        num_clients_total: int,
        global_lr: float = 1.0,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        spec: ModelSpec | None = None,
    ) -> None:
        super().__init__(weighting, temperature, keep_local_buffers)
        if num_clients_total < 1:
            raise ValueError(f"num_clients_total must be ≥ 1, got {num_clients_total}")
        if not (global_lr > 0.0 and math.isfinite(global_lr)):
            raise ValueError(f"global_lr must be > 0, got {global_lr}")
        self.num_clients_total = int(num_clients_total)
        self.global_lr = float(global_lr)
        self.spec = spec.full() if spec is not None else None
        self._controls: dict[str, Tensor] = {}

    def client_config(self) -> dict[str, Any]:
        return {"scaffold": True}

    def server_control(self, spec: ModelSpec | None = None) -> dict[str, Tensor]:
        """The server control ``c``: one tensor per trainable full-rank tensor of ``spec`` (zeros if never updated).

        Without ``spec`` (and none given at construction) only the tensors updated so far,
        which is every trainable tensor once a round has closed.

        Raises
        ------
        ValueError
            When no spec is known and no round has closed yet: the zeros' names and shapes
            are unknown (build the strategy with ``spec=`` or pass one here).
        """
        spec = spec.full() if spec is not None else self.spec
        if spec is None:
            if not self._controls:
                raise ValueError(
                    "SCAFFOLD's initial (zero) server control needs the model: build Scaffold with spec=… "
                    "or call server_control(spec)"
                )
            return {n: c.clone() for n, c in self._controls.items()}
        out = {}
        for t in spec.tensors:
            if t.role == "buffer":
                continue
            stored = self._controls.get(t.name)
            out[t.name] = stored.clone() if stored is not None else torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
        return out

    def _accumulator(self, due: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> RoundAccumulator:
        return ScaffoldAccumulator(due, shapes)

    def fold(self, acc: RoundAccumulator, update: ClientUpdate) -> None:
        if not isinstance(acc, ScaffoldAccumulator):
            raise TypeError("Scaffold.fold needs the accumulator Scaffold.begin returned")
        if update.tier != 1.0:
            raise ValueError(
                f"client {update.client_id}: SCAFFOLD needs full-rank (γ = 1) clients, got tier {update.tier:g}"
            )
        if update.control_delta is None:
            raise ValueError(f"client {update.client_id}: SCAFFOLD needs the client's control delta")
        trainable = _trainable(update.spec)
        for name, delta in update.control_delta.items():
            if name not in trainable:
                raise ValueError(f"client {update.client_id}: control delta {name!r} is not a trainable tensor")
            if tuple(delta.shape) != trainable[name]:
                raise ValueError(
                    f"client {update.client_id}: control delta {name!r} has shape {tuple(delta.shape)}, "
                    f"expected {trainable[name]}"
                )
        super().fold(acc, update)
        acc.controls.add(update.control_delta, 1.0)

    def _new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        if self.global_lr == 1.0 or not _is_float(current.dtype):
            return mean  # η_g = 1 returns FedAvg's value bit for bit
        x = current.detach().to(torch.float64)
        return x + self.global_lr * (mean64 - x)

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        if not isinstance(acc, ScaffoldAccumulator):
            raise TypeError("Scaffold.finish needs the accumulator Scaffold.begin returned")
        result = super().finish(acc, global_tensors)
        reporting = acc.controls.count
        if reporting:
            ratio = min(reporting, self.num_clients_total) / self.num_clients_total
            for name, mean_delta in acc.controls.mean(cast=False).items():
                previous = self._controls.get(name)
                dtype = previous.dtype if previous is not None else acc.controls.dtype(name)
                base = previous.to(torch.float64) if previous is not None else torch.zeros_like(mean_delta)
                self._controls[name] = (base + ratio * mean_delta).to(dtype)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"controls": {n: c.clone() for n, c in self._controls.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"controls"}
        if unknown:
            raise ValueError(f"unknown SCAFFOLD state keys {sorted(unknown)}")
        controls = state.get("controls", {})
        if self.spec is not None:
            trainable = _trainable(self.spec)
            for name, c in controls.items():
                if trainable.get(name) != tuple(c.shape):
                    raise ValueError(f"SCAFFOLD control {name!r} with shape {tuple(c.shape)} does not fit the model")
        self._controls = {n: torch.as_tensor(c).detach().clone() for n, c in controls.items()}


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg, FedProx, Scaffold)}


def build_strategy(name: str, **params: Any) -> Strategy:
    """Instantiate a registered strategy, e.g. ``build_strategy("fedprox", mu=0.01)``."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for strategy {name!r}: {exc}") from exc


# --------------------------------------------------------------------------- re-factorization


def refactorize(
    global_tensors: Mapping[str, Tensor], tier_specs: Sequence[ModelSpec]
) -> dict[float, dict[str, Tensor]]:
    """Every tier's download: truncated-SVD factors (√Σ split) of the factorized tensors, others as they are.

    Truncated SVDs are nested, so each factorized full-rank tensor is decomposed once and
    sliced at every tier's rank; the result equals ``spec.from_full(global_tensors)`` per
    tier. Un-factorized tensors (and a γ = 1 tier entirely) share storage with
    ``global_tensors``: do not modify them in place.
    """
    svds: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    out: dict[float, dict[str, Tensor]] = {}
    for spec in tier_specs:
        tier: dict[str, Tensor] = {}
        for t in spec.tensors:
            if t.full_name is None:
                tier[t.name] = global_tensors[t.name]
            elif t.role.endswith("_u"):
                full = global_tensors[t.full_name]
                if t.full_name not in svds:
                    matrix = factored_matrix(full).detach().to(torch.float64)
                    svds[t.full_name] = torch.linalg.svd(matrix, full_matrices=False)
                u_, s, vh = svds[t.full_name]
                rank = t.shape[1]
                root = s[:rank].sqrt()
                tier[t.name] = (u_[:, :rank] * root).to(full.dtype)
                tier[t.name[: -len("_u")] + "_v"] = (root[:, None] * vh[:rank]).to(full.dtype)
        out[spec.rank_ratio] = {t.name: tier[t.name] for t in spec.tensors}
    return out
