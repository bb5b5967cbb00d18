"""Fixtures of the service tests: a real aggregator on an ephemeral loopback port over a real database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from grpc_helpers import Service, start_aggregator
from support import postgres_base, postgres_schema

from aggregator_service.config import FederationConfig


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
        service = start_aggregator(url, federation, **settings)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()
