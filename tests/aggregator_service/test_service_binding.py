"""One port, one aggregator: a second server on a port another holds is refused, not load-balanced.

gRPC Python sets SO_REUSEPORT unless told otherwise, so two servers could bind one port and split the
clients between them without either noticing.
"""

from __future__ import annotations

import pytest
from grpc_helpers import SECRET, small_federation

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server


def _settings(url: str, listen: str) -> AggregatorSettings:
    return AggregatorSettings(listen=listen, database_url=url, enrollment_secret=SECRET, federation=small_federation())


def _server(url: str, listen: str):
    store.upgrade(url)
    settings = _settings(url, listen)
    coordinator = Coordinator(
        settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1_000
    )
    return build_server(settings, coordinator, max_workers=2)


def test_a_second_aggregator_on_a_held_port_is_refused(tmp_path) -> None:
    first, port, _ = _server(f"sqlite:///{tmp_path / 'a.db'}", "127.0.0.1:0")
    first.start()
    try:
        with pytest.raises(ValueError, match="in use"):
            _server(f"sqlite:///{tmp_path / 'b.db'}", f"127.0.0.1:{port}")
    finally:
        first.stop(grace=None)
