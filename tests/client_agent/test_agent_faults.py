"""An agent on a bad day: killed mid-training, its server killed mid-federation, its link cut mid-push."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from links import LinkProxy
from processes import (
    SECRET,
    Aggregator,
    federation_toml,
    free_port,
    start_agent,
    wait_closed,
    wait_for,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import serve_aggregator

from aggregator_service import store
from aggregator_service.config import FederationConfig
from client_agent.agent import CREDENTIALS_FILE
from client_agent.state import ClientState
from client_agent.transport import AggregatorClient, Backoff, task_from_proto
from client_agent.update import run_task
from fedcore.data import load_dataset
from fedcore.tiers import CapabilityProfile

pytestmark = pytest.mark.slow


def _count(url: str, table: type, **where: object) -> int:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            q = select(func.count()).select_from(table)
            for key, value in where.items():
                q = q.where(getattr(table, key) == value)
            return int(s.scalar(q) or 0)
    finally:
        engine.dispose()


def test_agent_killed_mid_training_resumes_as_the_same_client_with_its_personal_atoms(tmp_path: Path) -> None:
    config = federation_toml(
        tmp_path / "federation.toml",
        model="digits-cnn",
        factorization="atoms",
        fraction=1.0,
        min_clients=1,
        rounds=3,
        local_epochs=20,
        batch_size=16,
        lr=0.01,
        personal_atoms=True,
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    state_dir, log1, log2 = tmp_path / "device", tmp_path / "agent1.log", tmp_path / "agent2.log"
    try:
        agent = start_agent(server.target, state_dir, 0, log1)
        try:
            client_id = wait_for(log1, r"event=registered client=(\w+)", proc=agent).group(1)
            wait_for(log1, r"event=evaluated round=1", proc=agent)
            wait_for(log1, r"event=train round=2", proc=agent)  # round 2's training has begun
        finally:
            agent.kill()
            agent.wait(10)
        saved = ClientState.load(state_dir)
        assert saved is not None and saved.client_id == client_id
        assert saved.personal_atoms, "personal atoms trained in round 1 are on disk"
        assert saved.last_round == 1 and saved.pending is None  # round 2 was lost mid-training, nothing half-written
        atoms_after_round1 = {n: t.clone() for n, t in saved.personal_atoms.items()}

        agent = start_agent(server.target, state_dir, 0, log2)
        assert agent.wait(180) == 0, log2.read_text()[-4000:]
        text = log2.read_text()
        assert f"event=resumed client={client_id}" in text and "event=registered" not in text
        resumed = wait_for(log2, r"event=train round=(\d+)").group(1)
        assert resumed == "2"  # the same task again, not a new client starting over
    finally:
        server.stop()
    assert _count(url, store.Client) == 1  # never re-registered
    assert _count(url, store.Round, state="closed") == 3
    final = ClientState.load(state_dir)
    assert (
        final is not None and final.client_id == client_id and final.rounds_joined == 3
    )  # round 1 before the kill, 2 and 3 after
    # the restarted agent trained on from the personal atoms round 1 left, so they moved on from there
    assert final.personal_atoms is not None and set(final.personal_atoms) == set(atoms_after_round1)
    assert any(not torch.equal(final.personal_atoms[n], atoms_after_round1[n]) for n in atoms_after_round1)


def test_clients_ride_through_an_aggregator_restart(tmp_path: Path) -> None:
    config = federation_toml(
        tmp_path / "federation.toml",
        model="digits-cnn",
        factorization="atoms",
        fraction=1.0,
        min_clients=2,
        rounds=4,
        local_epochs=3,
        batch_size=32,
        lr=0.01,
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    server = Aggregator(config, free_port(), url, tmp_path / "server.log").start()
    logs = [tmp_path / "a0.log", tmp_path / "a1.log"]
    agents = [start_agent(server.target, tmp_path / f"device{i}", i, logs[i]) for i in range(2)]
    try:
        wait_closed(url, 1)
        server.kill()  # SIGKILL mid-federation
        wait_for(logs[0], r"event=rpc_retry", timeout=60)  # the agents notice and back off
        server.start()  # same port, same database
        for agent, log in zip(agents, logs, strict=True):
            assert agent.wait(180) == 0, log.read_text()[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        server.stop()
    assert _count(url, store.Round, state="closed") == 4
    assert _count(url, store.Client) == 2
    for log in logs:
        assert "event=done" in log.read_text()
    # both aggregator processes set the allocator for message streams (fedwire.allocator)
    assert server.log.read_text().count("event=allocator_set mmap_threshold=4194304 trim_threshold=16777216") == 2


def test_push_cut_mid_stream_is_retried_with_its_id_and_counted_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    coordinator, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=2, rounds=2, batch_size=32),
    )
    proxy = LinkProxy(port, cut_after=64 * 1024)
    retries: list[float] = []
    client = AggregatorClient(f"127.0.0.1:{proxy.port}", backoff=Backoff(base=0.05), sleep=retries.append)
    other = AggregatorClient(f"127.0.0.1:{port}")
    try:
        train, _ = load_dataset("digits")
        reply, spec = client.register(CapabilityProfile(num_samples=100), SECRET)
        other.register(CapabilityProfile(num_samples=100), SECRET)  # a second cohort member keeps the round open
        task = client.get_task()
        assert task.WhichOneof("kind") == "train"
        state = ClientState(reply.client_id, reply.tier)
        state.receive(client.fetch(spec, {}, round_=task.train.round).model)
        push = run_task(state, spec, task_from_proto(task.train), train.subset(torch.arange(100).numpy()))
        proxy.armed = True
        first = client.push(task.train.round, "update-1", push.num_samples, push.metrics, push.tensors)
        assert proxy.cuts == 1 and len(retries) >= 1  # the stream was cut, and retried over a new connection
        assert first.accepted and not first.duplicate
        again = client.push(task.train.round, "update-1", push.num_samples, push.metrics, push.tensors)
        assert again.accepted and again.duplicate
    finally:
        client.close()
        other.close()
        proxy.close()
        server.stop(grace=None)
        coordinator.flush()  # byte counts are written about once a second, and at shutdown
    assert _count(url, store.Update, client_id=reply.client_id) == 1
    payload = sum(t.numel() * t.element_size() for t in push.tensors.values())
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            up = s.scalar(
                select(func.sum(store.Transfer.bytes)).where(
                    store.Transfer.client_id == reply.client_id, store.Transfer.direction == "up"
                )
            )
    finally:
        engine.dispose()
    assert up == payload  # the cut attempt and the duplicate moved no counted bytes


def test_credentials_are_private_to_the_device(tmp_path: Path) -> None:
    """The token file is readable by its owner only (the server keeps only a hash)."""
    from client_agent.agent import Credentials

    Credentials("c1", "secret-token", 1.0, "{}", "default", 20.0).save(tmp_path)
    mode = (tmp_path / CREDENTIALS_FILE).stat().st_mode & 0o777
    assert mode == 0o600
    assert json.loads((tmp_path / CREDENTIALS_FILE).read_text())["token"] == "secret-token"


def test_wrong_enrollment_secret_exits_3_with_a_clear_message(tmp_path: Path) -> None:
    import subprocess
    import sys

    from processes import ENV, ROOT

    config = federation_toml(tmp_path / "federation.toml", model="digits-cnn", rounds=1)
    server = Aggregator(config, free_port(), f"sqlite:///{tmp_path / 'agg.db'}", tmp_path / "server.log").start()
    try:
        cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", server.target]
        cmd += ["--enrollment-secret", "not-the-secret", "--partition-index", "0", "--state-dir", str(tmp_path / "d")]
        done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 3, done.stderr
    assert "wrong enrollment secret" in done.stderr and "refused this client" in done.stderr
    assert "check --enrollment-secret" in done.stderr and "delete the state dir" not in done.stderr
    assert not (tmp_path / "d" / CREDENTIALS_FILE).exists()


def test_unreachable_server_gives_up_with_exit_4(tmp_path: Path) -> None:
    import subprocess
    import sys

    from processes import ENV, ROOT

    cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", f"127.0.0.1:{free_port()}"]
    cmd += ["--enrollment-secret", SECRET, "--partition-index", "0", "--state-dir", str(tmp_path / "d")]
    cmd += ["--give-up-after", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert "event=rpc_retry" in done.stderr and "event=unreachable" in done.stderr
    assert "event=allocator_set mmap_threshold=4194304 trim_threshold=16777216" in done.stderr  # fedwire.allocator


def test_bad_partition_index_is_a_usage_error(tmp_path: Path) -> None:
    from fedatoms.cli import main

    code = main(
        ["client", "run", "--server", "127.0.0.1:1", "--partition-index", "10", "--state-dir", str(tmp_path / "d")]
    )
    assert code == 2


def test_grpc_errors_other_than_transient_are_not_retried(tmp_path: Path) -> None:
    """INVALID_ARGUMENT (a bad tensor) surfaces at once: retrying cannot fix it."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    _, server, port = serve_aggregator(
        url,
        max_workers=4,
        enrollment_secret=SECRET,
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=1, rounds=1),
    )
    retries: list[float] = []
    client = AggregatorClient(f"127.0.0.1:{port}", sleep=retries.append)
    try:
        _, spec = client.register(CapabilityProfile(num_samples=10), SECRET)
        task = client.get_task()
        tensors = {n: torch.zeros(spec.tensor(n).shape) for n in task.train.due_tensors}
        tensors["head.bias"] = torch.full((10,), float("nan"))  # every due tensor, one of them not finite
        with pytest.raises(grpc.RpcError) as info:
            client.push(task.train.round, "u1", 10, {}, tensors)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "head.bias" in info.value.details() and "NaN" in info.value.details()
        assert retries == []
    finally:
        client.close()
        server.stop(grace=None)


def test_agent_waiting_on_an_abandoned_round_moves_on_to_the_next(tmp_path: Path) -> None:
    """Round 1 misses its quorum twice and is abandoned: the agent that pushed for it must not wait forever."""
    from datetime import timedelta

    from client_agent.agent import Agent

    url = f"sqlite:///{tmp_path / 'agg.db'}"
    coordinator, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        quorum=1.0,
        poll_interval_seconds=0.01,
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=2, rounds=3, batch_size=32),
    )
    train, test = load_dataset("digits")
    channel = AggregatorClient(f"127.0.0.1:{port}")
    silent = AggregatorClient(f"127.0.0.1:{port}")
    try:
        agent = Agent(
            channel,
            tmp_path / "device",
            train.subset(torch.arange(100).numpy()),
            test.subset(torch.arange(50).numpy()),
            profile=CapabilityProfile(num_samples=100),
            enrollment_secret=SECRET,
            eval_poll_seconds=0.0,
        )
        agent.ensure_registered()
        silent.register(CapabilityProfile(num_samples=100), SECRET)  # in the cohort, never pushes
        for _ in range(20):
            agent.step()
            if agent.state is not None and agent.state.evaluate_round == 1:
                break
        assert agent.state is not None and agent.state.evaluate_round == 1  # pushed, waiting for round 1 to close
        deadline = coordinator.shared.open.deadline
        coordinator.tick(deadline + timedelta(seconds=1))  # no quorum: extended once
        coordinator.tick(
            deadline + timedelta(seconds=coordinator.shared.settings.deadline_seconds + 2)
        )  # still none: abandoned
        assert coordinator.open_round is None  # and nobody has asked for round 2 yet
        agent.step()  # round 1 is neither open nor closed: it was abandoned
        assert agent.state.evaluate_round is None
        agent.step()  # its own GetTask opens round 2; it trains and pushes
        assert agent.state.last_round == 2
    finally:
        channel.close()
        silent.close()
        server.stop(grace=None)


def test_a_revoked_agent_stops_at_its_next_heartbeat_not_at_the_end_of_its_long_poll(tmp_path: Path) -> None:
    """The heartbeat thread's UNAUTHENTICATED was logged at debug level and dropped: a revoked agent waited out its
    held GetTask (30 s) before its next call failed. It ends at the refused beat now, with exit code 3."""
    import threading
    import time

    from aggregator_service.export import revoke
    from client_agent.agent import EXIT_CODES, Agent

    url = f"sqlite:///{tmp_path / 'agg.db'}"
    _, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        heartbeat_timeout_seconds=3.0,  # a beat a second
        federation=FederationConfig(model="digits-cnn", fraction=1.0, min_clients=2, rounds=1),
    )
    train, _ = load_dataset("digits")
    channel = AggregatorClient(f"127.0.0.1:{port}")
    try:
        agent = Agent(
            channel,
            tmp_path / "device",
            train.subset(torch.arange(100).numpy()),
            None,
            profile=CapabilityProfile(num_samples=100),
            enrollment_secret=SECRET,
            long_poll_seconds=30.0,
        )
        codes: list[int] = []
        runner = threading.Thread(target=lambda: codes.append(agent.run()))
        runner.start()  # alone in the federation (min_clients = 2): it waits in held GetTask calls
        registered_by = time.monotonic() + 30
        while agent.credentials is None and time.monotonic() < registered_by:  # a state, with a deadline
            time.sleep(0.05)
        assert agent.credentials is not None
        revoked_at = time.monotonic()
        revoke(url, agent.credentials.client_id)
        runner.join(timeout=25)
        assert not runner.is_alive() and codes == [EXIT_CODES["unauthenticated"]]
        assert time.monotonic() - revoked_at < 10  # a beat or two, not the rest of a 30 s poll
    finally:
        channel.close()
        server.stop(grace=None)
