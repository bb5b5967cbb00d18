"""The device an agent computes on (``Agent(device=…)``, ``fedatoms client run --device``): training and evaluation.

The machine pretends CUDA (:mod:`pretend_cuda`): ``auto`` picks it and using it fails, so an agent that trains
and reports its evaluation ran both where it was told.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pretend_cuda import NEEDS_NO_GPU, pretend_cuda
from processes import SECRET, Aggregator, federation_toml, free_port
from support import serve_aggregator

from aggregator_service import store
from aggregator_service.config import FederationConfig
from client_agent.agent import Agent
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient
from fedatoms.cli import main
from fedcore.data import load_dataset
from fedcore.tiers import CapabilityProfile

pytestmark = NEEDS_NO_GPU


def _evaluated(url: str, round_: int) -> list[str]:
    """The clients whose evaluation of ``round_`` the aggregator recorded."""
    with store.session_factory(store.create_engine_for(url)).begin() as s:
        fed = store.get_federation(s, "default")
        assert fed is not None
        return [e.client_id for e in store.round_evaluations(s, fed, round_)]


def test_an_agent_restarted_with_a_device_evaluates_there_what_it_trained_on_the_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent pushes round 1 trained where the task said (``auto``), stops before the round closes, and comes
    back with ``device="cpu"`` on a machine where ``auto`` is CUDA: it evaluates round 1 on the CPU."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    federation = FederationConfig(model="digits-cnn", fraction=1.0, min_clients=2, rounds=1, batch_size=32)
    _, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        poll_interval_seconds=0.01,
        federation=federation,
    )
    train, test = load_dataset("digits")
    channels: list[AggregatorClient] = []

    def agent(name: str, device: str | None) -> Agent:
        channels.append(AggregatorClient(f"127.0.0.1:{port}"))
        return Agent(
            channels[-1],
            tmp_path / name,
            train.subset(range(100)),
            test.subset(range(50)),
            profile=CapabilityProfile(num_samples=100),
            enrollment_secret=SECRET,
            eval_poll_seconds=0.0,
            device=device,
        )

    def until_pushed(a: Agent) -> None:
        for _ in range(20):
            a.step()
            if a.state is not None and a.state.evaluate_round == 1:
                return
        raise AssertionError("the agent did not push round 1")

    try:
        first, other = agent("first", None), agent("other", "cpu")
        first.ensure_registered()
        other.ensure_registered()
        until_pushed(first)  # the task's device: auto, the CPU still
        assert first.state is not None and first.state.last_config["device"] == "auto"
        until_pushed(other)  # the round's last push: it closes
        pretend_cuda(monkeypatch)
        again = agent("first", "cpu")  # the same state directory, restarted with --device cpu
        for _ in range(20):
            if again.step() is None:
                break
        else:
            raise AssertionError("the restarted agent did not finish")
        assert again.state is not None and again.state.client_id in _evaluated(url, 1)
    finally:
        for channel in channels:
            channel.close()
        server.stop(grace=None)


def test_client_run_with_device_cpu_trains_and_evaluates_on_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fedatoms client run --device cpu``, the real command against a real aggregator, on a machine where
    ``auto`` is CUDA: one round trained, pushed and evaluated, and the device in the state it saved."""
    config = federation_toml(tmp_path / "federation.toml", model="digits-cnn", rounds=1, min_clients=1)
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    pretend_cuda(monkeypatch)
    try:
        argv = ["client", "run", "--server", server.target, "--enrollment-secret", SECRET, "--partition-index", "0"]
        code = main([*argv, "--state-dir", str(tmp_path / "state"), "--no-progress", "--device", "cpu"])
    finally:
        server.stop()
    assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
    state = ClientState.load(tmp_path / "state")
    assert state is not None and state.rounds_joined == 1 and state.last_config["device"] == "cpu"
    assert _evaluated(url, 1) == [state.client_id]


def test_a_measured_profile_times_the_device_the_agent_trains_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``client run --measure`` timed the CPU whatever ``--device`` said: a GPU device declared the CPU's compute."""
    from pretend_cuda import NO_CUDA_ERRORS

    from client_agent.profile import measured_profile

    on_cpu = measured_profile(100, device="cpu", repeats=1)
    assert on_cpu.compute_macs is not None and on_cpu.compute_macs > 0 and on_cpu.num_samples == 100
    pretend_cuda(monkeypatch)
    with pytest.raises(NO_CUDA_ERRORS):  # auto is CUDA here: the measurement runs there (and fails, no driver)
        measured_profile(100, device="auto", repeats=1)
    assert measured_profile(100, device="cpu", repeats=1).compute_macs > 0  # told the CPU, it times the CPU
