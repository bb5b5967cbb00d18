"""FedAvg, and FedHM's aligned average over heterogeneous tiers (McMahan et al.; FedHM eq. 1–2).

A client of tier γ pushes its tier's tensors; :meth:`ModelSpec.to_full` aligns them back to
full rank (FedHM eq. 1) before they are averaged with the :func:`client_weight` weights. With mixed
tiers, each factorized entry is then the mean of the clients that hold it when the federation sets
``acc.held`` (:mod:`aggregator_service.held_average`).

Decomposed layers need nothing special: atoms ``D`` and coefficients ``α`` are separate
tensors, so averaging them separately *is* the product of averages ``ᾱ × D̄`` (the
decomposition paper's eq. 5–6, with its ``m² − m`` latent clients); the accumulator also
folds each client's effective filters ``α_k × D_k`` to report their dispersion around
``ᾱ × D̄`` (:mod:`aggregator_service.metrics`).

Other strategies that keep FedAvg's server average subclass :class:`FedAvg` and override
:meth:`~FedAvg.fold`, :meth:`~FedAvg.finish` or the per-tensor step :meth:`~FedAvg.new_value`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from torch import Tensor

from aggregator_service.batchnorm_pooling import pooled_variances, second_moments, variance_pairs
from aggregator_service.metrics import effective_dispersion, effective_filters
from aggregator_service.strategies.base import RoundAccumulator, Strategy
from aggregator_service.updates import AggregateResult, ClientUpdate
from aggregator_service.weighted_mean import WEIGHTINGS, client_weight
from fedcore.spec import ModelSpec
from fedcore.training.config import BN_STATISTICS

__all__ = ["FedAvg"]


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
    bn_statistics
        ``"precise"``: each BatchNorm's ``running_var`` is the pooled variance of all clients'
        data (:mod:`aggregator_service.batchnorm_pooling`); ``"running"``: averaged like any tensor.
    """

    name: ClassVar[str] = "fedavg"

    def __init__(
        self,
        weighting: str = "samples",
        temperature: float = math.inf,
        keep_local_buffers: bool = False,
        bn_statistics: str = "precise",
    ) -> None:
        if bn_statistics not in BN_STATISTICS:
            raise ValueError(f"bn_statistics must be one of {', '.join(BN_STATISTICS)}, got {bn_statistics!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
        if not temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.weighting = weighting
        self.temperature = float(temperature)
        self.keep_local_buffers = keep_local_buffers
        self.bn_statistics = bn_statistics

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

    def _aligned(
        self, acc: RoundAccumulator, update: ClientUpdate, names: Sequence[str] | None = None
    ) -> dict[str, Tensor]:
        """The update's due tensors (those among ``names``, one of :meth:`ClientUpdate.modules`; all by
        default) at full rank, minus local ones; shapes checked."""
        try:
            full = update.full_tensors() if names is None else update.full_module(names)
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
        """Fold ``update`` module by module: one module's tensors in memory at a time (a stored update is
        read tensor by tensor, :func:`aggregator_service.store.iter_round_updates`), so a close holds the
        float64 means and one layer, not a whole update more. Shapes are checked first: a refused update
        changes nothing."""
        if update.client_id in acc.reported:
            raise ValueError(f"client {update.client_id} was already folded into this round")
        update.check_shapes()
        weight = client_weight(update, self.weighting, self.temperature)
        for names in update.modules():
            self.fold_module(acc, update, self._aligned(acc, update, names), weight)
        acc.tensors.count_contribution(weight)
        acc.filters.count_contribution(weight)
        acc.weights.append(weight)
        acc.client_ids.append(update.client_id)
        acc.reported.add(update.client_id)
        acc.buffers.update(t.name for t in update.spec.tensors if t.role == "buffer")
        for key, value in update.metrics.items():
            acc.metric_sums[key] = acc.metric_sums.get(key, 0.0) + update.num_samples * float(value)
            acc.metric_weights[key] = acc.metric_weights.get(key, 0.0) + update.num_samples

    def fold_module(
        self, acc: RoundAccumulator, update: ClientUpdate, aligned: Mapping[str, Tensor], weight: float
    ) -> None:
        """Fold one module of ``update`` (its due tensors at full rank) with the client's ``weight``;
        subclasses that keep more per client extend this, and count the client once in :meth:`fold`."""
        if acc.held is not None:
            acc.held.fold(update, aligned, weight)
        acc.tensors.add(second_moments(aligned) if self.bn_statistics == "precise" else aligned, weight, part=True)
        acc.filters.add(effective_filters(aligned), weight, part=True)

    @property
    def keeps_the_mean(self) -> bool:
        """Whether the new global tensors are the clients' weighted mean, as FedAvg's are. Only then is an atom
        layer's new model ``ᾱ × D̄``, whose cross terms ``p_k1 p_k2 α_k1 D_k2`` are the decomposition paper's
        latent clients (eq. 8) and around which its effective dispersion is measured. A class that overrides
        :meth:`new_value` or :meth:`finish` is taken to change the aggregate unless it says otherwise here."""
        cls = type(self)
        return cls.new_value is FedAvg.new_value and cls.finish is FedAvg.finish

    def new_value(self, name: str, mean: Tensor, mean64: Tensor, current: Tensor) -> Tensor:
        """The new global value of a parameter from the clients' weighted mean (cast to the tensor's dtype,
        and in float64).

        FedAvg: the mean itself. Buffers never come here: BatchNorm's running statistics are statistics of
        the clients' data, not a descent direction, so a server step (η_g, momentum, Adam) past their mean
        would only make them wrong, a variance negative.
        """
        return mean

    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        means, raw = acc.tensors.mean(), acc.tensors.mean(cast=False)
        if acc.held is not None:
            for name in raw:
                corrected = acc.held.correct(name, raw[name], acc.tensors.weight(name))
                if corrected is not raw[name]:
                    raw[name], means[name] = corrected, corrected.to(means[name].dtype)
        if self.bn_statistics == "precise":
            pairs = {v: m for v, m in variance_pairs(raw).items() if acc.tensors.weight(v) == acc.tensors.weight(m)}
            raw = {**raw, **pooled_variances(raw, pairs)}
            means = {**means, **{v: raw[v].to(global_tensors[v].dtype) for v in pairs}}
        tensors = {
            name: (
                means[name]
                if name in acc.buffers
                else self.new_value(name, means[name], raw[name], global_tensors[name])
            ).to(global_tensors[name].dtype)
            for name in acc.due
            if name in means
        }
        filters = acc.filters.mean(cast=False)
        filter_dispersion = acc.filters.dispersion()
        effective: dict[str, float] = {}
        for module, filter_mean in filters.items() if self.keeps_the_mean else ():
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
