"""An agent whose federation was restored from a backup taken before its last rounds fetches the whole model.

Round numbers never repeat in one federation, so a task for a round below the last one the agent trained
means the federation went back. What the agent holds came from rounds the federation no longer has, and the
restored federation numbers its new versions as the lost ones were: a version number the agent holds may name
other values now (a client outside the cohorts while the federation caught up). The server sends what differs
by version; the agent, which alone can tell, forgets its versions and takes the whole model.

A fetch retried across the restore asks for a round the restored federation has not reached
(``INVALID_ARGUMENT``): the agent goes on with the restored rounds as well, rather than ending with a traceback.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from links import LinkProxy
from support import serve_aggregator

from aggregator_service import store
from aggregator_service.config import FederationConfig
from client_agent.agent import Agent
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient, Backoff
from fedcore.data import load_dataset
from fedcore.tiers import CapabilityProfile
from fedwire.v1 import aggregator_pb2 as pb

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


def _serve(url: str, rounds: int = 6):
    return serve_aggregator(
        url,
        enrollment_secret=SECRET,
        quorum=1.0,
        poll_interval_seconds=0.01,
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=1, rounds=rounds, batch_size=32),
    )


def _agent(
    port: int, state_dir: Path, channel: AggregatorClient | None = None, evaluates: bool = True
) -> tuple[Agent, AggregatorClient]:
    train, test = load_dataset("digits")
    channel = channel or AggregatorClient(f"127.0.0.1:{port}")
    agent = Agent(
        channel,
        state_dir,
        train.subset(np.arange(100)),
        test.subset(np.arange(50)) if evaluates else None,
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


class _Watched(AggregatorClient):
    """An agent's link that lets the test act at a point of the agent's loop: ``hook`` sees each reply of the
    loop's own heartbeats and GetTasks, in the agent's thread, before the agent does."""

    hook: Callable[[object], None] = staticmethod(lambda reply: None)

    def heartbeat(self, *, retry: bool = True, round_: int = 0) -> pb.HeartbeatReply:
        reply = super().heartbeat(retry=retry, round_=round_)
        if retry and not round_:  # the loop's look at the rounds, not the background beat nor a round's outcome
            self.hook(reply)
        return reply

    def get_task(self, *args, **kwargs) -> pb.Task:
        reply = super().get_task(*args, **kwargs)
        self.hook(reply)
        return reply


class _Said(logging.Handler):
    """Sets ``event`` once a record says ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.mark.parametrize("fetch", ["evaluate", "train"])
def test_an_agent_whose_fetch_is_retried_across_a_restore_goes_on_with_the_restored_rounds(
    tmp_path: Path, caplog, fetch: str
) -> None:
    """The reviewer's run: the agent asks for round 3's model (``evaluate``: round 3 closed, to evaluate it;
    ``train``: an agent without a test split, to train round 3), the aggregator stops under the fetch, which is
    retried, and the address comes back serving a backup taken in round 2: ``INVALID_ARGUMENT: FetchRequest.round
    3 is not a round of this federation yet (current round: 2)``. The agent ended with that traceback; it now
    says the federation went back and trains the restored rounds to the federation's end."""
    live, restored, device = tmp_path / "live.db", tmp_path / "restored.db", tmp_path / "device"
    _, first, port = _serve(f"sqlite:///{live}", rounds=4)
    proxy = LinkProxy(port)  # the aggregator's address: the restored one is served there
    channel = _Watched(proxy.target, backoff=Backoff(base=0.05, cap=0.5))
    agent, _ = _agent(port, device, channel, evaluates=fetch == "evaluate")
    retried = _Said("event=rpc_retry rpc=FetchModel")
    logging.getLogger("fedatoms.client").addHandler(retried)
    servers = [first]
    restore_failed: list[BaseException] = []

    def serve_the_backup() -> None:  # once the agent retries its fetch: the restored federation, at the address
        try:
            assert retried.event.wait(60), "the agent never retried its fetch"
            _, server, restored_port = _serve(f"sqlite:///{restored}", rounds=4)
            servers.append(server)
            proxy.upstream = restored_port
            proxy.come_back()
        except BaseException as exc:
            restore_failed.append(exc)

    def hook(reply: object) -> None:
        if isinstance(reply, pb.Task) and reply.WhichOneof("kind") == "train" and reply.train.round == 2:
            if not restored.exists():
                with closing(sqlite3.connect(live)) as src, closing(sqlite3.connect(restored)) as dst:
                    src.backup(dst)  # the backup: round 1 closed, round 2 open
            return
        about_to_fetch_3 = (
            isinstance(reply, pb.HeartbeatReply) and reply.last_closed_round >= 3
            if fetch == "evaluate"
            else isinstance(reply, pb.Task) and reply.WhichOneof("kind") == "train" and reply.train.round == 3
        )
        if about_to_fetch_3:
            channel.hook = lambda reply: None
            proxy.go_down()  # the aggregator stops: the fetch that follows this answer fails, and is retried
            first.stop(grace=None).wait()
            threading.Thread(target=serve_the_backup, daemon=True).start()

    channel.hook = hook
    ended: list[object] = []
    stop = threading.Event()

    def run() -> None:
        try:
            ended.append(agent.run(stop))
        except BaseException as exc:  # the traceback the agent ended with
            ended.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="fedatoms.client"):
            runner.start()
            runner.join(timeout=180)
            if runner.is_alive():
                stop.set()
                runner.join(timeout=30)
    finally:
        logging.getLogger("fedatoms.client").removeHandler(retried)
        channel.close()
        proxy.close()
        for server in servers:
            server.stop(grace=None)
    assert not restore_failed, restore_failed
    assert ended == [0], ended  # the federation's end, not an INVALID_ARGUMENT traceback
    said = [r.getMessage() for r in caplog.records]
    trained_last = 3 if fetch == "evaluate" else 2  # the train fetch comes before round 3's training
    rewound = f"event=federation_rewound round=3 last_round={trained_last} server_round=2"
    at = next((i for i, line in enumerate(said) if line.startswith(rewound)), None)
    assert at is not None, "\n".join(said[-30:])
    assert "is not a round of this federation yet" in said[at]  # the server's words, in the detail
    # then the restored rounds, each trained from the restored federation's model
    trained = [line.split()[1] for line in said[at:] if line.startswith("event=train ")]
    assert trained == ["round=2", "round=3", "round=4"], trained
    # the restored federation closed its rounds on this client's updates: alone, it is each round's quorum
    with closing(sqlite3.connect(restored)) as db:
        rounds = db.execute("SELECT number, state FROM rounds ORDER BY number").fetchall()
    assert rounds == [(1, "closed"), (2, "closed"), (3, "closed"), (4, "closed")], rounds
    final = ClientState.load(device)
    assert final is not None and final.last_round == 4
    if fetch == "evaluate":  # it evaluated the last round on the model the restored federation ended with
        assert any(line.startswith("event=evaluated round=4 ") for line in said[at:])
        served = _global_tensors(f"sqlite:///{restored}")
        assert final.versions == {n: v for n, (_t, v) in served.items()}
        for name, (tensor, _v) in served.items():
            assert torch.equal(final.global_tensors[name], tensor), name


def test_another_invalid_argument_of_a_fetch_still_ends_the_run(tmp_path: Path, caplog) -> None:
    """Only a round past the server's is a restore: a fetch refused for the client's own mistake (here more
    versions declared held than its model has tensors) is raised, once, not taken for a rewind nor retried."""
    _, server, port = _serve(f"sqlite:///{tmp_path / 'agg.db'}", rounds=4)
    agent, channel = _agent(port, tmp_path / "device")
    try:
        _step_until(agent, lambda s: s.last_round == 1 and s.evaluate_round == 1)  # pushed; round 1 to evaluate
        agent.state.versions.update({f"no.such.tensor.{i}": 1 for i in range(100)})
        with caplog.at_level(logging.INFO, logger="fedatoms.client"), pytest.raises(grpc.RpcError) as raised:
            _step_until(agent, lambda s: s.evaluate_round is None)
    finally:
        channel.close()
        server.stop(grace=None)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "FetchRequest.held lists" in raised.value.details()
    said = [r.getMessage() for r in caplog.records]
    assert not any("federation_rewound" in line or "rpc=FetchModel" in line for line in said), said
