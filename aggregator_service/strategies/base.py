"""What every strategy is: a small object with few verbs, in Flower's style.

The round template (plan, fold every reported update, close) lives with the caller
(:mod:`aggregator_service.rounds`); a strategy only supplies the verbs::

    acc = strategy.begin(global_tensors, due)
    for update in updates:            # any order, one at a time
        strategy.fold(acc, update)
    result = strategy.finish(acc, global_tensors)   # new values of the due tensors + metrics

``fold`` adds one client to streaming float64 accumulators, so closing a round costs
O(model) memory whatever the number of clients (the robust rules, FedMedian and
FedTrimmedAvg, are the exception: a median needs every client's value).

The hooks, and who calls them (docs/strategies.md has a worked user strategy):

``client_config()``
    JSON sent with every TRAIN task. The keys :class:`fedcore.training.terms.LocalTerms`
    reads switch on the client-side terms every fedatoms client runs: ``"scaffold": true``
    (control variates; the client then fetches :meth:`server_control` and pushes ``Δc_i``),
    ``"feddyn_alpha"``, ``"feddc_alpha"``. Clients run fedatoms' code, so a strategy chooses
    among these terms; it cannot ship new client code.
``server_control(spec)``
    The server tensors clients need for their terms (SCAFFOLD's ``c``), or ``None``.
``local_tensors(spec)``
    Full-rank names never aggregated (they stay on the clients).
``begin`` / ``fold`` / ``finish``
    One round, as above. ``finish`` returns the new values of the due tensors. ``update.tensors``
    may be a mapping that reads each tensor when it is looked up (the service's close): read it
    a module at a time (:meth:`ClientUpdate.modules`) to hold no more of it than that.
``state_dict()`` / ``load_state_dict()``
    Server state that must survive a restart; written in the round-closing transaction. Entries
    named in :attr:`state_tensors` are ``{name: Tensor}`` groups, stored as tensor rows (kind =
    the entry's key); everything else must be JSON. A restarted aggregator calls
    ``load_state_dict`` with what the last closed round wrote.
``refuse(setting)``
    A reason the strategy cannot compose with the federation's factorization, tiers,
    intervals or step sizes, or ``None``; the federation refuses such a configuration at start.
``num_clients_total``
    Optional attribute: when a strategy has it (SCAFFOLD, FedDyn, FedDC divide by ``N``),
    the service sets it to the clients ever enrolled (revoked ones included) before every close.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from aggregator_service.held_average import HeldAverage
from aggregator_service.updates import AggregateResult, ClientUpdate
from aggregator_service.weighted_mean import WeightedMean
from fedcore.spec import ModelSpec

__all__ = ["RoundAccumulator", "Setting", "Strategy"]


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
    #: the model's buffers (BatchNorm statistics), named by the folded updates' specs: they take the clients'
    #: mean whatever the server step (:meth:`FedAvg.new_value`)
    buffers: set[str] = field(default_factory=set)
    #: set by the federation when tiers below 1 are averaged where they hold (:mod:`aggregator_service.held_average`)
    held: HeldAverage | None = None


@dataclass(frozen=True)
class Setting:
    """What a strategy composes with: the federation's keys that decide whether its math holds."""

    factorization: str = "none"
    tiers: tuple[float, ...] = (1.0,)
    interval_policy: str = "every_round"
    atom_lr: str = "preconditioned"

    @property
    def low_rank(self) -> bool:
        """Whether some clients train factor pairs (tiers below 1)."""
        return any(t < 1.0 for t in self.tiers)


class Strategy(ABC):
    """A server-side aggregation rule; the caller owns the round template (begin → fold… → finish)."""

    name: ClassVar[str]
    #: Entries of :meth:`state_dict` that are ``{name: Tensor}`` groups (stored as tensor rows).
    state_tensors: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def refuse(cls, setting: Setting) -> str | None:
        """Why this strategy cannot run in ``setting``, or ``None`` when it can."""
        return None

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
        """Server state that must survive a restart (tensor groups named in :attr:`state_tensors`)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")
