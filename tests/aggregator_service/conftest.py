"""Fixtures of the service tests: a real aggregator on an ephemeral loopback port over a real database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_helpers import SECRET, small_federation
from support import postgres_base, postgres_schema

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc


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


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'fedatoms.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_schema(postgres_base()) as url:
        yield url


@pytest.fixture
def start_service() -> Iterator[Callable[..., Service]]:
    """Start aggregators: ``start_service(url, federation=…, **settings)``; all are stopped afterwards."""
    started: list[Service] = []

    def start(url: str, federation: FederationConfig | None = None, **settings: Any) -> Service:
        s = AggregatorSettings(
            listen="127.0.0.1:0",
            database_url=url,
            enrollment_secret=SECRET,
            federation=federation or small_federation(),
            **settings,
        )
        store.upgrade(url)
        coordinator = Coordinator(s, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1_000)
        server, port, _ = build_server(s, coordinator, max_workers=8)
        server.start()
        service = Service(url, s, coordinator, server, port, grpc.insecure_channel(f"127.0.0.1:{port}"))
        started.append(service)
        return service

    yield start
    for service in started:
        service.channel.close()
        service.server.stop(grace=None)
