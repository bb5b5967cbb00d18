"""One ledger: every surface reports the same bytes, and plain FedAvg reads exactly 1.000×.

Real runs: the in-process engine, and a real aggregator (gRPC on a loopback port, a SQLite file)
with real client agents in worker processes; the dashboard is the real FastAPI app over the
aggregator's database, served by uvicorn. The FedAvg baseline is checked against a hand count (transfers × the
plain model's ``state_dict`` payload), never against the code's own function.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboard_api"))
from dashboard_helpers import start_dashboard

from aggregator_service import store
from dashboard_api.settings import DashboardSettings
from fedatoms.cli.simulate import print_summary
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.models import build_model

CATEGORIES = ("train_fetch", "eval_fetch", "push")
PLAIN: dict[str, Any] = dict(dataset="digits", clients=10, fraction=1.0, rounds=3, seed=0)


def _plain_model_bytes() -> int:
    """One plain (unfactorized) digits model's payload: Σ numel × element size over its state_dict."""
    return sum(t.numel() * t.element_size() for t in build_model("digits-cnn", 10).state_dict().values())


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("plain")
    return {
        "inprocess": run_simulation(SimulationConfig(**PLAIN)),
        "grpc": run_simulation(
            SimulationConfig(transport="grpc", **PLAIN),
            database_url=f"sqlite:///{tmp / 'plain.db'}",
            state_dir=str(tmp / "clients"),
            workers=2,
        ),
    }


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
def test_plain_fedavg_reads_exactly_one(plain_runs, transport: str) -> None:
    summary = plain_runs[transport]["summary"]
    model = _plain_model_bytes()
    assert model == 151_306 * 4  # digits-cnn: fp32 weights and biases only
    # full participation, every tensor changes at every close: each client fetches the initial model once to
    # train round 1, then per round pushes its update and fetches the closed round's model to evaluate it (the
    # next round trains on that model, so its training fetch moves nothing and is no transfer)
    clients, rounds = PLAIN["clients"], PLAIN["rounds"]
    transfers = {"train_fetch": clients, "eval_fetch": clients * rounds, "push": clients * rounds}
    for category, n in transfers.items():
        assert summary[f"bytes_{category}"] == n * model, category
    assert summary["bytes_total"] == sum(transfers.values()) * model == 70 * 605_224 == 42_365_680
    assert summary["fedavg_equivalent_bytes"] == summary["bytes_total"]
    assert summary["bytes_ratio_vs_fedavg"] == 1.0
    for record in plain_runs[transport]["rounds"]:
        assert record["fedavg_equivalent_bytes"] == record["bytes_up"] + record["bytes_down"], record["round"]


def test_plain_fedavg_bytes_are_identical_in_both_transports(plain_runs) -> None:
    keys = ("bytes_total", "bytes_up", "bytes_down", "fedavg_equivalent_bytes", *(f"bytes_{c}" for c in CATEGORIES))
    a, b = plain_runs["inprocess"], plain_runs["grpc"]
    assert {k: a["summary"][k] for k in keys} == {k: b["summary"][k] for k in keys}
    per_round = [k for k in keys if k != "bytes_total"]
    assert [{k: r[k] for k in per_round} for r in a["rounds"]] == [{k: r[k] for k in per_round} for r in b["rounds"]]


# --------------------------------------------------------------------------- every surface, one federation

ATOMS: dict[str, Any] = dict(
    dataset="digits",
    factorization="atoms-lowrank",
    clients=6,
    fraction=1.0,
    min_clients=2,
    rounds=3,
    tiers=[1.0, 0.5],
    interval_policy="fedlama",
    tau=1,
    phi=2,
    local_epochs=1,
    lr=0.05,
    batch_size=32,
    seed=5,
)


def test_every_surface_reports_the_same_bytes(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    results = run_simulation(
        SimulationConfig(transport="grpc", **ATOMS), database_url=url, state_dir=str(tmp_path / "clients"), workers=2
    )
    summary = results["summary"]
    expected = {
        "bytes_down": summary["bytes_down"],
        "bytes_up": summary["bytes_up"],
        **{f"bytes_{c}": summary[f"bytes_{c}"] for c in CATEGORIES},
        "fedavg_equivalent_bytes": summary["fedavg_equivalent_bytes"],
    }
    moved = summary["bytes_total"]
    assert moved == expected["bytes_down"] + expected["bytes_up"]
    assert expected["bytes_train_fetch"] + expected["bytes_eval_fetch"] == expected["bytes_down"]
    assert expected["bytes_push"] == expected["bytes_up"]
    assert all(expected[f"bytes_{c}"] > 0 for c in CATEGORIES)
    assert 0 < moved < expected["fedavg_equivalent_bytes"]  # atoms and tiers save bytes
    assert summary["bytes_ratio_vs_fedavg"] == moved / expected["fedavg_equivalent_bytes"]
    assert sum(r["bytes_up"] + r["bytes_down"] for r in results["rounds"]) == moved

    # the database: the transfers table, summed with SQL
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s:
            t = store.Transfer
            by_category = dict(s.execute(select(t.category, func.sum(t.bytes)).group_by(t.category)).all())
            by_direction = dict(s.execute(select(t.direction, func.sum(t.bytes)).group_by(t.direction)).all())
            fedavg = s.scalar(select(func.sum(t.fedavg_equivalent_bytes)))
            per_round = s.execute(
                select(t.round, func.sum(t.bytes), func.sum(t.fedavg_equivalent_bytes)).group_by(t.round)
            ).all()
    finally:
        engine.dispose()
    database = {
        "bytes_down": int(by_direction["down"]),
        "bytes_up": int(by_direction["up"]),
        **{f"bytes_{c}": int(by_category[c]) for c in CATEGORIES},
        "fedavg_equivalent_bytes": int(fedavg),
    }
    assert database == expected
    assert {r: (int(b), int(f)) for r, b, f in per_round} == {
        r["round"]: (r["bytes_up"] + r["bytes_down"], r["fedavg_equivalent_bytes"]) for r in results["rounds"]
    }

    # the dashboard: /api/v1/bandwidth's totals (what the header shows) and /metrics
    live = start_dashboard(DashboardSettings(database_url=url))  # the real app, served by uvicorn
    try:
        body = httpx.get(f"{live.base_url}/api/v1/bandwidth").raise_for_status().json()
        scraped = httpx.get(f"{live.base_url}/metrics").raise_for_status().text
    finally:
        live.stop()
    totals = body["totals"]
    assert {k: totals[k] for k in expected} == expected
    assert totals["rounds"] == ATOMS["rounds"]
    assert totals["saving_ratio"] == pytest.approx(expected["fedavg_equivalent_bytes"] / moved, rel=1e-12)
    header = totals["bytes_down"] + totals["bytes_up"]  # app.js: bytes(down + up), saving_ratio× fewer
    assert header == moved
    rows = body["rounds"]["items"]
    assert [(r["round"], r["bytes_down"], r["bytes_up"], r["fedavg_equivalent_bytes"]) for r in rows] == [
        (r["round"], r["bytes_down"], r["bytes_up"], r["fedavg_equivalent_bytes"]) for r in results["rounds"]
    ]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
    }
    assert samples[("fedatoms_bytes_down_total", ())] == expected["bytes_down"]
    assert samples[("fedatoms_bytes_up_total", ())] == expected["bytes_up"]
    assert samples[("fedatoms_fedavg_equivalent_bytes_total", ())] == expected["fedavg_equivalent_bytes"]
    for c in CATEGORIES:
        assert samples[("fedatoms_transfer_bytes_total", (("category", c),))] == expected[f"bytes_{c}"], c

    # the CLI's summary line
    print_summary(results)
    line = next(li for li in capsys.readouterr().out.splitlines() if "bytes moved" in li)
    shown = re.search(
        r"bytes moved\s+([\d.]+) MB vs FedAvg-equivalent ([\d.]+) MB \(moved ÷ FedAvg-equivalent = ([\d.]+)×\)", line
    )
    assert shown is not None, line
    assert shown.groups() == (
        f"{moved / 1e6:.2f}",
        f"{expected['fedavg_equivalent_bytes'] / 1e6:.2f}",
        f"{moved / expected['fedavg_equivalent_bytes']:.3f}",
    )
