"""Prometheus exposition: a collector that reads the database at scrape time.

The aggregator's state lives in the database, not in this process, so the dashboard keeps no
counters of its own: each scrape asks the database (a few aggregated queries) and reports what
it holds now. Every app gets its own :class:`CollectorRegistry`, so two apps in one process
(tests, a benchmark) never share or collide on metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from aggregator_service import store
from aggregator_service.database_url import driver_says

from . import queries

__all__ = ["DURATION_BUCKETS", "FederationCollector", "build_registry"]

log = logging.getLogger(__name__)

#: Round duration buckets (seconds): from a simulated round on loopback to a cross-device deadline.
DURATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_INFO_KEYS = ("model", "factorization", "strategy", "interval_policy")


class FederationCollector(Collector):
    """One federation's rounds, clients, bandwidth, accuracy and client spread, read at scrape time."""

    def __init__(
        self, factory: sessionmaker[Session], federation_name: str, online_since: Callable[[], datetime]
    ) -> None:
        self._factory = factory
        self._name = federation_name
        self._online_since = online_since

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("fedatoms_database_up", "1 when the dashboard could read the federation's database")
        try:
            with self._factory.begin() as session:
                fed = store.get_federation(session, self._name)
                snap = (
                    None
                    if fed is None
                    else queries.metrics_snapshot(session, fed, self._online_since(), DURATION_BUCKETS)
                )
        except SQLAlchemyError as exc:
            log.warning("metrics scrape could not read the database: %s", driver_says(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._serving()
        found = GaugeMetricFamily(
            "fedatoms_federation_found",
            "1 when the database holds the federation the dashboard is configured for (federation_name); 0: a "
            "wrong name, or the aggregator has not created it yet",
        )
        found.add_metric([], 0 if fed is None else 1)
        yield found
        if snap is not None:
            yield from _families(snap)

    def _serving(self) -> Iterator[Metric]:
        """Whether an aggregator holds the federation's lock: what tells a stopped aggregator from a quiet one."""
        try:
            with self._factory() as session:
                served = store.federation_served(session.connection(), self._name)
        except (SQLAlchemyError, OSError) as exc:  # the lock file unreadable, the lock query refused: say nothing
            log.warning("metrics scrape could not tell whether an aggregator serves: %s", exc)
            return
        yield from _gauge(
            "fedatoms_aggregator_serving",
            "1 while an aggregator holds the federation's lock (it serves it); 0: none does, stopped or crashed",
            1 if served else 0,
        )


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> Iterator[Metric]:
    if value is None:
        return
    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    yield g


def _families(snap: dict) -> Iterator[Metric]:
    info = InfoMetricFamily("fedatoms_federation", "The federation's name and method")
    info.add_metric([], {"name": snap["name"], **{k: str(snap["config"].get(k, "")) for k in _INFO_KEYS}})
    yield info
    state = GaugeMetricFamily("fedatoms_federation_state", "1 for the federation's current state", labels=["state"])
    for s in store.FEDERATION_STATES:
        state.add_metric([s], 1 if snap["state"] == s else 0)
    yield state
    yield from _gauge(
        "fedatoms_current_round",
        "The open round, else the last closed one (goes back when a round is abandoned: alert on "
        "fedatoms_last_closed_round)",
        snap["current_round"],
    )
    yield from _gauge(
        "fedatoms_last_closed_round",
        "The last closed round, 0 before the first (never decreases)",
        snap["last_closed_round"],
    )
    yield from _gauge(
        "fedatoms_last_round_closed_timestamp_seconds",
        "When the last closed round closed, Unix seconds; absent before the first close",
        snap["last_closed_at"],
    )
    yield from _gauge(
        "fedatoms_open_round_opened_timestamp_seconds",
        "When the open round opened, Unix seconds; absent while no round is open",
        snap["open_round_opened_at"],
    )
    yield from _gauge(
        "fedatoms_open_round_deadline_timestamp_seconds",
        "The open round's deadline, Unix seconds; absent while no round is open",
        snap["open_round_deadline"],
    )
    rounds = GaugeMetricFamily("fedatoms_rounds", "Rounds by state", labels=["state"])
    for s, n in snap["rounds"].items():
        rounds.add_metric([s], n)
    yield rounds
    for key, name, doc in (
        ("cohort_size", "fedatoms_round_cohort_clients", "Clients sampled into the finished rounds' cohorts"),
        ("reported", "fedatoms_round_reported_clients", "Clients whose update the finished rounds kept"),
        ("stragglers", "fedatoms_round_straggler_clients", "Cohort clients whose update the finished rounds lacked"),
    ):
        counter = CounterMetricFamily(name, f"{doc}, summed over rounds, by how the round ended", labels=["state"])
        for state, sums in snap["participation"].items():
            counter.add_metric([state], sums[key])
        yield counter
    clients = snap["clients"]
    yield from _gauge(
        "fedatoms_clients_online", "Unrevoked clients heard from within the heartbeat timeout", clients["online"]
    )
    yield from _gauge("fedatoms_clients_registered", "Enrolled clients, revoked ones excluded", clients["registered"])
    yield from _gauge("fedatoms_clients_revoked", "Clients whose token was revoked", clients["revoked"])

    cumulative = [(str(b), n) for b, n in snap["duration_buckets"]] + [("+Inf", snap["duration_count"])]
    hist = HistogramMetricFamily("fedatoms_round_duration_seconds", "Duration of closed rounds, open to close")
    hist.add_metric([], cumulative, sum_value=snap["duration_sum"])
    yield hist

    for direction in ("down", "up"):
        c = CounterMetricFamily(f"fedatoms_bytes_{direction}", f"Payload bytes moved {direction}, all clients")
        c.add_metric([], snap[f"bytes_{direction}"])
        yield c
    by_category = CounterMetricFamily(
        "fedatoms_transfer_bytes",
        "Payload bytes moved, all clients, by category (train_fetch, eval_fetch: down; push: up)",
        labels=["category"],
    )
    for category in ("train_fetch", "eval_fetch", "push"):
        by_category.add_metric([category], snap[f"bytes_{category}"])
    yield by_category
    fedavg = CounterMetricFamily(
        "fedatoms_fedavg_equivalent_bytes",
        "Bytes plain FedAvg would have moved for the same transfers: the whole fp32 plain model per transfer",
    )
    fedavg.add_metric([], snap["fedavg_equivalent_bytes"])
    yield fedavg

    for key, name, doc in (
        ("test_accuracy", "fedatoms_global_test_accuracy", "Server-side test accuracy of the latest global model"),
        ("test_loss", "fedatoms_global_test_loss", "Server-side test loss of the latest global model"),
        (
            "dispersion",
            "fedatoms_dispersion",
            "Client spread (within round) Σ_k p_k ‖x_k − u‖² over tensors, last closed round",
        ),
    ):
        latest = snap[key]
        yield from _gauge(name, doc, None if latest is None else latest[1])
    if snap["tier_accuracy"]:  # a federation without tiers below 1 has no cut to report
        cuts = GaugeMetricFamily(
            "fedatoms_tier_test_accuracy",
            "Server-side test accuracy of the latest global model cut to a tier below 1 (what that tier's clients run)",
            labels=["tier"],
        )
        for tier, accuracy in snap["tier_accuracy"].items():
            cuts.add_metric([tier], accuracy)
        yield cuts
    means = snap["evaluations"]
    if means is not None:
        yield from _gauge(
            "fedatoms_mean_client_accuracy",
            "Clients' weighted accuracy of the global model",
            means["mean_client_accuracy"],
        )
        yield from _gauge(
            "fedatoms_personalized_accuracy",
            "Clients' weighted accuracy of their personalized models (personal atoms or a baseline)",
            means["personalized_accuracy"],
        )

    per_tensor = {
        "d_l": GaugeMetricFamily("fedatoms_tensor_discrepancy", "FedLAMA's d_l per tensor", labels=["tensor", "role"]),
        "dispersion": GaugeMetricFamily(
            "fedatoms_tensor_dispersion",
            "Client spread (within round) Σ_k p_k ‖x_k − u‖² per tensor",
            labels=["tensor", "role"],
        ),
        "interval": GaugeMetricFamily("fedatoms_tensor_interval", "Interval τ_l in force", labels=["tensor", "role"]),
    }
    for row in snap["tensors"]:
        for key, family in per_tensor.items():
            if row[key] is not None:
                family.add_metric([row["name"], row["role"] or ""], row[key])
    yield from per_tensor.values()


def build_registry(
    factory: sessionmaker[Session], federation_name: str, online_since: Callable[[], datetime]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FederationCollector(factory, federation_name, online_since))
    return registry
