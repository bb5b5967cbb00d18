"""The REST API and /metrics against a database a real federation filled, on SQLite and PostgreSQL.

Expected values come from the store's own functions over the same database, so these tests
check that the dashboard's SQL (paging, window sums, weighted means) says what the store says.
"""

from __future__ import annotations

import math
from datetime import datetime

import httpx
import pytest
from dashboard_helpers import ROUNDS_CLOSED, Federation, metric_samples, start_dashboard
from sqlalchemy import func, select

from aggregator_service import store
from dashboard_api.settings import DashboardSettings


def test_federation_summary(api: httpx.Client, federation: Federation) -> None:
    body = api.get("/federation").json()
    assert body["name"] == "default" and body["state"] == "running"
    assert (body["current_round"], body["open_round"], body["last_closed_round"]) == (4, 4, ROUNDS_CLOSED)
    assert body["rounds_planned"] == ROUNDS_CLOSED + 1
    assert (body["clients_registered"], body["clients_online"], body["clients_revoked"]) == (4, 4, 0)
    assert body["config"]["model"] == "digits-cnn" and body["config"]["interval_policy"] == "fedlama"


def test_rounds_say_what_the_store_says(api: httpx.Client, federation: Federation) -> None:
    federation.coordinator.flush()  # downloads are recorded in batches: the ledger settled before it is read
    page = api.get("/rounds").json()
    assert (page["total"], page["offset"], page["limit"]) == (4, 0, 100)
    items = {r["number"]: r for r in page["items"]}
    assert [r["number"] for r in page["items"]] == [1, 2, 3, 4]
    bandwidth = {r["round"]: r for r in api.get("/bandwidth").json()["rounds"]["items"]}
    with federation.session() as (s, fed):
        for rnd, metrics in store.list_rounds(s, fed):
            got = items[rnd.number]
            assert (got["state"], got["cohort_size"], got["reported"]) == (rnd.state, len(rnd.cohort), rnd.reported)
            # a round's bytes are its transfers, evaluation fetches after its close included: what /bandwidth says
            t = store.Transfer
            for key, moved in (("bytes_down", t.direction == "down"), ("bytes_up", t.direction == "up")):
                rows = select(func.sum(t.bytes)).where(t.federation_id == fed.id, t.round == rnd.number, moved)
                assert got[key] == (s.scalar(rows) or 0) == bandwidth.get(rnd.number, {}).get(key, 0), key
            fedavg = select(func.sum(t.fedavg_equivalent_bytes)).where(t.federation_id == fed.id, t.round == rnd.number)
            assert got["fedavg_equivalent_bytes"] == (s.scalar(fedavg) or 0)
            if metrics is None:
                assert rnd.number == 4 and got["test_accuracy"] is None
                continue
            for key in ("test_accuracy", "test_loss", "dispersion", "latent_clients"):
                assert got[key] == pytest.approx(getattr(metrics, key)), key
            # the federation serves tiers 1 and 1/4: the server evaluated the global model cut to 1/4
            assert got["tier_accuracy"] == pytest.approx(metrics.extra["tier_accuracy"])
            assert set(got["tier_accuracy"]) == {"0.25"} and 0 <= got["tier_accuracy"]["0.25"] <= 1
            summary = store.evaluation_summary(s, fed, rnd.number)
            assert got["evaluations"] == summary["clients"] == len(federation.evaluated[rnd.number])
            assert got["mean_client_accuracy"] == pytest.approx(summary["mean_client_accuracy"])
            assert got["personalized_accuracy"] == pytest.approx(summary["personalized_accuracy"])
    closed = [r for r in page["items"] if r["state"] == "closed"]
    assert all(0 <= r["test_accuracy"] <= 1 and r["personalized_accuracy"] is not None for r in closed)
    assert all(r["duration_seconds"] > 0 and r["dispersion"] > 0 for r in closed)
    assert items[4]["state"] == "open" and items[4]["closed_at"] is None


@pytest.mark.parametrize(
    ("query", "numbers", "total"),
    [
        ("offset=1&limit=2", [2, 3], 4),
        ("order=desc&limit=2", [4, 3], 4),
        ("state=open", [4], 1),
        ("state=closed&order=desc", [3, 2, 1], 3),
        ("after=2", [3, 4], 2),
        ("offset=10", [], 4),
        ("state=abandoned", [], 0),
    ],
)
def test_rounds_paging_and_filters(
    api: httpx.Client, federation: Federation, query: str, numbers: list[int], total: int
) -> None:
    federation.coordinator.flush()
    page = api.get(f"/rounds?{query}").json()
    assert [r["number"] for r in page["items"]] == numbers and page["total"] == total
    # a page carries each round as the whole list does: its own bytes and evaluations, not a neighbour's
    whole = {r["number"]: r for r in api.get("/rounds").json()["items"]}
    assert page["items"] == [whole[n] for n in numbers]
    assert all(whole[n]["bytes_down"] > 0 for n in numbers if whole[n]["state"] == "closed")


def test_round_detail_and_its_tensors(api: httpx.Client, federation: Federation) -> None:
    detail = api.get("/rounds/2").json()
    assert set(detail["cohort"]) == {c.client_id for c in federation.clients}
    assert detail["due"] and detail["client_metrics"]["train_accuracy"] >= 0
    assert set(detail["effective_dispersion"]) == {"conv1", "conv2"}  # the atom layers
    tensors = api.get("/rounds/2/tensors").json()
    with federation.session() as (s, fed):
        expected = store.round_tensor_metrics(s, fed, 2)
    assert [t["name"] for t in tensors] == [t.name for t in expected]
    assert [t["ordinal"] for t in tensors] == sorted(t["ordinal"] for t in tensors)
    for got, row in zip(tensors, expected, strict=True):
        assert (got["role"], got["interval"], got["version"]) == (row.role, row.interval, row.version)
        assert got["d_l"] == pytest.approx(row.d_l) and got["dispersion"] == pytest.approx(row.dispersion)
    assert {t["role"] for t in tensors} >= {"atoms", "coefficients"}
    open_round = api.get("/rounds/4/tensors").json()  # open: bytes so far, nothing aggregated yet
    assert all(t["d_l"] is None and t["dispersion"] is None for t in open_round)


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/rounds/99", "round 99 does not exist"),
        ("/rounds/99/tensors", "round 99 does not exist"),
        ("/clients/0123456789abcdef0123456789abcdef", "no client '0123456789abcdef0123456789abcdef'"),
    ],
)
def test_unknown_items_are_404_with_a_reason(api: httpx.Client, path: str, needle: str) -> None:
    r = api.get(path)
    assert r.status_code == 404 and needle in r.json()["detail"]


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/rounds?offset=-1", "offset"),
        ("/rounds?limit=0", "limit"),
        ("/rounds?limit=1001", "limit"),
        ("/rounds?limit=ten", "limit"),
        ("/rounds?state=sleeping", "state"),
        ("/rounds?order=sideways", "order"),
        ("/rounds?after=-3", "after"),
        ("/rounds/0", "number"),
        ("/rounds/first", "number"),
        ("/rounds/0/tensors", "number"),
        ("/clients?status=away", "status"),
        ("/clients?tier=2", "tier"),
        ("/clients?offset=x", "offset"),
        ("/bandwidth?limit=0", "limit"),
        ("/intervals?limit=5000", "limit"),
        # a NUL byte reached PostgreSQL as a DataError, answered 503 "database unavailable" (issue 18)
        ("/clients/%00", "client_id"),
        ("/clients/a%0Ab", "client_id"),
        ("/intervals?tensor=%00", "tensor"),
        ("/intervals?tensor=conv1.weight%00", "tensor"),
    ],
)
def test_bad_parameters_are_422_naming_the_parameter(api: httpx.Client, path: str, param: str) -> None:
    r = api.get(path)
    assert r.status_code == 422, r.text
    assert any(err["loc"][-1] == param for err in r.json()["detail"]), r.json()


@pytest.mark.parametrize(
    ("path", "param", "said"),
    [
        # a parameter of another endpoint: /intervals has no offset, so paging with it gave the same page forever
        ("/intervals?offset=5", "offset", "unknown query parameter: /api/v1/intervals takes after, limit, tensor"),
        ("/rounds?limt=5", "limt", "unknown query parameter"),
        ("/bandwidth?state=closed", "state", "unknown query parameter"),
        ("/federation?verbose=1", "verbose", "/api/v1/federation takes none"),
        ("/rounds?limit=1&limit=2", "limit", "given more than once"),  # the last one won
    ],
)
def test_a_parameter_the_endpoint_does_not_take_or_given_twice_is_422(
    api: httpx.Client, path: str, param: str, said: str
) -> None:
    r = api.get(path)
    assert r.status_code == 422, r.text
    assert any(e["loc"] == ["query", param] and said in e["msg"] for e in r.json()["detail"]), r.text


def test_a_huge_bad_value_is_not_quoted_back_whole(api: httpx.Client) -> None:
    r = api.get("/rounds", params={"limit": "A" * 20_000})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "limit"]
    assert len(r.content) < 2_000  # the whole value came back


def test_probes_answer_head(dashboard) -> None:
    """``curl -I``, load balancers and uptime checks probe with HEAD: 405 before."""
    for path in ("/healthz", "/readyz", "/metrics", "/"):
        r = httpx.head(f"{dashboard.base_url}{path}")
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.get(f"{dashboard.base_url}/metrics?junk=1").status_code == 422


def test_clients_and_filters(api: httpx.Client, federation: Federation) -> None:
    page = api.get("/clients").json()
    assert page["total"] == 4
    assert [c["name"] for c in page["items"]] == ["dev-0", "dev-1", "dev-2", "spare"]  # registration order
    with federation.session() as (s, fed):
        rows = {c.id: c for c in store.list_clients(s, fed)}
    for c in page["items"]:
        row = rows[c["id"]]
        assert (c["tier"], c["rounds_joined"], c["bytes_up"], c["bytes_down"]) == (
            row.tier,
            row.rounds_joined,
            row.bytes_up,
            row.bytes_down,
        )
        assert c["last_accuracy"] == row.last_accuracy and c["online"] and not c["revoked"]
    trained = [c for c in page["items"] if c["name"] != "spare"]
    assert all(c["rounds_joined"] == ROUNDS_CLOSED and c["bytes_up"] > 0 for c in trained)
    assert [c["name"] for c in api.get("/clients?tier=0.25").json()["items"]] == ["dev-1"]
    assert api.get("/clients?status=online").json()["total"] == 4
    assert api.get("/clients?status=offline").json()["total"] == 0
    assert api.get("/clients?offset=3&limit=1").json()["items"][0]["name"] == "spare"


def test_client_detail(api: httpx.Client, federation: Federation) -> None:
    c = federation.clients[2]  # skipped the evaluation of round 2
    detail = api.get(f"/clients/{c.client_id}").json()
    assert detail["name"] == "dev-2" and detail["profile"]["device_name"] == "test"
    assert sum(t["bytes_up"] for t in detail["transfers"]) == detail["bytes_up"]
    assert sum(t["bytes_down"] for t in detail["transfers"]) == detail["bytes_down"]
    assert [e["round"] for e in detail["evaluations"]] == [3, 1]  # newest first
    assert all(0 <= e["global_accuracy"] <= 1 and e["personalized_accuracy"] is not None for e in detail["evaluations"])


def test_bandwidth_cumulative_and_saving(api: httpx.Client, federation: Federation) -> None:
    """Every figure sums the transfers table (the one ledger), the open round's bytes so far included."""
    body = api.get("/bandwidth").json()
    rows, totals = body["rounds"]["items"], body["totals"]
    with federation.session() as (s, fed):
        transfers = list(s.scalars(select(store.Transfer).where(store.Transfer.federation_id == fed.id)))
        closed = sum(1 for _, m in store.list_rounds(s, fed) if m is not None)
    rounds = sorted({t.round for t in transfers})
    assert [r["round"] for r in rows] == rounds and body["rounds"]["total"] == len(rounds)
    down = up = fedavg = 0
    for r, n in zip(rows, rounds, strict=True):
        mine = [t for t in transfers if t.round == n]
        d = sum(t.bytes for t in mine if t.direction == "down")
        u = sum(t.bytes for t in mine if t.direction == "up")
        f = sum(t.fedavg_equivalent_bytes for t in mine)
        down, up, fedavg = down + d, up + u, fedavg + f
        assert (r["bytes_down"], r["bytes_up"], r["fedavg_equivalent_bytes"]) == (d, u, f)
        assert r["bytes_train_fetch"] + r["bytes_eval_fetch"] == d and r["bytes_push"] == u
        assert (r["cumulative_bytes_down"], r["cumulative_bytes_up"], r["cumulative_fedavg_equivalent_bytes"]) == (
            down,
            up,
            fedavg,
        )
    assert (totals["rounds"], totals["bytes_down"], totals["bytes_up"], totals["fedavg_equivalent_bytes"]) == (
        closed,
        down,
        up,
        fedavg,
    )
    assert totals["saving_ratio"] == pytest.approx(fedavg / (down + up)) and totals["saving_ratio"] > 1
    assert totals["saved_fraction"] == pytest.approx(1 - (down + up) / fedavg)
    later = api.get("/bandwidth?after=1&limit=1").json()["rounds"]  # running totals still start at round 1
    assert later["total"] == len(rounds) - 1 and later["items"] == [rows[1]]


def test_intervals_now_and_history(api: httpx.Client, federation: Federation) -> None:
    body = api.get("/intervals").json()
    assert body["rounds"] == [1, 2, 3]
    with federation.session() as (s, fed):
        current = store.tensor_intervals(s, fed)
        versions = store.tensor_versions(s, fed)
        history = {name: store.tensor_metric_history(s, fed, name)[:ROUNDS_CLOSED] for name in current}
    assert {t["name"] for t in body["tensors"]} == set(current)
    for t in body["tensors"]:
        assert (t["interval"], t["version"]) == (current[t["name"]], versions[t["name"]])
        assert [(p["round"], p["interval"]) for p in t["history"]] == [
            (m.round, m.interval) for m in history[t["name"]]
        ]
    assert [t["ordinal"] for t in body["tensors"]] == sorted(t["ordinal"] for t in body["tensors"])
    assert any(p["interval"] > 1 for t in body["tensors"] for p in t["history"])  # FedLAMA lengthened some
    one = api.get("/intervals?after=1&limit=1&tensor=conv1.atoms").json()
    assert one["rounds"] == [2] and [t["name"] for t in one["tensors"]] == ["conv1.atoms"]
    assert [p["round"] for p in one["tensors"][0]["history"]] == [2]


def test_prometheus_metrics(dashboard, federation: Federation) -> None:
    r = httpx.get(f"{dashboard.base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metric_samples(r.text)
    assert m["fedatoms_database_up"] == 1 and m["fedatoms_current_round"] == 4
    assert m["fedatoms_federation_found"] == 1
    assert m["fedatoms_clients_online"] == 4 and m["fedatoms_clients_registered"] == 4
    assert m["fedatoms_federation_state{state=running}"] == 1 and m["fedatoms_rounds{state=closed}"] == 3
    assert m["fedatoms_round_duration_seconds_count"] == ROUNDS_CLOSED
    with federation.session() as (s, fed):
        clients = store.list_clients(s, fed)
        last = store.list_rounds(s, fed, newest_first=True, limit=2)[1][1]
        assert last is not None
        durations = [m.duration_seconds for _, m in store.list_rounds(s, fed) if m is not None]
        tensors = store.round_tensor_metrics(s, fed, ROUNDS_CLOSED)
    assert m["fedatoms_round_duration_seconds_sum"] == pytest.approx(sum(durations))
    assert m["fedatoms_round_duration_seconds_bucket{le=+Inf}"] == ROUNDS_CLOSED
    assert m["fedatoms_bytes_up_total"] == sum(c.bytes_up for c in clients)
    assert m["fedatoms_bytes_down_total"] == sum(c.bytes_down for c in clients)
    assert m["fedatoms_global_test_accuracy"] == pytest.approx(last.test_accuracy)
    # the cut to tier 1/4 (a client of that tier runs it), as the aggregator wrote it with the round
    assert set(last.extra["tier_accuracy"]) == {"0.25"}
    assert m["fedatoms_tier_test_accuracy{tier=0.25}"] == pytest.approx(last.extra["tier_accuracy"]["0.25"])
    assert m["fedatoms_dispersion"] == pytest.approx(last.dispersion)
    assert 0 <= m["fedatoms_mean_client_accuracy"] <= 1 and 0 <= m["fedatoms_personalized_accuracy"] <= 1
    for t in tensors:
        labels = f"role={t.role},tensor={t.name}"
        assert m[f"fedatoms_tensor_interval{{{labels}}}"] == t.interval
        if t.dispersion is None:  # not due in the last round (its interval is longer): no sample
            assert f"fedatoms_tensor_dispersion{{{labels}}}" not in m
        else:
            assert math.isclose(m[f"fedatoms_tensor_dispersion{{{labels}}}"], t.dispersion, rel_tol=1e-9)
    assert any(t.dispersion is None for t in tensors) and any(t.dispersion is not None for t in tensors)


def test_intervals_before_any_round_closed_are_in_name_order_with_no_placement(tmp_path) -> None:
    """No round has recorded the tensors' order yet: ordinal and role are null (an internal 1,000,000 and a null
    role were shown), and the tensors come in name order."""
    from support import serve_aggregator

    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    _, server, _ = serve_aggregator(url)  # creates the federation; no client, no round
    live = start_dashboard(DashboardSettings(database_url=url))
    try:
        body = httpx.get(f"{live.base_url}/api/v1/intervals").json()
    finally:
        live.stop()
        server.stop(grace=None)
    names = [t["name"] for t in body["tensors"]]
    assert body["rounds"] == [] and names and names == sorted(names)
    assert all(t["ordinal"] is None and t["role"] is None and t["history"] == [] for t in body["tensors"])


def test_a_wrong_federation_name_shows_in_metrics(federation: Federation) -> None:
    """REST answers 404 for a federation the database does not hold; /metrics showed only ``database_up 1``, so an
    alert on it could not see a mistyped federation_name."""
    live = start_dashboard(DashboardSettings(database_url=federation.url, federation_name="nosuch"))
    try:
        m = metric_samples(httpx.get(f"{live.base_url}/metrics").text)
        assert httpx.get(f"{live.base_url}/api/v1/federation").status_code == 404
    finally:
        live.stop()
    assert m["fedatoms_database_up"] == 1 and m["fedatoms_federation_found"] == 0
    assert "fedatoms_current_round" not in m


def test_health_and_readiness(dashboard) -> None:
    assert httpx.get(f"{dashboard.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{dashboard.base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_no_response_carries_a_secret(api: httpx.Client, dashboard, federation: Federation) -> None:
    secrets = federation.secrets()
    assert len(secrets) == 3 + 2 * len(federation.everyone)
    paths = [
        "/federation",
        "/rounds",
        "/clients",
        "/bandwidth",
        "/intervals",
        *(f"/rounds/{n}" for n in range(1, 5)),
        *(f"/rounds/{n}/tensors" for n in range(1, 5)),
        *(f"/clients/{c.client_id}" for c in federation.everyone),
    ]
    bodies = [api.get(p).text for p in paths]
    bodies += [httpx.get(f"{dashboard.base_url}{p}").text for p in ("/metrics", "/openapi.json", "/", "/readyz")]
    for body in bodies:
        assert body
        for secret in secrets:
            assert secret not in body


def test_round_times_and_participation_in_metrics_say_what_rest_says(api: httpx.Client, dashboard) -> None:
    """The aggregator's own rounds: the timestamps are the rows' ``closed_at``, ``opened_at`` and ``deadline`` that
    REST shows; every one of the three clients reported in each of the three closed rounds (9 of 9, none late)."""
    m = metric_samples(httpx.get(f"{dashboard.base_url}/metrics").text)
    rounds = {r["number"]: r for r in api.get("/rounds").json()["items"]}

    def unix(value: str) -> float:
        return datetime.fromisoformat(value).timestamp()

    assert m["fedatoms_last_closed_round"] == ROUNDS_CLOSED
    assert m["fedatoms_last_round_closed_timestamp_seconds"] == unix(rounds[ROUNDS_CLOSED]["closed_at"])
    assert m["fedatoms_open_round_opened_timestamp_seconds"] == unix(rounds[ROUNDS_CLOSED + 1]["opened_at"])
    assert m["fedatoms_open_round_deadline_timestamp_seconds"] == unix(rounds[ROUNDS_CLOSED + 1]["deadline"])
    assert (
        m["fedatoms_open_round_opened_timestamp_seconds"]
        > m["fedatoms_last_round_closed_timestamp_seconds"]
        > unix(rounds[1]["opened_at"])
    )
    closed = [rounds[n] for n in range(1, ROUNDS_CLOSED + 1)]
    assert [(r["cohort_size"], r["reported"], r["stragglers"]) for r in closed] == [(3, 3, 0)] * ROUNDS_CLOSED
    assert m["fedatoms_round_cohort_clients_total{state=closed}"] == 9
    assert m["fedatoms_round_reported_clients_total{state=closed}"] == 9
    assert m["fedatoms_round_straggler_clients_total{state=closed}"] == 0
    assert m["fedatoms_round_cohort_clients_total{state=abandoned}"] == 0
