"""Server-side aggregation strategies, one per module, and the registry that names them.

The API every strategy implements is :class:`~aggregator_service.strategies.base.Strategy`
(its module docstring lists the hooks); docs/strategies.md walks through a user's own.
A strategy is named in the federation's config by its registry name (:data:`STRATEGIES`)
or by reference, ``"package.module:Class"`` (:func:`strategy_class`), and built with the
keyword arguments of its ``__init__`` (:func:`build_strategy`).
"""

from __future__ import annotations

import inspect
from typing import Any

from aggregator_service.strategies.base import RoundAccumulator, Setting, Strategy
from aggregator_service.strategies.fedadagrad import FedAdagrad
from aggregator_service.strategies.fedadam import FedAdam
from aggregator_service.strategies.fedavg import FedAvg
from aggregator_service.strategies.fedavgm import FedAvgM
from aggregator_service.strategies.feddc import FedDC
from aggregator_service.strategies.feddyn import FedDyn
from aggregator_service.strategies.fedmedian import FedMedian
from aggregator_service.strategies.fedopt import FedOpt
from aggregator_service.strategies.fedprox import FedProx
from aggregator_service.strategies.fedtrimmedavg import FedTrimmedAvg
from aggregator_service.strategies.fedyogi import FedYogi
from aggregator_service.strategies.reference import import_reference, is_reference
from aggregator_service.strategies.scaffold import Scaffold, ScaffoldAccumulator

__all__ = [
    "STRATEGIES",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedDC",
    "FedDyn",
    "FedMedian",
    "FedOpt",
    "FedProx",
    "FedTrimmedAvg",
    "FedYogi",
    "RoundAccumulator",
    "Scaffold",
    "ScaffoldAccumulator",
    "Setting",
    "Strategy",
    "accepts",
    "build_strategy",
    "strategy_class",
]

#: Strategy name (``--strategy``, the federation's config) → class.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedProx,
        Scaffold,
        FedAvgM,
        FedAdam,
        FedYogi,
        FedAdagrad,
        FedMedian,
        FedTrimmedAvg,
        FedDyn,
        FedDC,
    )
}


def strategy_class(name: str) -> type[Strategy]:
    """The class a registry name or a ``"package.module:Class"`` reference names."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if not is_reference(name):
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} or give 'package.module:Class'"
        )
    cls = import_reference(name)
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise ValueError(f"strategy {name!r} is not a subclass of aggregator_service.strategies.Strategy")
    if inspect.isabstract(cls):
        raise ValueError(f"strategy {name!r} leaves abstract methods unimplemented: {sorted(cls.__abstractmethods__)}")
    return cls


def accepts(cls: type[Strategy]) -> frozenset[str]:
    """The keyword arguments ``cls.__init__`` takes."""
    return frozenset(
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def build_strategy(name: str, **params: Any) -> Strategy:
    """Instantiate a strategy by name or reference, e.g. ``build_strategy("fedprox", mu=0.01)``."""
    cls = strategy_class(name)
    defaults = {p.name: p.default for p in inspect.signature(cls).parameters.values()}
    for key, value in params.items():  # a value of another kind than the default's, named before the class sees it
        default = defaults.get(key, inspect.Parameter.empty)
        numeric = isinstance(default, int | float) and not isinstance(default, bool)
        if numeric and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"strategy {name!r}: {key} = {value!r} is not a number (its default is {default!r})")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"strategy {name!r}: {key} = {value!r} is not true or false (its default is {default!r})")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for strategy {name!r}: {exc}") from exc
