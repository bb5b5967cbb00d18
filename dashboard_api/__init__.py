"""The operator's view of a federation: REST, Prometheus /metrics and a live page over the aggregator's database.

The app and its settings load on first use, so ``fedatoms`` commands other than ``dashboard`` do
not import FastAPI and the store to build their parser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import DashboardSettings

__all__ = ["DashboardSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "DashboardSettings":
        from .settings import DashboardSettings

        return DashboardSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
