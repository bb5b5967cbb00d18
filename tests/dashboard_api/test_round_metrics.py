"""Rounds in ``/metrics`` against rows the store wrote with hand-chosen times and cohorts, on SQLite and PostgreSQL.

The oracle is worked out by hand: Unix seconds of the chosen UTC times (2024-01-01T00:00Z is 1,704,067,200; 2024
is a leap year, so 2024-03-01T00:00Z is 60 days later, 1,709,251,200), and the cohorts' counts. Round 1 closes with
3 of its 53 clients reported (50 stragglers), round 2 is abandoned with none of its 4, round 3 stays open, then is
abandoned too (5 clients, none reported).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from dashboard_helpers import (
    BACKENDS,
    LiveServer,
    database,
    metric_samples,
    new_federation,
    start_dashboard,
    store_session,
)

from aggregator_service import store
from dashboard_api.settings import DashboardSettings

NOON = datetime(2024, 3, 1, 12, tzinfo=UTC)
NOON_UNIX = 1_709_251_200 + 12 * 3600


def _cohort(round_: int, size: int) -> list[str]:
    return [f"r{round_}-client-{i}" for i in range(size)]


@pytest.fixture(params=BACKENDS)
def rounds(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, LiveServer]]:
    with database(request.param, tmp_path) as url:
        new_federation(url)
        with store_session(url) as (s, fed):
            # round 1: opened at noon, closed at 12:05:30 with 3 of its 53 clients' updates kept
            one = store.open_round(s, fed, 1, _cohort(1, 53), [], False, NOON + timedelta(minutes=5), now=NOON)
            one.state, one.closed_at, one.reported, one.stragglers = "closed", NOON + timedelta(seconds=330), 3, 50
            s.add(store.RoundMetrics(federation_id=fed.id, round=1, duration_seconds=330.0))
            s.flush()
            # round 2: opened 12:06, abandoned at 12:10 with no update (the store counts its 4 stragglers)
            six = NOON + timedelta(minutes=6)
            store.open_round(s, fed, 2, _cohort(2, 4), [], False, six + timedelta(minutes=3), now=six)
            store.abandon_round(s, fed, 2, now=NOON + timedelta(minutes=10))
            # round 3: opened 12:10:15, its deadline 12:11:15.25, still open
            store.open_round(
                s, fed, 3, _cohort(3, 5), [], False, NOON + timedelta(seconds=675.25), now=NOON + timedelta(seconds=615)
            )
        live = start_dashboard(DashboardSettings(database_url=url))
        try:
            yield url, live
        finally:
            live.stop()


def test_round_times_and_the_clients_rounds_lost(rounds: tuple[str, LiveServer]) -> None:
    url, live = rounds
    m = metric_samples(httpx.get(f"{live.base_url}/metrics").text)
    assert m["fedatoms_last_round_closed_timestamp_seconds"] == NOON_UNIX + 330  # round 1, not abandoned round 2
    assert m["fedatoms_open_round_opened_timestamp_seconds"] == NOON_UNIX + 615
    assert m["fedatoms_open_round_deadline_timestamp_seconds"] == NOON_UNIX + 675.25
    assert m["fedatoms_current_round"] == 3 and m["fedatoms_last_closed_round"] == 1
    assert m["fedatoms_round_cohort_clients_total{state=closed}"] == 53
    assert m["fedatoms_round_reported_clients_total{state=closed}"] == 3
    assert m["fedatoms_round_straggler_clients_total{state=closed}"] == 50
    assert m["fedatoms_round_cohort_clients_total{state=abandoned}"] == 4
    assert m["fedatoms_round_reported_clients_total{state=abandoned}"] == 0
    assert m["fedatoms_round_straggler_clients_total{state=abandoned}"] == 4
    # REST shows each round's share of those sums, from the same columns
    for number, expected in ((1, (53, 3, 50)), (2, (4, 0, 4)), (3, (5, 0, 0))):
        r = httpx.get(f"{live.base_url}/api/v1/rounds/{number}").json()
        assert (r["cohort_size"], r["reported"], r["stragglers"]) == expected
        assert r["cohort_size"] == len(r["cohort"])

    # round 3 is abandoned: the current round goes back to 1, the last closed round and the counters do not
    with store_session(url) as (s, fed):
        store.abandon_round(s, fed, 3, now=NOON + timedelta(minutes=12))
    after = metric_samples(httpx.get(f"{live.base_url}/metrics").text)
    assert after["fedatoms_current_round"] == 1  # documented: the open round, else the last closed one
    assert after["fedatoms_last_closed_round"] == 1
    assert after["fedatoms_last_round_closed_timestamp_seconds"] == NOON_UNIX + 330
    assert "fedatoms_open_round_opened_timestamp_seconds" not in after
    assert "fedatoms_open_round_deadline_timestamp_seconds" not in after
    assert after["fedatoms_round_cohort_clients_total{state=abandoned}"] == 4 + 5
    assert after["fedatoms_round_straggler_clients_total{state=abandoned}"] == 4 + 5
    assert after["fedatoms_round_cohort_clients_total{state=closed}"] == 53


def test_before_any_round_closes_the_times_are_absent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    new_federation(url)
    live = start_dashboard(DashboardSettings(database_url=url))
    try:
        m = metric_samples(httpx.get(f"{live.base_url}/metrics").text)
    finally:
        live.stop()
    assert m["fedatoms_federation_found"] == 1 and m["fedatoms_last_closed_round"] == 0
    assert not any("timestamp_seconds" in k for k in m)
    assert m["fedatoms_round_cohort_clients_total{state=closed}"] == 0


_HOLDER = """
import sys, time
from aggregator_service import store
with store.exclusive_federation(sys.argv[1], "default"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aggregator_that_dies_shows_as_not_serving(backend: str, tmp_path: Path) -> None:
    """The rounds' rows look the same whether an aggregator waits between rounds or was killed: only the
    federation's lock, which the kernel or PostgreSQL drops with its holder, tells them apart."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    with database(backend, tmp_path) as url:
        new_federation(url)
        live = start_dashboard(DashboardSettings(database_url=url))
        holder = None
        try:

            def serving() -> float:
                return metric_samples(httpx.get(f"{live.base_url}/metrics").text)["fedatoms_aggregator_serving"]

            assert serving() == 0
            holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url], env=env, stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert serving() == 1
            holder.kill()  # SIGKILL: no goodbye to the database
            holder.wait(10)
            deadline = time.monotonic() + 30
            while serving() != 0:
                assert time.monotonic() < deadline, "a killed aggregator still shows as serving"
                time.sleep(0.2)
        finally:
            if holder is not None and holder.poll() is None:
                holder.kill()
                holder.wait(10)
            live.stop()
