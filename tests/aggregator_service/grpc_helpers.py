"""A small test-only gRPC client: register, fetch, train with client_agent.update.run_task, push.

Real stubs on a real channel; the only thing it adds is bookkeeping the tests compare against
(the exact tensors each client pushed, so the offline engine can fold the same updates).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import free_port, serve_aggregator, wait_serving  # noqa: F401  (re-exported for the service tests)

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.rounds import Federation, RoundPlan
from aggregator_service.updates import ClientUpdate
from client_agent.state import ClientState
from client_agent.transport import task_from_proto
from client_agent.update import ClientPush, run_task
from fedcore import codec
from fedcore.data import ArrayDataset, load_dataset
from fedcore.keys import client_key
from fedcore.spec import ModelSpec
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

SECRET = "test-enrollment-secret"


@dataclass
class Service:
    url: str
    settings: AggregatorSettings
    coordinator: Coordinator
    server: grpc.Server
    port: int
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.AggregatorStub:
        return pb_grpc.AggregatorStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)


def start_aggregator(url: str, federation: FederationConfig | None = None, **settings: Any) -> Service:
    """A real aggregator on an ephemeral loopback port over ``url`` (migrated), started; ``stop()`` it."""
    settings.setdefault("enrollment_secret", SECRET)
    coordinator, server, port = serve_aggregator(url, federation=federation or small_federation(), **settings)
    s = coordinator.shared.settings
    return Service(url, s, coordinator, server, port, grpc.insecure_channel(f"127.0.0.1:{port}"))


def small_federation(**overrides: Any) -> FederationConfig:
    """digits-cnn with atoms and low-rank tiers 1 and 1/4; every online client joins every round."""
    params: dict[str, Any] = dict(
        model="digits-cnn",
        factorization="atoms-lowrank",
        tiers=[1.0, 0.25],
        fraction=1.0,
        min_clients=2,
        rounds=3,
        batch_size=32,
        lr=0.05,
        local_epochs=1,
    )
    params.update(overrides)
    return FederationConfig(**params)


def shards(n: int, per_client: int = 150) -> list[ArrayDataset]:
    """``n`` small disjoint shards of the bundled digits training set."""
    train, _ = load_dataset("digits")
    return [train.subset(np.arange(i * per_client, (i + 1) * per_client)) for i in range(n)]


@dataclass
class Client:
    stub: pb_grpc.AggregatorStub
    client_id: str
    token: str
    tier: float
    spec: ModelSpec
    data: ArrayDataset
    key: str = ""  # the round engine's key: client_key(registration number)
    batched: bool = False  # push as client_agent does (framing.push_messages), not one chunk per message
    state: ClientState = field(init=False)
    pushed: dict[int, ClientPush] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = ClientState(self.client_id, self.tier)

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def task(self) -> pb.Task:
        return self.stub.GetTask(pb.GetTaskRequest(), metadata=self.auth)

    def fetch(self) -> int:
        """Fetch what is newer than held; returns the payload bytes received."""
        held = [pb.TensorVersion(name=n, version=v) for n, v in self.state.versions.items()]
        model = codec.Reassembler()
        for batch in self.stub.FetchModel(pb.FetchRequest(held=held), metadata=self.auth):
            for msg in batch.chunks:
                assert msg.kind == pb.TENSOR_KIND_MODEL
                model.add(framing.to_chunk(msg))
        versions = model.versions()
        arrays = model.finish()
        self.state.receive({n: (torch.from_numpy(a), versions[n]) for n, a in arrays.items()})
        return model.bytes_received

    def train(self, task: pb.Task) -> ClientPush:
        t = task.train
        train_task = task_from_proto(t)
        push = run_task(self.state, self.spec, train_task, self.data, personal_atoms=t.personal_atoms)
        self.pushed[t.round] = push
        return push

    def push(
        self,
        round_: int,
        tensors: Mapping[str, Any],
        *,
        update_id: str | None = None,
        num_samples: int | None = None,  # the client's data size, what it registered with
        metrics: Mapping[str, float] | None = None,
        timeout: float = 60,
    ) -> pb.PushReply:
        update_id = update_id or uuid.uuid4().hex
        num_samples = len(self.data) if num_samples is None else num_samples
        if self.batched:
            header = pb.PushHeader(round=round_, update_id=update_id, num_samples=num_samples, metrics=metrics or {})
            frames = framing.push_messages(header, [(n, t, 0, pb.TENSOR_KIND_MODEL) for n, t in tensors.items()])
            messages = (pb.PushMessage.FromString(f) for f in frames)  # the stub serializes them back as they were
            return self.stub.PushUpdate(messages, metadata=self.auth, timeout=timeout)
        return self.stub.PushUpdate(
            push_messages(round_, tensors, update_id, num_samples, metrics or {}), metadata=self.auth, timeout=timeout
        )

    def round_trip(self) -> tuple[int, pb.PushReply]:
        """GetTask (must be Train) → FetchModel → train → PushUpdate."""
        task = self.task()
        assert task.WhichOneof("kind") == "train", task
        self.fetch()
        push = self.train(task)
        reply = self.push(task.train.round, push.tensors, num_samples=push.num_samples, metrics=push.metrics)
        return task.train.round, reply


def push_messages(
    round_: int, tensors: Mapping[str, Any], update_id: str, num_samples: int, metrics: Mapping[str, float]
) -> Iterator[pb.PushMessage]:
    yield pb.PushMessage(
        header=pb.PushHeader(round=round_, update_id=update_id, num_samples=num_samples, metrics=dict(metrics))
    )
    for name, tensor in tensors.items():
        for msg in framing.tensor_messages(name, tensor):
            yield pb.PushMessage(chunk=msg)


def register(
    stub: pb_grpc.AggregatorStub, tier: float, data: ArrayDataset, secret: str = SECRET, name: str | None = None
) -> Client:
    reply = stub.Register(
        pb.RegisterRequest(
            profile=pb.CapabilityProfile(device_name="test", num_samples=len(data), preferred_tier=tier),
            enrollment_secret=secret,
            client_name=name,
        )
    )
    spec = ModelSpec.from_json(reply.model_spec_json)
    assert reply.tier == tier
    return Client(stub, reply.client_id, reply.token, reply.tier, spec, data)


def fill_keys(url: str, clients: Sequence[Client]) -> None:
    """Set each client's engine key from its registration number in the database."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            numbers = dict(s.execute(select(store.Client.id, store.Client.number)).all())
    finally:
        engine.dispose()
    for c in clients:
        c.key = client_key(numbers[c.client_id])


def offline_round(
    config: FederationConfig, plan: RoundPlan, clients: Sequence[Client], num_clients_total: int
) -> Federation:
    """Fold the clients' pushes for ``plan.round`` into a fresh in-process engine, in registration order."""
    fed = config.build_federation(num_clients_total=num_clients_total)
    fed.begin(plan)
    for c in sorted(clients, key=lambda c: c.key):
        push = c.pushed[plan.round]
        fed.fold(ClientUpdate(c.key, push.num_samples, c.tier, fed.tier_spec(c.tier), push.tensors, None, push.metrics))
    fed.close()
    return fed


def round_metric(url: str, round_: int, column: Any) -> Any:
    """One column of round ``round_``'s metrics row as the server stored it, e.g. ``store.RoundMetrics.extra``."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            value = s.scalar(select(column).where(store.RoundMetrics.round == round_))
    finally:
        engine.dispose()
    assert value is not None, f"round {round_} stored no {column}"
    return value


def global_tensors(url: str, name: str = "default") -> dict[str, tuple[torch.Tensor, int]]:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.get_federation(s, name)
            assert fed is not None
            return {n: (torch.from_numpy(a), v) for n, (a, v, _i) in store.load_global_tensors(s, fed).items()}
    finally:
        engine.dispose()


def snapshot(url: str) -> dict[str, Any]:
    """Everything a rejected request must leave untouched (clients' last_seen excluded: every call refreshes it)."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return {
                "updates": s.scalar(select(func.count()).select_from(store.Update)),
                "update_tensors": s.scalar(select(func.count()).select_from(store.UpdateTensor)),
                "transfers": sorted(
                    s.execute(
                        select(
                            store.Transfer.round,
                            store.Transfer.client_id,
                            store.Transfer.direction,
                            store.Transfer.bytes,
                        )
                    ).all()
                ),
                "rounds": sorted(
                    s.execute(
                        select(
                            store.Round.number,
                            store.Round.state,
                            store.Round.reported,
                            store.Round.stragglers,
                            store.Round.late_pushes,
                        )
                    ).all()
                ),
                "globals": sorted(s.execute(select(store.GlobalTensor.name, store.GlobalTensor.version)).all()),
                "clients": sorted(
                    s.execute(
                        select(
                            store.Client.id, store.Client.revoked_at, store.Client.bytes_up, store.Client.rounds_joined
                        )
                    ).all()
                ),
            }
    finally:
        engine.dispose()
