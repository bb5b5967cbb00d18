"""An agent whose federation was restored from a backup taken before its last rounds fetches the whole model.

Round numbers never repeat in one federation, so a task for a round below the last one the agent trained
means the federation went back. What the agent holds came from rounds the federation no longer has, and the
restored federation numbers its new versions as the lost ones were: a version number the agent holds may name
other values now (a client outside the cohorts while the federation caught up). The server sends what differs
by version; the agent, which alone can tell, forgets its versions and takes the whole model.
"""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import torch
from support import serve_aggregator

from aggregator_service import store
from aggregator_service.config import FederationConfig
from client_agent.agent import Agent
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient
from fedcore.data import load_dataset
from fedcore.tiers import CapabilityProfile

SECRET = "rewound-enrollment-secret"


def _global_tensors(url: str) -> dict[str, tuple[torch.Tensor, int]]:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.get_federation(s, "default")
            assert fed is not None
            return {n: (torch.from_numpy(a), v) for n, (a, v, _i) in store.load_global_tensors(s, fed).items()}
    finally:
        engine.dispose()


def _serve(url: str):
    return serve_aggregator(
        url,
        enrollment_secret=SECRET,
        quorum=1.0,
        poll_interval_seconds=0.01,
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=1, rounds=6, batch_size=32),
    )


def _agent(port: int, state_dir: Path) -> tuple[Agent, AggregatorClient]:
    train, test = load_dataset("digits")
    channel = AggregatorClient(f"127.0.0.1:{port}")
    agent = Agent(
        channel,
        state_dir,
        train.subset(np.arange(100)),
        test.subset(np.arange(50)),
        profile=CapabilityProfile(num_samples=100),
        enrollment_secret=SECRET,
        eval_poll_seconds=0.0,
    )
    agent.ensure_registered()
    return agent, channel


def _step_until(agent: Agent, done) -> None:
    for _ in range(40):
        if done(agent.state):
            return
        agent.step()
    raise AssertionError(f"the agent never got there: last_round={agent.state.last_round}")


def _trains_the_restored_round(agent: Agent, done, served, caplog, said: str) -> None:
    """Step ``agent`` through the restored federation's round 2 (``done``): it says it was rewound, and it took
    the restored model whole (versions the lost rounds held alike name nothing new)."""
    with caplog.at_level(logging.WARNING, logger="fedatoms.client"):
        _step_until(agent, done)
    assert any(f"event=federation_rewound {said}" in r.getMessage() for r in caplog.records)
    assert agent.state.versions == {n: v for n, (_t, v) in served.items()}
    for name, (tensor, _v) in served.items():
        assert torch.equal(agent.state.global_tensors[name], tensor), name


def _backed_up_after_round_1(tmp_path: Path, last_round: int) -> tuple[Agent, Path, Path]:
    """An agent that trained rounds 1 to ``last_round`` on a live federation, and the backup of that federation
    taken once round 1 had closed: ``(agent, restored database, the agent's state directory)``."""
    live, restored, device = tmp_path / "live.db", tmp_path / "restored.db", tmp_path / "device"
    _, server, port = _serve(f"sqlite:///{live}")
    agent, channel = _agent(port, device)
    try:
        _step_until(agent, lambda s: s.last_round == 1 and s.evaluate_round is None)
        with closing(sqlite3.connect(live)) as src, closing(sqlite3.connect(restored)) as dst:
            src.backup(dst)  # the backup: round 1 closed
        _step_until(agent, lambda s: s.last_round == last_round and s.evaluate_round is None)
    finally:
        channel.close()
        server.stop(grace=None)
    return agent, restored, device


def test_an_agent_ahead_of_its_restored_federation_fetches_the_whole_model(tmp_path: Path, caplog) -> None:
    _, restored, device = _backed_up_after_round_1(tmp_path, last_round=3)
    served = _global_tensors(f"sqlite:///{restored}")
    # the worst case: the versions the agent holds are the numbers the restored federation is at (it held
    # them in the lost rounds), their values those rounds'
    held = ClientState.load(device)
    assert held is not None and any(not torch.equal(held.global_tensors[n], t) for n, (t, _v) in served.items())
    held.versions = {n: v for n, (_t, v) in served.items()}
    held.save(device)

    _, server, port = _serve(f"sqlite:///{restored}")
    agent, channel = _agent(port, device)
    try:
        _trains_the_restored_round(agent, lambda s: s.last_round == 2, served, caplog, "round=2 last_round=3")
    finally:
        channel.close()
        server.stop(grace=None)


def test_an_agent_that_kept_running_across_the_restore_fetches_the_whole_model(tmp_path: Path, caplog) -> None:
    """The backup is taken between rounds 1 and 2; the agent trains round 2 and evaluates its model, then the
    aggregator comes back from the backup and the same agent, still running, is asked for round 2 again. Its
    last round is not above 2, but it holds versions of round 2, which the restored federation has not made:
    it held that model in memory as round 2's start and would have trained from it without asking."""
    agent, restored, _ = _backed_up_after_round_1(tmp_path, last_round=2)
    assert max(agent.state.versions.values()) == 2  # round 2's model, evaluated
    served = _global_tensors(f"sqlite:///{restored}")
    _, server, port = _serve(f"sqlite:///{restored}")
    agent.client = channel = AggregatorClient(f"127.0.0.1:{port}")  # the address now reaches the restored one
    channel.token = agent.credentials.token
    try:
        _trains_the_restored_round(agent, lambda s: s.rounds_joined == 3, served, caplog, "round=2 last_round=2")
    finally:
        channel.close()
        server.stop(grace=None)
