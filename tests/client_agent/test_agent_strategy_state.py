"""A client keeps its strategy state's step only when the server folded the update that carried it.

SCAFFOLD's server control is the mean of the clients' controls, ``c = (1/N) Σ c_i``, over the updates
the server folded. An update the server takes for a round it then abandons was never folded: the
client must drop the control it trained with it, even when it learns of the abandon only after a
later round has closed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from support import digits_agents, serve_aggregator

from aggregator_service.config import FederationConfig
from client_agent.agent import Agent
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient

SECRET = "test-enrollment-secret"


@contextlib.contextmanager
def two_agents(tmp_path: Path, federation: FederationConfig, **settings: Any) -> Iterator[tuple[Any, dict[str, Agent]]]:
    """A real aggregator over SQLite and two agents of 100 digits each (a and b), registered:
    ``(coordinator, agents)``; everything is closed at the end."""
    coordinator, server, port = serve_aggregator(
        f"sqlite:///{tmp_path / 'agg.db'}",
        enrollment_secret=SECRET,
        poll_interval_seconds=0.01,
        federation=federation,
        **settings,
    )
    links = {name: AggregatorClient(f"127.0.0.1:{port}") for name in ("a", "b")}
    agents = digits_agents(links, tmp_path, SECRET, eval_poll_seconds=0.0, long_poll_seconds=0.0)
    try:
        for agent in agents.values():
            agent.ensure_registered()
        yield coordinator, agents
    finally:
        for agent in agents.values():
            agent.client.close()
        server.stop(grace=None)


def run_to_the_end(agents: dict[str, Agent], deadline: float) -> None:
    """Step every agent until each is told the federation is done."""
    finished: set[str] = set()
    while len(finished) < len(agents) and time.monotonic() < deadline:
        for name, agent in agents.items():
            if name not in finished and agent.step() is None:
                finished.add(name)
    assert finished == set(agents)


def test_the_control_of_an_update_whose_round_was_abandoned_is_dropped(tmp_path: Path) -> None:
    """a pushes for round 1, which is abandoned without b; round 2 closes on a and b. Their saved controls
    then average to the server's, as they would had round 1 never happened."""
    federation = FederationConfig(
        model="digits-cnn", strategy="scaffold", fraction=1.0, min_clients=2, rounds=2, batch_size=32
    )
    with two_agents(tmp_path, federation, quorum=1.0) as (coordinator, agents):
        a = agents["a"]
        deadline = time.monotonic() + 120
        while (a.state is None or a.state.taken is None) and time.monotonic() < deadline:
            a.step()
        assert a.state is not None and a.state.taken is not None and a.state.taken.round == 1  # taken, unsettled
        op = coordinator.shared.open
        coordinator.tick(op.deadline + timedelta(seconds=1))  # no quorum: extended once
        coordinator.tick(op.deadline + timedelta(seconds=1))  # still none: abandoned
        assert coordinator.open_round is None and coordinator.federation.round == 0
        run_to_the_end(agents, deadline)
        assert coordinator.federation.round == 2  # round 2 closed on both
        control = a.client.fetch(a.spec, {}, include_server_control=True).control  # type: ignore[arg-type]
    saved = {name: ClientState.load(tmp_path / name) for name in agents}
    assert all(s is not None and s.taken is None and s.last_round == 2 for s in saved.values())
    c_a = saved["a"].strategy_state["control"]  # type: ignore[union-attr]
    c_b = saved["b"].strategy_state["control"]  # type: ignore[union-attr]
    for name, c in control.items():  # N = 2 enrolled, both folded once (round 2)
        torch.testing.assert_close(c, (c_a[name] + c_b[name]) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("strategy", "group", "key", "fp16"),
    [("feddyn", "gradient", "h", False), ("feddc", "drift", "drift", False), ("feddyn", "gradient", "h", True)],
)
def test_a_clipped_updates_state_step_is_scaled_as_the_server_folds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, group: str, key: str, fp16: bool
) -> None:
    """With ``update_norm_mode = "clip"`` the server folds a long update's move scaled to ``max_update_norm``.
    FedDyn's ``h`` and FedDC's ``H`` are means of the clients' ``∇L_k`` and ``h_i`` only if each client moves
    its state by the move the server folded: after three rounds of clipped updates, the server's state is
    the mean of the two clients' saved states. Under fp16 transport too: the server clips the move from the
    rounded model it sent, which is where the client's move starts."""
    federation = FederationConfig(
        model="digits-cnn", strategy=strategy, fraction=1.0, min_clients=2, rounds=3, batch_size=32, lr=0.05, fp16=fp16
    )
    scales: list[float] = []
    push = AggregatorClient.push

    def watched(self, *args, **kwargs):  # what the server answered: the test must see clipping happen
        reply = push(self, *args, **kwargs)
        scales.append(reply.move_scale)
        return reply

    monkeypatch.setattr(AggregatorClient, "push", watched)
    # every round's move is longer than 0.05 (about 1 at lr 0.05): every update is clipped
    with two_agents(tmp_path, federation, max_update_norm=0.05, update_norm_mode="clip") as (coordinator, agents):
        run_to_the_end(agents, time.monotonic() + 120)
        assert coordinator.federation.round == 3
        server_state = coordinator.federation.strategy.state_dict()[key]
    assert len(scales) == 6 and all(0.0 < s < 0.5 for s in scales), scales
    saved = [ClientState.load(tmp_path / name) for name in agents]
    checked = 0
    for name, server_value in server_state.items():
        mean = sum(s.strategy_state[group][name] for s in saved) / 2  # type: ignore[union-attr]
        assert float(mean.abs().max()) > 0
        torch.testing.assert_close(server_value, mean, rtol=1e-4, atol=1e-4 * float(mean.abs().max()))
        checked += 1
    assert checked
