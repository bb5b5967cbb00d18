"""A federation through the real service equals the in-process one, learns, saves bytes and personalizes.

10 clients in 2 tiers, filter atoms with low-rank coefficients, FedLAMA intervals and personal
atoms, 5 rounds on digits, once in process and once through a real aggregator (gRPC server on
a loopback port, SQLite file) with the clients as real agents in 2 worker processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import SECRET, Aggregator, free_port
from safetensors.torch import load_file

from aggregator_service import store
from aggregator_service.config import inert_keys
from client_agent.state import ClientState
from fedatoms import simulate
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.datasource import open_data
from fedcore.keys import client_key
from fedcore.training import evaluate

CONFIG: dict[str, Any] = dict(
    dataset="digits",
    factorization="atoms-lowrank",
    clients=10,
    fraction=1.0,
    min_clients=2,
    rounds=5,
    tiers=[1.0, 0.25],
    interval_policy="fedlama",
    tau=1,
    phi=2,
    warmup_rounds=0,  # relax from round 2 on: five rounds must show stretched intervals
    cohort="period",  # clients continue unsynced tensors from their state: that path over gRPC too
    personal_atoms=True,
    personal_epochs=3,
    local_epochs=1,
    lr=0.05,
    batch_size=32,
    partition="shards",
    classes_per_client=2,
    seed=3,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("federation")
    engines: list[Any] = []
    original = simulate.build_federation
    simulate.build_federation = lambda cfg: engines.append(original(cfg)) or engines[-1]  # keep the engine
    try:
        inprocess = run_simulation(SimulationConfig(**CONFIG))
    finally:
        simulate.build_federation = original
    url = f"sqlite:///{tmp / 'aggregator.db'}"
    over_grpc = run_simulation(
        SimulationConfig(transport="grpc", **CONFIG), database_url=url, state_dir=str(tmp / "clients"), workers=2
    )
    return {
        "inprocess": inprocess,
        "grpc": over_grpc,
        "url": url,
        "state": tmp / "clients",
        "engine": engines[0],
    }


def _same(a: Any, b: Any, path: str) -> None:
    """Equal, floats to 1e-12 relative: numpy's pairwise sums may round differently with memory alignment."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_grpc_transport_gives_the_in_process_record(runs) -> None:
    a, b = runs["inprocess"]["rounds"], runs["grpc"]["rounds"]
    assert [r["round"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b, strict=True):
        ra, rb = dict(ra), dict(rb)
        ra.pop("wall_seconds"), rb.pop("wall_seconds")
        _same(ra, rb, f"round {ra['round']}")
    # accuracies are computed from identical models, so they agree exactly
    assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
    assert [r["personalized_accuracy"] for r in a] == [r["personalized_accuracy"] for r in b]


def test_global_model_in_the_database_equals_the_in_process_run(runs) -> None:
    """Bitwise: same cohort, same seeds, same fold order, same codec."""
    engine = store.create_engine_for(runs["url"])
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.get_federation(s, "default")
            served = {n: a for n, (a, _v, _i) in store.load_global_tensors(s, fed).items()}
            numbers = {c.number for c in store.list_clients(s, fed, limit=100)}
    finally:
        engine.dispose()
    assert numbers == set(range(10))  # registered once each, in index order
    inprocess = runs["engine"].global_tensors
    assert set(served) == set(inprocess)
    for name, tensor in inprocess.items():
        assert torch.equal(torch.from_numpy(served[name]), tensor), name
    # a client of tier 1 holds the final global tensors of its tier: compare those it fetched
    state = ClientState.load(runs["state"] / client_key(0))
    assert state is not None and state.tier == 1.0
    for name, tensor in state.global_tensors.items():
        assert torch.equal(tensor, torch.from_numpy(served[name])), name


def test_accuracy_rises_and_bytes_stay_below_fedavg(runs) -> None:
    rounds = runs["grpc"]["rounds"]
    chance = 1 / 10  # digits' ten balanced classes
    # five rounds of one epoch at lr 0.05 swing from round to round: learning shows in the best of them
    assert max(r["test_accuracy"] for r in rounds) > 2.5 * chance
    summary = runs["grpc"]["summary"]
    assert summary["bytes_total"] < summary["fedavg_equivalent_bytes"]
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rounds)
    # FedLAMA stretched some intervals: some tensors were not due in some round
    assert any(not t["due"] for r in rounds for t in r["tensors"].values())


def test_the_cut_the_server_reports_is_the_model_a_small_device_runs(runs) -> None:
    """The oracle is a tier-1/4 agent's own model: what it fetched after the last close, evaluated here."""
    state = ClientState.load(runs["state"] / client_key(1))
    assert state is not None and state.tier == 0.25
    model = runs["engine"].tier_spec(0.25).build()
    model.load_state_dict(state.global_tensors)
    _, test = open_data("digits", None, download=False)
    on_device = evaluate(model, test, device="cpu").accuracy
    for transport in ("grpc", "inprocess"):
        assert runs[transport]["rounds"][-1]["tier_accuracy"] == {"0.25": on_device}, transport
    summary = runs["grpc"]["summary"]["mean_tier_accuracy_last5"]
    assert summary == {"0.25": pytest.approx(sum(r["tier_accuracy"]["0.25"] for r in runs["grpc"]["rounds"]) / 5)}


def test_personal_atoms_beat_the_global_model_on_local_tests(runs) -> None:
    # one round's local accuracies swing by several points on 2-class shards: compare over the rounds after the first
    gains = [r["personalized_accuracy"] - r["local_accuracy"] for r in runs["grpc"]["rounds"][1:]]
    assert sum(gains) / len(gains) > 0.01, gains
    # and the personal atoms live on the device, not on the server
    state_file = runs["state"] / client_key(3) / "state.safetensors"
    assert any(k.startswith("personal/") for k in load_file(str(state_file)))


def test_a_temporary_state_root_is_never_written_and_changes_nothing(tmp_path, monkeypatch) -> None:
    """Without --state-dir the virtual clients keep no state on disk, the temporary root is removed at the end,
    and the record is still the in-process one.

    Half the clients per round: those left out of a cohort evaluate their deferred model while they wait.
    """
    small = {**CONFIG, "clients": 6, "rounds": 3, "fraction": 0.5}
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the simulation makes its state root
    seen: list[list[str]] = []  # the root's files, each time a round is reported (the run still going)

    def files(_record: dict[str, Any]) -> None:
        (root,) = tmp_path.glob("fedatoms-sim-*")
        seen.append(sorted(p.name for p in root.rglob("*") if p.is_file()))

    said: list[str] = []
    over_grpc = run_simulation(
        SimulationConfig(transport="grpc", **small),
        files,
        database_url=f"sqlite:///{tmp_path / 'a.db'}",
        workers=2,
        announce=said.append,
    )
    assert seen and all(names == ["credentials.json"] * 6 for names in seen), seen  # identities only
    assert list(tmp_path.glob("fedatoms-sim-*")) == []  # removed: nothing left in the temporary directory
    assert any(line.startswith("removed the temporary directory") for line in said), said
    assert f"kept: the database sqlite:///{tmp_path / 'a.db'}" in said  # given by the caller: kept, and said
    inprocess = run_simulation(SimulationConfig(**small))
    for a, b in zip(inprocess["rounds"], over_grpc["rounds"], strict=True):
        a, b = dict(a), dict(b)
        a.pop("wall_seconds"), b.pop("wall_seconds")
        _same(a, b, f"round {a['round']}")


def test_a_run_without_database_url_or_state_dir_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    """The SQLite database and the clients' state it created go with the temporary directory (~80 MB a run before)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    small = {**CONFIG, "clients": 2, "rounds": 1, "personal_atoms": False, "interval_policy": "every_round"}
    small.update(partition="iid")
    for key in inert_keys("every_round", small["tiers"], "per_round"):  # FedLAMA's keys: refused without FedLAMA
        small.pop(key, None)
    said: list[str] = []
    result = run_simulation(SimulationConfig(transport="grpc", **small), workers=1, announce=said.append)
    assert [r["round"] for r in result["rounds"]] == [1]
    assert list(tmp_path.glob("fedatoms-sim-*")) == [] and list(tmp_path.rglob("*.db*")) == []  # torch's caches aside
    assert any("removed the temporary directory" in line and "database" in line for line in said), said
    assert not any(line.startswith("kept") for line in said), said


def test_simulate_drives_a_running_aggregators_federation_of_another_name(tmp_path: Path, capsys) -> None:
    """`--server` with `--federation-name`: the records are read from that federation; before, from
    "default", and the command failed with "no round closed" after every round had closed."""
    from fedatoms.cli import main

    config = tmp_path / "federation.toml"
    config.write_text(
        f'enrollment_secret = "{SECRET}"\nfederation_name = "ops"\ndeadline_seconds = 600\n'
        "poll_interval_seconds = 0.1\n\n[federation]\nrounds = 2\nmin_clients = 2\nfraction = 1.0\n"
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    try:
        argv = ["simulate", "--transport", "grpc", "--server", server.target, "--database-url", url]
        argv += ["--enrollment-secret", SECRET, "--federation-name", "ops", "--clients", "2", "--fraction", "1.0"]
        argv += ["--partition", "iid", "--rounds", "2", "--workers", "1", "--output", str(tmp_path / "r.json")]
        assert main(argv) == 0, capsys.readouterr().err[-3000:]
    finally:
        server.stop()
    records = json.loads((tmp_path / "r.json").read_text())["rounds"]
    assert [r["round"] for r in records] == [1, 2] and all(r["bytes_push"] > 0 for r in records)
