"""The operator's view of a federation: REST, Prometheus /metrics and a live page over the aggregator's database."""

from .app import create_app
from .settings import DashboardSettings

__all__ = ["DashboardSettings", "create_app"]
