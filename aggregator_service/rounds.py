"""The round state machine without transport or storage: cohort, due tensors, fold, close.

`Federation` owns the global full-rank tensors with their versions, the strategy, the
interval policy and the per-tier downloads. The in-process simulator drives it directly;
the gRPC service drives the same object and persists what it returns, so both transports
compute identical rounds.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from aggregator_service.held_average import TIER_AVERAGES, HeldAverage
from aggregator_service.intervals import IntervalPolicy, discrepancy
from aggregator_service.metrics import latent_clients
from aggregator_service.refactorization import TIER_INITS, Spectra, refactorize
from aggregator_service.strategies import RoundAccumulator, Strategy
from aggregator_service.update_bounds import UpdateBounds
from aggregator_service.updates import AggregateResult, ClientUpdate
from fedcore import codec
from fedcore.keys import derive_seed
from fedcore.spec import ModelSpec

__all__ = [
    "COHORT_MODES",
    "CohortSampler",
    "Federation",
    "RoundOutcome",
    "RoundPlan",
]

COHORT_MODES = ("period", "per_round")


@dataclass(frozen=True)
class RoundPlan:
    round: int
    cohort: tuple[str, ...]
    due: tuple[str, ...]  # full-rank tensor names aggregated at the end of this round
    continue_unsynced: bool  # cohort members keep their local values of tensors not synced last round


class CohortSampler:
    """Samples ``max(min_clients, round(fraction·N))`` clients, per round or per sync period.

    In ``period`` mode (FedLAMA's rule) a cohort stays for the policy's whole sync period, so
    tensors with long intervals continue from the clients' local values; ``per_round``
    resamples every round (the decomposition paper's setting) and clients start from the
    last global values.
    """

    def __init__(self, fraction: float = 1.0, min_clients: int = 1, mode: str = "period", seed: int = 0) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if min_clients < 1:
            raise ValueError(f"min_clients must be ≥ 1, got {min_clients}")
        if mode not in COHORT_MODES:
            raise ValueError(f"unknown cohort mode {mode!r}; choose one of {', '.join(COHORT_MODES)}")
        self.fraction, self.min_clients, self.mode, self.seed = fraction, min_clients, mode, seed

    def size(self, available: int) -> int:
        return min(available, max(self.min_clients, math.floor(self.fraction * available + 0.5)))

    def starts_period(self, round_: int, sync_period: int) -> bool:
        return self.mode == "per_round" or (round_ - 1) % sync_period == 0

    def sample(self, round_: int, candidates: Sequence[str]) -> tuple[str, ...]:
        pool = sorted(candidates)
        if len(pool) < self.min_clients:
            raise ValueError(f"round {round_}: {len(pool)} clients available, at least {self.min_clients} needed")
        chosen = random.Random(derive_seed(self.seed, "cohort", round_)).sample(pool, self.size(len(pool)))
        return tuple(sorted(chosen))


@dataclass
class RoundOutcome:
    """What closing a round produced; the service writes all of it in one transaction."""

    round: int
    cohort: tuple[str, ...]
    due: tuple[str, ...]
    result: AggregateResult
    discrepancy: dict[str, float]
    intervals: dict[str, int]  # intervals in force for the next round
    latent_clients: int
    reported: int
    fold_order: list[str] = field(default_factory=list)


class Federation:
    """Global model, versions, strategy and interval policy: one round at a time."""

    def __init__(
        self,
        spec: ModelSpec,
        strategy: Strategy,
        policy: IntervalPolicy,
        sampler: CohortSampler,
        *,
        tiers: Sequence[float] = (1.0,),
        init_seed: int = 0,
        global_tensors: Mapping[str, Tensor] | None = None,
        fp16: bool = False,
        personal: Sequence[str] = (),
        tier_init: str = "energy",
        tier_average: str = "held",
        nested_rank_ratio: float | None = None,
    ) -> None:
        if tier_init not in TIER_INITS:
            raise ValueError(f"tier_init must be one of {', '.join(TIER_INITS)}, got {tier_init!r}")
        if tier_average not in TIER_AVERAGES:
            raise ValueError(f"tier_average must be one of {', '.join(TIER_AVERAGES)}, got {tier_average!r}")
        self.spec = spec.full()
        #: how tiers are cut from tensors no round has aggregated yet (:mod:`.refactorization`)
        self.tier_init = tier_init
        #: how tiers below 1 are averaged into factorized tensors (:mod:`.held_average`)
        self.tier_average = tier_average
        self.tiers = tuple(sorted({float(t) for t in tiers}, reverse=True))
        #: the smallest tier where mixed tiers train nested; under tier_init "nested" every first cut holds its cut
        self.nested_rank_ratio = nested_rank_ratio
        self.strategy = strategy
        self.policy = policy
        self.sampler = sampler
        self.fp16 = fp16
        #: full-rank tensors a personalization baseline keeps on the clients (FedPer's head, LG-FedAvg's body)
        self.personal = frozenset(personal)
        unknown = self.personal - set(self.spec.names)
        if unknown:
            raise ValueError(f"personal tensors {sorted(unknown)[:5]} are not part of the model")
        if global_tensors is None:
            global_tensors = self.spec.initial_model(init_seed).state_dict()
        missing = set(self.spec.names) - set(global_tensors)
        if missing:
            raise ValueError(f"global model lacks tensors {sorted(missing)[:5]}")
        self.global_tensors: dict[str, Tensor] = {n: global_tensors[n].detach().clone() for n in self.spec.names}
        self.versions: dict[str, int] = dict.fromkeys(self.spec.names, 0)
        self.round = 0
        self.cohort: tuple[str, ...] = ()
        self._tier_cache: tuple[tuple[int, ...], dict[float, dict[str, Tensor]]] = ((), {})
        #: (versions, tier → the full-rank values its clients start from): what update bounds measure moves from
        self._received: tuple[tuple[int, ...], dict[float, dict[str, Tensor]]] = ((), {})
        #: the round-start tensors' SVDs, shared by the tiers' cuts and the held average
        self._spectra = Spectra()
        self._tier_specs: dict[float, ModelSpec] = {}
        self._acc: RoundAccumulator | None = None
        self._plan: RoundPlan | None = None
        self._fold_order: list[str] = []
        self.bounds: UpdateBounds | None = None  # the service's update bounds; clip mode acts at fold

    # -- what clients download
    def fork(self) -> Federation:
        """An engine to fold a round into while this one goes on answering (the service's close).

        The specs are immutable, and a close replaces global tensors, never changes one in place: all
        are shared, not copied (a model's worth of memory the close would otherwise hold twice); the
        per-tier cache is keyed by the versions the close changes, so the fork starts without it.
        """
        memo: dict[int, Any] = {
            id(self.spec): self.spec,
            id(self._tier_cache): ((), {}),
            id(self._received): (self._received[0], dict(self._received[1])),  # exact: same versions, same values
            id(self._tier_specs): self._tier_specs,
            id(self._spectra): self._spectra,
        }
        memo.update((id(t), t) for t in self.global_tensors.values())
        return copy.deepcopy(self, memo)

    def tier_spec(self, tier: float) -> ModelSpec:
        """The spec a client of ``tier`` trains; built once per tier (specs are immutable; every fetch asks)."""
        spec = self._tier_specs.get(tier)
        if spec is None:
            spec = self._tier_specs[tier] = self.spec.at_tier(tier)
        return spec

    def tier_tensors(self, tier: float) -> dict[str, Tensor]:
        """The global model shaped for ``tier`` (truncated SVD of factorized tensors), cached per version.

        All known tiers are factorized together, so each factorized tensor costs one SVD per version.
        A tensor still at version 0 (the initial model) is cut as ``tier_init`` says.
        """
        key = tuple(self.versions.values())
        cached_key, per_tier = self._tier_cache
        if cached_key != key or tier not in per_tier:
            tiers = sorted({*self.tiers, float(tier)}, reverse=True)
            untrained = [n for n, v in self.versions.items() if v == 0] if self.tier_init != "truncated" else []
            energy_ranks = None
            if self.tier_init == "nested" and self.nested_rank_ratio is not None:
                energy_ranks = self.tier_spec(self.nested_rank_ratio).pair_ranks
            per_tier = refactorize(
                self.global_tensors,
                [self.tier_spec(t) for t in tiers],
                frozenset(untrained),
                self._spectra,
                energy_ranks,
            )
            self._tier_cache = (key, per_tier)
        return per_tier[tier]

    def received(self, tier: float) -> dict[str, Tensor]:
        """The full-rank values a client of ``tier`` starts its round from: its cut of the global model as the
        wire delivers it (fp16 transport rounds it), aligned to full rank (FedHM eq. 1).

        A client's move is measured from here (:mod:`.update_bounds`): a low tier never held the directions
        past its rank, so the global model's part there (the cut's residual) is no part of its move."""
        key = tuple(self.versions.values())
        if self._received[0] != key:  # a new version: every tier's entry is stale
            self._received = (key, {})
        per_tier = self._received[1]
        if tier not in per_tier:
            cut = {n: codec.as_delivered(t, self.fp16) for n, t in self.tier_tensors(tier).items()}
            per_tier[tier] = self.tier_spec(tier).to_full(cut)
        return per_tier[tier]

    def tier_versions(self, tier: float) -> dict[str, int]:
        return {t.name: self.versions[t.full_name or t.name] for t in self.tier_spec(tier).tensors}

    def fetch(self, tier: float, held: Mapping[str, int]) -> dict[str, tuple[Tensor, int]]:
        """Tensors whose global version is not the one the client holds: newer, or older where the federation was
        restored from a backup taken before the client's last fetch (its tensors are of rounds that no longer are)."""
        versions = self.tier_versions(tier)
        tensors = self.tier_tensors(tier)
        return {n: (tensors[n], v) for n, v in versions.items() if held.get(n, -1) != v}

    def tier_due(self, tier: float, due: Sequence[str]) -> tuple[str, ...]:
        wanted = set(due)
        return tuple(t.name for t in self.tier_spec(tier).tensors if (t.full_name or t.name) in wanted)

    # -- the round
    def plan(self, round_: int, candidates: Sequence[str]) -> RoundPlan:
        """Decide round ``round_``: its cohort (kept within a sync period) and the tensors due."""
        if self._plan is not None:
            raise RuntimeError(f"round {self._plan.round} is still open")
        period = self.policy.cohort_period
        new_period = self.sampler.starts_period(round_, period) or not self.cohort
        if new_period:
            self.cohort = self.sampler.sample(round_, candidates)
        local = self.kept_local()
        due = tuple(n for n in self.policy.due(round_) if n not in local)
        return RoundPlan(round_, self.cohort, due, continue_unsynced=not new_period)

    def begin(self, plan: RoundPlan) -> None:
        """Open ``plan`` for folding; a restarted service re-begins the plan it had persisted."""
        if self._plan is not None:
            raise RuntimeError(f"round {self._plan.round} is still open")
        self.cohort = plan.cohort
        self._plan = plan
        self._acc = self.strategy.begin(self.global_tensors, plan.due)
        if self.tier_average == "held" and any(t < 1.0 for t in self.tiers):
            self._acc.held = HeldAverage(self.global_tensors, self._held_reach(), self._spectra)
        self._fold_order = []

    def _held_reach(self) -> dict[str, int]:
        """Factorized tensors no tier trains whole → the largest rank a tier trains them at."""
        reach: dict[str, int] = {}
        whole: set[str] = set()
        for tier in self.tiers:
            spec = self.tier_spec(tier)
            whole.update(t.name for t in spec.tensors if t.full_name is None)
            for name, rank in spec.pair_ranks.items():
                reach[name] = max(reach.get(name, 0), rank)
        return {n: r for n, r in reach.items() if n not in whole}

    def fold(self, update: ClientUpdate) -> None:
        if self._plan is None or self._acc is None:
            raise RuntimeError("no open round")
        if update.client_id not in self._plan.cohort:
            raise ValueError(f"client {update.client_id} is not in round {self._plan.round}'s cohort")
        if self.bounds is not None and self.bounds.folds_scaled(update):
            update = self.bounds.clip(update, self.received(update.tier))
        self.strategy.fold(self._acc, update)
        self._fold_order.append(update.client_id)

    def _rounds_of_drift(self, name: str) -> int:
        """Rounds the folded values trained since their last sync: FedLAMA's τ_l in eq. (2).

        A kept cohort continues unsynced tensors for their whole interval; a cohort resampled every
        round restarts every tensor from the global value, so its values drifted for one round only.
        """
        return self.policy.interval(name) if self.sampler.mode == "period" else 1

    def kept_local(self) -> frozenset[str]:
        """Full-rank tensors never aggregated: the strategy's (e.g. BN statistics kept local) and the personal ones."""
        return self.strategy.local_tensors(self.spec) | self.personal

    def local_tier_tensors(self, tier: float) -> tuple[str, ...]:
        """This tier's tensors that never leave the clients (e.g. BN statistics kept local, a personal head)."""
        local = self.kept_local()
        return tuple(t.name for t in self.tier_spec(tier).tensors if (t.full_name or t.name) in local)

    def close(self) -> RoundOutcome:
        if self._plan is None or self._acc is None:
            raise RuntimeError("no open round")
        plan, acc = self._plan, self._acc
        result = self.strategy.finish(acc, self.global_tensors)
        for name, tensor in result.tensors.items():
            self.global_tensors[name] = tensor
            self.versions[name] = plan.round
        d = {
            n: discrepancy(result.dispersion[n], self._rounds_of_drift(n), self.global_tensors[n].numel())
            for n in result.dispersion
        }
        self.policy.observe(plan.round, d)
        self.round = plan.round
        self._plan, self._acc = None, None
        return RoundOutcome(
            round=plan.round,
            cohort=plan.cohort,
            due=plan.due,
            result=result,
            discrepancy=d,
            intervals=self.policy.intervals(),
            # latent clients exist only where atoms and coefficients were both averaged this round
            latent_clients=latent_clients(result.num_clients) if result.effective_dispersion else 0,
            reported=result.num_clients,
            fold_order=list(self._fold_order),
        )
