"""The papers' variance: how much the *aggregated* model varies across repeated local trainings.

Proposition 5.1 of the filter-decomposition paper (Proposition 4.1 in its first version) bounds
``E‖θ_φ − E θ_φ‖²``, the variance of the model the server aggregates, where the randomness is
the clients' local training (data order, SGD). The paper estimates it (§7.1) by repeating the
local training ``N_c`` times from one global model, aggregating each repetition, and taking

    (1/N_c) Σ_i ‖θ^i − (1/N_c) Σ_j θ^j‖²

over the convolution filters: the rebuilt ``ᾱ × D̄`` with atoms, the conv weights without.

:func:`repeated_aggregates` runs exactly that with the product's own code: round 1 of a
federation built by :meth:`FederationConfig.build_federation` (so the start is
``ModelSpec.initial_model(seed)``, the same function for every factorization), every client
trained by :func:`client_agent.update.run_task` and folded into the federation's real
aggregation, once per repetition seed. :func:`aggregate_variance` is the estimator above;
:func:`compare` runs it for several factorizations on the same clients and repetition seeds.

This is not the dashboard's client spread, ``Σ_k p_k ‖x_k − x̄‖²`` within one round: that
measures how far the clients' models lie from their aggregate and, by the parallel-axis
identity, is never lower with atoms (docs/methods.md).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from aggregator_service.config import FederationConfig
from aggregator_service.metrics import effective_filters
from aggregator_service.updates import ClientUpdate
from client_agent.pool import VirtualClient
from client_agent.state import ClientState
from client_agent.update import TrainTask, run_task
from fedcore.keys import derive_seed

__all__ = [
    "VarianceResult",
    "aggregate_variance",
    "compare",
    "conv_filters",
    "format_table",
    "repeated_aggregates",
    "squared_distance",
    "stderr_progress",
]

ProgressFn = Callable[[str], None]


def conv_filters(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each conv layer's effective filters (float64), keyed by module: ``α × D`` where the layer has
    atoms and coefficients, its 4-d ``<module>.weight`` otherwise."""
    out = effective_filters(tensors)
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and tensor.dim() == 4 and module not in out:
            out[module] = tensor.detach().to(torch.float64)
    return dict(sorted(out.items()))


def aggregate_variance(samples: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
    """``(1/N_c) Σ_i ‖θ^i − θ̄‖²`` per key, over ``N_c`` samples with the same keys (the paper's estimator)."""
    if not samples:
        raise ValueError("need at least one sample")
    out = {}
    for key in samples[0]:
        stacked = torch.stack([s[key].detach().to(torch.float64) for s in samples])
        out[key] = float(torch.sum((stacked - stacked.mean(dim=0)) ** 2)) / len(samples)
    return out


def squared_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> dict[str, float]:
    """``‖a − b‖²`` per key."""
    return {k: float(torch.sum((a[k].to(torch.float64) - b[k].to(torch.float64)) ** 2)) for k in a}


def _mean(samples: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.stack([s[k].to(torch.float64) for s in samples]).mean(dim=0) for k in samples[0]}


def repeated_aggregates(
    config: FederationConfig,
    clients: Sequence[VirtualClient],
    repetition_seeds: Sequence[int],
    progress: ProgressFn | None = None,
    start_filters: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Round 1 from ``config``'s initial model, once per repetition seed: ``(start, aggregates, products)``.

    Every repetition builds the federation afresh (same global model, same cohort) and gives each
    client a fresh state, so repetitions differ only in the local training's seed,
    ``derive_seed(config.seed, "repetition", s, client)`` for repetition seed ``s``: equal seeds give
    equal aggregates. ``start`` and ``aggregates`` are :func:`conv_filters` of the global model;
    ``products`` are the same repetitions' clients averaged as filters, ``Σ_k p_k α_k × D_k`` with the
    samples' weights ``p_k = n_k/n``: Prop. 5.1's ``θ_φ``, the aggregate of the very same client models
    without decomposition (for ``none`` it equals the aggregate). ``start_filters`` (per module)
    replace the initial model's plain conv weights, so a plain model can start from the function an
    atoms model with fewer atoms than ``k²`` starts from.
    """
    ids = [c.client_id for c in clients]
    train_config = config.train_config(device="cpu")
    start: dict[str, Tensor] = {}
    aggregates, products = [], []
    for i, rep_seed in enumerate(repetition_seeds):
        federation = config.build_federation(num_clients_total=len(clients))
        for module, filters in (start_filters or {}).items():
            weight = federation.global_tensors.get(f"{module}.weight")
            if weight is not None:  # before any fetch: nothing derived from the old value is cached yet
                federation.global_tensors[f"{module}.weight"] = filters.to(weight.dtype).clone()
        start = conv_filters(federation.global_tensors)
        plan = federation.plan(1, ids)
        federation.begin(plan)
        by_id = {c.client_id: c for c in clients}
        pushed: list[tuple[int, dict[str, Tensor]]] = []
        for cid in plan.cohort:
            vc = by_id[cid]
            state = ClientState(client_id=cid, tier=vc.state.tier)
            spec = federation.tier_spec(state.tier)
            state.receive(federation.fetch(state.tier, state.versions))
            task = TrainTask(
                round=1,
                due=federation.tier_due(state.tier, plan.due),
                config=train_config,
                continue_unsynced=plan.continue_unsynced,
                seed=derive_seed(config.seed, "repetition", rep_seed, cid),
                strategy=federation.strategy.client_config(),
                local=federation.local_tier_tensors(state.tier),
            )
            push = run_task(state, spec, task, vc.train, personal_atoms=config.personal_atoms)
            pushed.append((push.num_samples, conv_filters(spec.to_full(push.tensors))))
            federation.fold(
                ClientUpdate(
                    client_id=cid,
                    num_samples=push.num_samples,
                    tier=state.tier,
                    spec=spec,
                    tensors=push.tensors,
                    metrics=push.metrics,
                )
            )
        federation.close()
        aggregates.append(conv_filters(federation.global_tensors))
        total = sum(n for n, _ in pushed)
        products.append({k: torch.stack([(n / total) * f[k] for n, f in pushed]).sum(dim=0) for k in pushed[0][1]})
        if progress is not None:
            progress(f"{config.factorization}: repetition {i + 1}/{len(repetition_seeds)} aggregated")
    return start, aggregates, products


@dataclass(frozen=True)
class VarianceResult:
    """One factorization's measurement, per conv layer."""

    factorization: str
    repetitions: int
    variance: dict[str, float]  # (1/N_c) Σ_i ‖θ^i − θ̄‖² of the aggregate the server keeps
    movement: dict[str, float]  # ‖θ̄ − θ^0‖²: how far the mean aggregate moved from the start
    product_variance: dict[str, float]  # the same for Σ_k p_k α_k × D_k of the same clients

    @property
    def total_variance(self) -> float:
        return math.fsum(self.variance.values())

    @property
    def total_product_variance(self) -> float:
        return math.fsum(self.product_variance.values())

    @property
    def total_movement(self) -> float:
        return math.fsum(self.movement.values())

    def to_dict(self) -> dict:
        return {
            "factorization": self.factorization,
            "repetitions": self.repetitions,
            "variance": self.variance,
            "movement": self.movement,
            "product_variance": self.product_variance,
            "total_variance": self.total_variance,
            "total_movement": self.total_movement,
            "total_product_variance": self.total_product_variance,
        }


def compare(
    config: FederationConfig,
    clients: Sequence[VirtualClient],
    repetitions: int,
    factorizations: Sequence[str] = ("none", "atoms"),
    repetition_seeds: Sequence[int] | None = None,
    threads: int = 1,
    progress: ProgressFn | None = None,
) -> dict[str, VarianceResult]:
    """:func:`repeated_aggregates` for each factorization on the same clients and repetition seeds.

    Every factorization starts from one function: the first atoms factorization's initial effective
    filters ``α⁰ × D⁰`` are loaded into the others' plain convs. With ``m_a ≥ k²`` they are the plain
    model's own filters, factorized exactly (``ModelSpec.initial_model``); with fewer atoms they are
    the best rank-``m_a`` approximation, which the plain model then starts from too.
    """
    if repetitions < 2 and repetition_seeds is None:
        raise ValueError(f"variance needs at least 2 repetitions, got {repetitions}")
    seeds = list(range(repetitions)) if repetition_seeds is None else list(repetition_seeds)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        atoms = [f for f in factorizations if f.startswith("atoms")]
        common = None
        if atoms:
            common = conv_filters(replace(config, factorization=atoms[0]).spec.initial_model(config.seed).state_dict())
        for f in factorizations:
            run = replace(config, factorization=f)
            start, aggregates, products = repeated_aggregates(run, clients, seeds, progress, common)
            out[f] = VarianceResult(
                f,
                len(seeds),
                aggregate_variance(aggregates),
                squared_distance(_mean(aggregates), start),
                aggregate_variance(products),
            )
        return out
    finally:
        torch.set_num_threads(previous)


def format_table(results: Mapping[str, VarianceResult], baseline: str = "none") -> str:
    """Per conv layer and in total, one column each:

    * ``var[f]``: the variance of factorization ``f``'s aggregate across repetitions;
    * ``f/none``: its ratio to the baseline's (Prop. 5.1 predicts below 1 for atoms);
    * ``var[f Σpα×D]``: the variance of the same repetitions' clients averaged as filters,
      ``Σ p_k α_k × D_k``, and ``f/Σpα×D``, the aggregate's ratio to it: Prop. 5.1's comparison on the
      very same client models, free of any difference in how the two parametrizations train;
    * ``var/move[f]``: the variance over ``‖θ̄ − θ⁰‖²``, how far the mean aggregate moved, which
      removes a difference in step size between the parametrizations.
    """
    names = list(results)
    others = [f for f in names if f != baseline] if baseline in results else []
    header = [f"var[{f}]" for f in names] + [f"{f}/{baseline}" for f in others]
    header += [h for f in others for h in (f"var[{f} Σpα×D]", f"{f}/Σpα×D")]
    header += [f"var/move[{f}]" for f in names]
    width = max(16, *(len(h) + 2 for h in header))
    head = f"{'layer':<8}" + "".join(f"{h:>{width}}" for h in header)
    lines = [head, "-" * len(head)]

    def row(label: str, pick: Callable[[VarianceResult, str], float]) -> str:
        var = {f: pick(r, "variance") for f, r in results.items()}
        cells = [f"{var[f]:.4e}" for f in names] + [_ratio(var[f], var[baseline]) for f in others]
        for f in others:
            product = pick(results[f], "product_variance")
            cells += [f"{product:.4e}", _ratio(var[f], product)]
        cells += [_ratio(var[f], pick(results[f], "movement")) for f in names]
        return f"{label:<8}" + "".join(f"{c:>{width}}" for c in cells)

    def per_layer(layer: str) -> Callable[[VarianceResult, str], float]:
        return lambda r, field: getattr(r, field)[layer]

    for layer in next(iter(results.values())).variance:
        lines.append(row(layer, per_layer(layer)))
    lines.append("-" * len(head))
    lines.append(row("total", lambda r, field: math.fsum(getattr(r, field).values())))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.4f}" if b > 0 else "n/a"


def stderr_progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)
