"""Real server processes: a SIGKILLed aggregator restarted on its database finishes the open round with the same
result; a round closes at its deadline by the server's own clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_helpers import (
    SECRET,
    fill_keys,
    free_port,
    global_tensors,
    offline_round,
    register,
    shards,
    small_federation,
    start_aggregator,
    wait_serving,
)
from sqlalchemy import select

from aggregator_service import store
from aggregator_service.rounds import RoundPlan
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
TOML = f"""
enrollment_secret = "{SECRET}"
deadline_seconds = 600

[federation]
model = "digits-cnn"
factorization = "atoms-lowrank"
tiers = [1.0, 0.25]
fraction = 1.0
min_clients = 3
rounds = 2
batch_size = 32
lr = 0.05
"""


def _federation(tmp_path: Path, toml: str) -> tuple[Path, str, int, Path]:
    """The config file, database URL, a free port and the log file of one server, in ``tmp_path``."""
    config = tmp_path / "federation.toml"
    config.write_text(toml)
    return config, f"sqlite:///{tmp_path / 'fedatoms.db'}", free_port(), tmp_path / "server.log"


def _serve(config: Path, port: int, url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)]
    cmd += ["--listen", f"127.0.0.1:{port}", "--database-url", url]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}")
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"server did not start:\n{log.read_text()}") from None
    return proc


def test_sigkill_mid_round_then_restart_completes_the_round(tmp_path) -> None:
    config, url, port, log = _federation(tmp_path, TOML)
    proc = _serve(config, port, url, log)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.AggregatorStub(channel)
        data = shards(3, 80)
        clients = [register(stub, t, d) for t, d in zip([1.0, 0.25, 0.25], data, strict=True)]
        tasks = {c.client_id: c.task() for c in clients}
        assert all(t.WhichOneof("kind") == "train" for t in tasks.values())
        acked = []
        for c in clients[:2]:
            c.fetch()
            push = c.train(tasks[c.client_id])
            reply = c.push(1, push.tensors, num_samples=push.num_samples, update_id=f"u-{c.client_id}")
            assert reply.accepted and not reply.duplicate
            acked.append(c)
        last = clients[2]
        last.fetch()
        last_push = last.train(tasks[last.client_id])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        channel.close()

    proc = _serve(config, port, url, log)  # same port, same database
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.AggregatorStub(channel)
        for c in clients:
            c.stub = stub
        # the open round survived: same task (seed, due) for the member that has not pushed
        again = last.task()
        assert again.train.round == 1 and again.train.seed == tasks[last.client_id].train.seed
        assert acked[0].task().wait.reason == "round 1 update received; waiting for the round to close"
        retry = acked[0].push(1, acked[0].pushed[1].tensors, update_id=f"u-{acked[0].client_id}")
        assert retry.duplicate  # acknowledged before the crash: stored durably
        reply = last.push(1, last_push.tensors, num_samples=last_push.num_samples)
        assert reply.accepted
        assert last.task().train.round == 2  # round 1 closed, round 2 opened
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        channel.close()

    fed_config = small_federation(min_clients=3, rounds=2)  # what TOML above configures
    fill_keys(url, clients)
    cohort = tuple(sorted(c.key for c in clients))
    due = tuple(fed_config.spec.names)
    uninterrupted = offline_round(fed_config, RoundPlan(1, cohort, due, False), clients, num_clients_total=3)
    served = global_tensors(url)
    for name, tensor in uninterrupted.global_tensors.items():
        assert served[name][1] == 1
        assert torch.allclose(served[name][0], tensor, atol=1e-6, rtol=0), name
    assert "event=federation_loaded" in log.read_text() and "event=stopped" in log.read_text()


def test_a_real_server_closes_the_round_at_its_deadline_with_the_quorum(tmp_path) -> None:
    """``fedatoms aggregator serve`` with a 3 s deadline: two of three cohort members report, the third never
    does; the server's own deadline ticker closes the round with the two (no injected clock), and the
    straggler's late push is then refused and counted."""
    config, url, port, log = _federation(tmp_path, TOML.replace("deadline_seconds = 600", "deadline_seconds = 3"))
    proc = _serve(config, port, url, log)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.AggregatorStub(channel)
        clients = [register(stub, t, d) for t, d in zip([1.0, 0.25, 0.25], shards(3, 80), strict=True)]
        tasks = [c.task() for c in clients]
        assert all(t.train.round == 1 for t in tasks)
        opened = time.monotonic()
        for c, task in zip(clients[:2], tasks, strict=False):
            c.fetch()
            push = c.train(task)
            assert c.push(1, push.tensors, num_samples=push.num_samples).accepted
        straggler = clients[2]
        straggler.fetch()
        late = straggler.train(tasks[2])
        deadline = time.monotonic() + 30
        while clients[0].task().WhichOneof("kind") != "train":  # waits until round 2 opens
            assert time.monotonic() < deadline, f"round 1 never closed:\n{log.read_text()}"
            time.sleep(0.1)
        assert time.monotonic() - opened >= 2.5  # closed by its deadline (3 s), not by the reports
        with pytest.raises(grpc.RpcError) as info:
            straggler.push(1, late.tensors, num_samples=late.num_samples)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        channel.close()

    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s:
            rnd = s.scalars(select(store.Round).where(store.Round.number == 1)).one()
            assert (rnd.state, rnd.reported, rnd.stragglers, rnd.late_pushes) == ("closed", 2, 1, 1)
    finally:
        engine.dispose()
    fed_config = small_federation(min_clients=3, rounds=2)
    fill_keys(url, clients)
    cohort = tuple(sorted(c.key for c in clients))
    offline = offline_round(fed_config, RoundPlan(1, cohort, tuple(fed_config.spec.names), False), clients[:2], 3)
    served = global_tensors(url)
    for name, tensor in offline.global_tensors.items():
        assert torch.allclose(served[name][0], tensor, atol=1e-6, rtol=0), name
    assert "event=late_push_refused" in log.read_text()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_finished_federation_restarted_with_more_rounds_goes_on(backend, tmp_path, request) -> None:
    """aggregator.md: only `rounds` may change, e.g. to extend a federation. Before, the stored state "done"
    won over the raised rounds: every GetTask answered Done, and resuming was refused (409)."""
    url = f"sqlite:///{tmp_path / 'agg.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    first = start_aggregator(url, small_federation(rounds=1, tiers=[1.0], factorization="atoms"))
    try:
        clients = [register(first.stub, 1.0, d) for d in shards(2, 60)]
        for c in clients:
            c.round_trip()
        assert clients[0].task().WhichOneof("kind") == "done"
    finally:
        first.stop()
    again = start_aggregator(url, small_federation(rounds=2, tiers=[1.0], factorization="atoms"))
    try:
        for c in clients:
            c.stub = again.stub
        assert [c.round_trip()[0] for c in clients] == [2, 2]  # round 2 trains, pushes and closes
        assert clients[0].task().WhichOneof("kind") == "done"
    finally:
        again.stop()
    assert _stored_config(url)["rounds"] == 2  # the dashboard's planned rounds: it read the first start's 1
    # rounds only grow: 1 below the 2 ended was taken, and the record read "1 planned" beside "2 closed"
    with pytest.raises(ValueError, match="rounds = 1 is below the 2 rounds federation 'default' has already ended"):
        start_aggregator(url, small_federation(rounds=1, tiers=[1.0], factorization="atoms"))
    assert _stored_config(url)["rounds"] == 2


def _stored_config(url: str) -> dict:
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(select(store.Federation.config)).scalar_one())
    finally:
        engine.dispose()


def test_a_federation_restarted_without_eval_data_keeps_the_normalization_it_recorded(tmp_path) -> None:
    """eval_data is a service setting, not the method; turning it off was refused as "a different method"
    (normalization: stored the benchmark's, configured None). The clients go on normalizing as they did."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    first = start_aggregator(url, small_federation(tiers=[1.0], factorization="none"), eval_data="digits")
    recorded = first.coordinator.shared.config.normalization
    first.stop()
    assert recorded is not None and _stored_config(url)["normalization"] == recorded
    again = start_aggregator(url, small_federation(tiers=[1.0], factorization="none"), eval_data=None)
    try:
        assert again.coordinator.shared.config.normalization == recorded
        reply = again.stub.Register(
            pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=60), enrollment_secret=SECRET)
        )
        told = {"mean": list(reply.normalization_mean), "std": list(reply.normalization_std)}
        assert told == recorded  # what a device is told to normalize by
    finally:
        again.stop()


def test_a_federation_stored_before_benchmark_normalizations_were_recorded_restarts_and_records_it(tmp_path) -> None:
    """The shipped Kubernetes file evaluates on digits. A federation it created before the benchmark's
    normalization was recorded has none stored; restarted by this version (which records it) it must not be
    refused as "a different method": it trained on the loader's pixels all along, and now says so."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    config = small_federation(tiers=[1.0], factorization="atoms")
    older = start_aggregator(url, config)  # no eval_data: nothing recorded, as before this version
    older.stop()
    again = start_aggregator(url, config, eval_data="digits")
    try:
        assert again.coordinator.shared.config.normalization is not None
    finally:
        again.stop()
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(select(store.Federation.config)).scalar_one()
    finally:
        engine.dispose()
    assert stored["normalization"] == again.coordinator.shared.config.normalization
