"""``history_rounds``: an aggregator that keeps one round of per-client history shows every round as before.

The federation of the other dashboard tests, run with ``history_rounds = 1``: three rounds close,
so rounds 1 and 2 lose their transfers, evaluations and tensor metrics. The oracles are what the
clients reported (their accuracies and sample counts) and the clients' lifetime byte counters,
neither of which the pruning touches.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from dashboard_helpers import BACKENDS, ROUNDS_CLOSED, Federation, LiveServer, database, metric_samples, run_federation
from sqlalchemy import func, select

from aggregator_service import store


@pytest.fixture(scope="module", params=BACKENDS)
def federation(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with database(request.param, tmp_path_factory.mktemp(request.param)) as url:
        yield from run_federation(url, history_rounds=1)


def _weighted(pairs: list[tuple[float, int]]) -> float:
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)


def test_only_the_latest_rounds_keep_their_detail(federation: Federation) -> None:
    federation.coordinator.flush()
    with federation.session() as (s, fed):
        for table in (store.Transfer, store.Evaluation, store.TensorMetric):
            rounds = set(s.scalars(select(table.round).where(table.federation_id == fed.id)))
            # the last closed round, and the open one (its fetches and push so far)
            assert rounds and rounds <= {ROUNDS_CLOSED, ROUNDS_CLOSED + 1}, table.__tablename__
        kept = s.scalar(
            select(func.count()).select_from(store.RoundBytes).where(store.RoundBytes.round < ROUNDS_CLOSED)
        )
        assert kept >= 2 * (ROUNDS_CLOSED - 1)  # every pruned round keeps its fetch and push sums


def test_pruned_rounds_show_what_their_clients_reported(api: httpx.Client, federation: Federation) -> None:
    rounds = {r["number"]: r for r in api.get("/rounds").json()["items"]}
    assert sorted(rounds) == list(range(1, ROUNDS_CLOSED + 2))
    for number in range(1, ROUNDS_CLOSED + 1):
        sent = federation.reports[number]
        got = rounds[number]
        assert got["evaluations"] == len(sent) == len(federation.evaluated[number])
        assert got["mean_client_accuracy"] == pytest.approx(_weighted([(a, n) for a, _, n in sent]))
        personal = [(p, n) for _, p, n in sent if p is not None]
        assert personal and got["personalized_accuracy"] == pytest.approx(_weighted(personal))
        assert got["bytes_down"] > 0 and got["bytes_up"] > 0


def test_totals_still_count_every_byte(api: httpx.Client, federation: Federation) -> None:
    federation.coordinator.flush()
    body = api.get("/bandwidth").json()
    per_round = body["rounds"]["items"]
    with federation.session() as (s, fed):
        clients = store.list_clients(s, fed)
        lifetime = (sum(c.bytes_down for c in clients), sum(c.bytes_up for c in clients))
    assert (body["totals"]["bytes_down"], body["totals"]["bytes_up"]) == lifetime
    assert (sum(r["bytes_down"] for r in per_round), sum(r["bytes_up"] for r in per_round)) == lifetime
    assert [r["round"] for r in per_round] == list(range(1, ROUNDS_CLOSED + 2))


def test_participation_counters_keep_the_pruned_rounds(api: httpx.Client, dashboard: LiveServer) -> None:
    """The counters sum ``rounds``, which pruning keeps: rounds 1 and 2 lost their per-client rows, not their
    counts. Every one of the three clients reported in each of the three closed rounds: 9 of 9."""
    m = metric_samples(httpx.get(f"{dashboard.base_url}/metrics").text)
    closed = api.get("/rounds?state=closed").json()["items"]
    assert len(closed) == ROUNDS_CLOSED
    for key, metric, expected in (
        ("cohort_size", "cohort", 9),
        ("reported", "reported", 9),
        ("stragglers", "straggler", 0),
    ):
        assert m[f"fedatoms_round_{metric}_clients_total{{state=closed}}"] == expected == sum(r[key] for r in closed)
    assert m["fedatoms_last_closed_round"] == ROUNDS_CLOSED
