"""The operator's view of a federation: REST, Prometheus /metrics and a live page over the aggregator's database.

The app and its settings load on first use, so ``fedatoms`` commands other than ``dashboard`` do
not import FastAPI and the store to build their parser.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import DashboardSettings

__all__ = ["DashboardSettings", "create_app"]

_MODULE_OF = {"create_app": ".app", "DashboardSettings": ".settings"}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
