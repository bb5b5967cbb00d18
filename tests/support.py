"""Helpers every integration test shares: free loopback ports, waiting for a server, scratch PostgreSQL schemas."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator_service import store

PG_ENV = "FEDATOMS_TEST_POSTGRES_URL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, timeout: float = 60.0) -> None:
    """Block until the aggregator's grpc.health.v1 says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="fedatoms.v1.Aggregator"), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"aggregator on {target} not serving after {timeout:.0f} s")
            time.sleep(0.2)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def postgres_schema(base: str) -> AbstractContextManager[str]:
    """A URL whose connections live in a fresh ``t_<uuid>`` schema, dropped afterwards."""
    return store.scratch_schema(base)
