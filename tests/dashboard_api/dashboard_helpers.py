"""Helpers of the dashboard tests: a database filled by a real short federation, a live dashboard over it.

Once per module and backend: a real aggregator (gRPC on an ephemeral loopback port, its
deadline ticker running) and three real clients training digits-cnn for three rounds, with
evaluations reported; a fourth round is left open with one update in, and a spare client
enrolls after it opened (the one the admin tests revoke). The aggregator keeps running, so
tests can check that it honours what the dashboard writes. The dashboard is a real uvicorn
server on an ephemeral loopback port.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "aggregator_service"))
from grpc_helpers import SECRET, Client, register, shards, small_federation
from support import postgres_base, postgres_schema

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import DeadlineTicker, build_server
from client_agent.update import evaluate_client
from dashboard_api.app import create_app
from dashboard_api.settings import DashboardSettings
from fedcore.data import load_dataset
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

ADMIN_TOKEN = "admin-token-5f1c2e9b7a3d4c60"
BACKENDS = ["sqlite", "postgresql"]
ROUNDS_CLOSED = 3


@contextmanager
def database(backend: str, tmp: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp / 'fedatoms.db'}"
        return
    with postgres_schema(postgres_base()) as url:
        yield url


@contextmanager
def store_session(url: str) -> Iterator[tuple[Session, store.Federation]]:
    """A store transaction on ``url`` and its default federation, committed on leaving."""
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.get_federation(s, "default")
            assert fed is not None
            yield s, fed
    finally:
        engine.dispose()


@dataclass
class Federation:
    """The filled database and the aggregator still serving it."""

    url: str
    coordinator: Coordinator
    channel: grpc.Channel
    clients: list[Client]
    spare: Client
    evaluated: dict[int, set[str]] = field(default_factory=dict)
    #: round → what each reporter sent: (global accuracy, personalized accuracy or None, num_samples)
    reports: dict[int, list[tuple[float, float | None, int]]] = field(default_factory=dict)

    def session(self) -> AbstractContextManager[tuple[Session, store.Federation]]:
        """A store session on the filled database, for comparing the API with what the store holds."""
        return store_session(self.url)

    def secrets(self) -> list[str]:
        """Strings that must never leave the dashboard: tokens, their hashes, the enrollment secret and its hash."""
        with self.session() as (s, fed):
            hashes = list(s.scalars(select(store.Client.token_hash)))
            return [SECRET, ADMIN_TOKEN, fed.enrollment_secret_hash, *hashes, *(c.token for c in self.everyone)]

    @property
    def everyone(self) -> list[Client]:
        return [*self.clients, self.spare]


def _report(client: Client, round_: int, test_data) -> tuple[float, float | None, int]:
    client.fetch()
    ev = evaluate_client(client.state, client.spec, test_data)
    request = pb.EvaluationReport(
        round=round_, global_accuracy=ev.global_accuracy, global_loss=ev.global_loss, num_samples=ev.num_samples
    )
    if ev.personalized_accuracy is not None:
        request.personalized_accuracy = ev.personalized_accuracy
    assert client.stub.ReportEvaluation(request, metadata=client.auth).recorded
    return ev.global_accuracy, ev.personalized_accuracy, ev.num_samples


def run_federation(url: str, history_rounds: int | None = None) -> Iterator[Federation]:
    settings = AggregatorSettings(
        history_rounds=history_rounds,
        listen="127.0.0.1:0",
        database_url=url,
        enrollment_secret=SECRET,
        eval_data="digits",
        federation=small_federation(
            rounds=ROUNDS_CLOSED + 1,
            personal_atoms=True,
            interval_policy="fedlama",
            tau=1,
            phi=2,
            warmup_rounds=0,  # intervals change within the few rounds the dashboard shows
            min_clients=3,
        ),
    )
    store.upgrade(url)
    coordinator = Coordinator(
        settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1_000
    )
    server, port, _ = build_server(settings, coordinator, max_workers=8)
    server.start()
    ticker = DeadlineTicker(coordinator)
    ticker.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.AggregatorStub(channel)
        data = shards(4, 80)
        test_data = load_dataset("digits")[1]
        clients = [register(stub, tier, data[i], name=f"dev-{i}") for i, tier in enumerate((1.0, 0.25, 1.0))]
        evaluated: dict[int, set[str]] = {}
        reports: dict[int, list[tuple[float, float | None, int]]] = {}
        for round_ in range(1, ROUNDS_CLOSED + 1):
            for c in clients:
                got, reply = c.round_trip()
                assert got == round_ and reply.accepted
            assert coordinator.federation.round == round_
            # every client evaluates round 1 and 3, only the first two round 2
            reporters = clients if round_ != 2 else clients[:2]
            reports[round_] = [_report(c, round_, test_data) for c in reporters]
            evaluated[round_] = {c.client_id for c in reporters}
        task = clients[0].task()  # opens round 4; one update comes in, the round stays open
        assert task.WhichOneof("kind") == "train" and task.train.round == ROUNDS_CLOSED + 1
        clients[0].fetch()
        push = clients[0].train(task)
        assert clients[0].push(task.train.round, push.tensors, num_samples=push.num_samples).accepted
        spare = register(stub, 1.0, data[3], name="spare")
        yield Federation(url, coordinator, channel, clients, spare, evaluated, reports)
    finally:
        ticker.stop()
        channel.close()
        server.stop(grace=None)


def new_federation(url: str, name: str = "default") -> None:
    """Migrate the database at ``url`` and create federation ``name`` in it, with the store alone: no aggregator
    keeps a connection open (a test may then lock the file, or write rounds of its own)."""
    store.upgrade(url)
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            store.create_federation(s, name, {}, SECRET, iterations=1_000)
    finally:
        engine.dispose()


def metric_samples(text: str) -> dict[str, float]:
    """A Prometheus exposition's samples by ``name{label=value,…}`` (labels sorted), or ``name`` alone."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


@dataclass
class LiveServer:
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_dashboard(settings: DashboardSettings) -> LiveServer:
    """Serve ``create_app(settings)`` with uvicorn on an ephemeral loopback port, in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(settings), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", server, thread)
