"""Personalization baselines through the real service: the same record as in process, personal state on disk.

FedRep (a personal head that never travels, the server told to keep it local) and FedAvg+FT
(a fine-tuning at evaluation, from the config and seed of the client's last round) each run
once in process and once through a real aggregator (gRPC on a loopback port, SQLite file) with
real agents; and an agent killed mid-federation under FedPer resumes with its own head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from processes import Aggregator, federation_toml, free_port, start_agent, wait_for
from test_grpc_federation import _same

from aggregator_service import store
from client_agent.state import ClientState
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.spec import ModelSpec

pytestmark = pytest.mark.slow

CONFIG: dict[str, Any] = dict(
    dataset="digits",
    clients=5,
    fraction=1.0,
    rounds=2,
    lr=0.05,
    batch_size=32,
    head_epochs=2,
    personal_epochs=2,
    seed=4,
)


@pytest.mark.parametrize("method", ["fedrep", "ft"])
def test_grpc_gives_the_in_process_record(method: str, tmp_path: Path) -> None:
    inprocess = run_simulation(SimulationConfig(personalization=method, **CONFIG))
    over_grpc = run_simulation(
        SimulationConfig(transport="grpc", personalization=method, **CONFIG),
        database_url=f"sqlite:///{tmp_path / 'agg.db'}",
        state_dir=str(tmp_path / "clients"),
        workers=1,
    )
    for a, b in zip(inprocess["rounds"], over_grpc["rounds"], strict=True):
        a, b = dict(a), dict(b)
        a.pop("wall_seconds"), b.pop("wall_seconds")
        _same(a, b, f"round {a['round']}")
        assert a["personalized_accuracy"] is not None
    if method == "fedrep":  # the head never left a device: no byte up, fetched once at round 1
        heads = [r["tensors"]["head.weight"] for r in over_grpc["rounds"]]
        assert all(t["bytes_up"] == 0 for t in heads) and heads[1]["bytes_down"] == 0


def test_an_agent_killed_mid_federation_resumes_with_its_own_head(tmp_path: Path) -> None:
    config = federation_toml(
        tmp_path / "federation.toml",
        model="digits-cnn",
        fraction=1.0,
        min_clients=1,
        rounds=3,
        local_epochs=20,
        batch_size=16,
        lr=0.01,
        personalization="fedper",
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    state_dir, log1, log2 = tmp_path / "device", tmp_path / "agent1.log", tmp_path / "agent2.log"
    try:
        agent = start_agent(server.target, state_dir, 0, log1)
        try:
            wait_for(log1, r"event=evaluated round=1", proc=agent)
            wait_for(log1, r"event=train round=2", proc=agent)
        finally:
            agent.kill()
            agent.wait(10)
        saved = ClientState.load(state_dir)
        assert saved is not None and saved.personal_model is not None
        assert set(saved.personal_model) == {"head.weight", "head.bias"}
        head_after_round1 = {n: t.clone() for n, t in saved.personal_model.items()}

        agent = start_agent(server.target, state_dir, 0, log2)
        assert agent.wait(180) == 0, log2.read_text()[-4000:]
        assert wait_for(log2, r"event=train round=(\d+)").group(1) == "2"
    finally:
        server.stop()
    final = ClientState.load(state_dir)
    assert final is not None and final.rounds_joined == 3 and final.personal_model is not None
    # it trained on from round 1's head (not from the server's), which moved on
    assert any(not torch.equal(final.personal_model[n], head_after_round1[n]) for n in head_after_round1)
    # and the server's head is still round 0's: it was never pushed nor averaged
    init = ModelSpec("digits-cnn", 10).initial_model(0).state_dict()
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            served = store.load_global_tensors(s, store.get_federation(s, "default"))
    finally:
        engine.dispose()
    for name in ("head.weight", "head.bias"):
        array, version, _ = served[name]
        assert version == 0 and torch.equal(torch.from_numpy(array), init[name]), name
    assert not torch.equal(torch.from_numpy(served["fc1.weight"][0]), init["fc1.weight"])
