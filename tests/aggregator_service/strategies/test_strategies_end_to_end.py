"""The new strategies through whole federations: identities, the gRPC record, state that outlives the processes.

Every registered strategy runs once in process and once through a real aggregator (gRPC on a
loopback port, a SQLite file) with real client agents: 5 clients, 2 rounds, so that round 2
starts from the state round 1 left (FedDC's drift and control on the clients and the server,
SCAFFOLD's control variates, FedDyn's gradient correction, the server optimizers' moments,
FedAvgM's momentum; FedTrimmedAvg cuts one client from each end). The records must agree, and
what the database and the clients' state files hold must be what the in-process engine and
clients ended with — the state a restarted aggregator or agent resumes from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from aggregator_service import store
from aggregator_service.config import FederationConfig
from aggregator_service.coordinator.restore import _restore
from aggregator_service.strategies import STRATEGIES
from client_agent.state import ClientState
from fedatoms import simulate
from fedatoms.simulate import SimulationConfig, run_simulation

SMALL = dict(dataset="digits", clients=5, fraction=1.0, rounds=3, local_epochs=1, batch_size=32, seed=5)


def engine_after(config: SimulationConfig) -> tuple[dict[str, Any], Any]:
    engines: list[Any] = []
    original = simulate.build_federation
    simulate.build_federation = lambda cfg: engines.append(original(cfg)) or engines[-1]  # keep the engine
    try:
        record = run_simulation(config)
    finally:
        simulate.build_federation = original
    return record, engines[0]


def test_feddyn_without_alpha_reproduces_fedavg_bit_for_bit() -> None:
    _, fedavg = engine_after(SimulationConfig(**SMALL))
    _, dyn = engine_after(SimulationConfig(**SMALL, strategy="feddyn", strategy_args={"alpha": 0.0}))
    assert all(torch.equal(fedavg.global_tensors[n], dyn.global_tensors[n]) for n in fedavg.global_tensors)


def test_fedavgm_without_momentum_and_trimming_nothing_reproduce_fedavg() -> None:
    two = {**SMALL, "rounds": 2}
    _, fedavg = engine_after(SimulationConfig(**two))
    for strategy, args in (("fedavgm", {"server_momentum": 0.0}), ("fedtrimmedavg", {"beta": 0.0})):
        _, other = engine_after(SimulationConfig(**two, strategy=strategy, strategy_args=args))
        for n, t in fedavg.global_tensors.items():
            torch.testing.assert_close(other.global_tensors[n], t, rtol=1e-5, atol=1e-6, msg=f"{strategy} {n}")


def _same(a: Any, b: Any, path: str) -> None:
    """Equal, floats to 1e-12 relative (numpy's pairwise sums may round differently with memory alignment)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (path, a, b)
    else:
        assert a == b, (path, a, b)


#: The cheapest run that still carries state from one round into the next.
OVER_GRPC = dict(SMALL, rounds=2)
#: strategy → (its switches: the federation's own keys or ``strategy_args``, the per-client state groups an agent keeps)
EVERY_STRATEGY: dict[str, tuple[dict[str, Any], set[str]]] = {
    "fedavg": ({}, set()),
    "fedprox": ({"mu": 0.01}, set()),
    "scaffold": ({"global_lr": 1.0}, {"control"}),
    "fedavgm": ({"strategy_args": {"server_momentum": 0.9}}, set()),
    "fedadam": ({"strategy_args": {"eta": 0.01}}, set()),
    "fedyogi": ({"strategy_args": {"eta": 0.01}}, set()),
    "fedadagrad": ({"strategy_args": {"eta": 0.01}}, set()),
    "fedmedian": ({}, set()),
    "fedtrimmedavg": ({"strategy_args": {"beta": 0.2}}, set()),
    "feddyn": ({"strategy_args": {"alpha": 0.01}}, {"gradient"}),
    "feddc": ({"strategy_args": {"alpha": 0.01}}, {"drift", "control"}),
}


def test_every_registered_strategy_runs_over_grpc() -> None:
    assert set(EVERY_STRATEGY) == set(STRATEGIES)


@pytest.mark.parametrize("strategy", list(EVERY_STRATEGY))
def test_grpc_record_and_stored_state_equal_the_in_process_run(tmp_path: Path, strategy: str) -> None:
    switches, client_groups = EVERY_STRATEGY[strategy]
    config = dict(OVER_GRPC, strategy=strategy, **switches)
    inprocess, engine = engine_after(SimulationConfig(**config))
    url = f"sqlite:///{tmp_path / 'aggregator.db'}"
    clients = tmp_path / "clients"
    over_grpc = run_simulation(
        SimulationConfig(transport="grpc", **config), database_url=url, state_dir=str(clients), workers=2
    )
    for a, b in zip(inprocess["rounds"], over_grpc["rounds"], strict=True):
        for key in ("test_accuracy", "test_loss", "bytes_up", "bytes_down", "fedavg_equivalent_bytes", "dispersion"):
            _same(a[key], b[key], f"round {a['round']} {key}")

    # the aggregator a restart would build: the stored strategy state is the in-process engine's, bit for bit
    restarted = FederationConfig(**{k: v for k, v in config.items() if k in FederationConfig.__dataclass_fields__})
    fed = restarted.build_federation(num_clients_total=config["clients"])
    db = store.create_engine_for(url)
    try:
        with store.session_factory(db).begin() as s:
            _restore(s, store.get_federation(s, "default"), fed)
    finally:
        db.dispose()
    kept, loaded = engine.strategy.state_dict(), fed.strategy.state_dict()
    groups = set(type(engine.strategy).state_tensors)
    assert set(kept) == set(loaded) and groups <= set(kept)
    for key in set(kept) - groups:  # kept as JSON (e.g. the N a mean is over)
        assert kept[key] == loaded[key], key
    for group in groups:
        assert kept[group].keys() == loaded[group].keys() and kept[group], group
        assert all(torch.equal(kept[group][n], loaded[group][n]) for n in kept[group]), group
    assert all(torch.equal(engine.global_tensors[n], fed.global_tensors[n]) for n in fed.global_tensors)

    # each agent's state file holds its per-client state, as an agent restarted from it would resume
    states = [ClientState.load(d) for d in sorted(clients.iterdir()) if (d / "state.safetensors").exists()]
    assert len(states) == config["clients"]
    for state in states:
        assert state is not None
        assert set(state.strategy_state) == client_groups
        for group in state.strategy_state.values():
            assert all(bool(torch.isfinite(t).all()) for t in group.values())
