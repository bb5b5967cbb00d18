"""Server-side aggregation strategies, one per module, and the registry that names them.

Adding a strategy (FedDyn, FedDC, …) is one module and one line here: subclass
:class:`FedAvg` (or :class:`Strategy`), give it a ``name``, return its client
hyper-parameters from :meth:`~Strategy.client_config`, extend :class:`RoundAccumulator` if it
needs more running sums (as :class:`Scaffold` does with :class:`ScaffoldAccumulator`),
override :meth:`~Strategy.fold` to add them and :meth:`~Strategy.finish` to turn the averages
into the new global values — FedDyn, e.g., keeps a server state ``h`` updated from the mean
drift and returns ``ȳ − h/α`` — keep that server state in :meth:`~Strategy.state_dict` /
:meth:`~Strategy.load_state_dict` so it survives a restart, and list the class in
:data:`STRATEGIES`.
"""

from __future__ import annotations

from typing import Any

from aggregator_service.strategies.base import RoundAccumulator, Strategy
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.fedprox import FedProx
from aggregator_service.strategies.scaffold import Scaffold, ScaffoldAccumulator

__all__ = [
    "STRATEGIES",
    "FedAvg",
    "FedProx",
    "RoundAccumulator",
    "Scaffold",
    "ScaffoldAccumulator",
    "Strategy",
    "build_strategy",
]

#: Strategy name (``--strategy``, the federation's config) → class.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedProx,
        Scaffold,
    )
}


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
