"""Helpers every integration test shares: free loopback ports, waiting for a server, scratch PostgreSQL schemas."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

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


@contextmanager
def postgres_schema(base: str) -> Iterator[str]:
    """A URL whose connections live in a fresh ``t_<uuid>`` schema, dropped afterwards."""
    schema = f"t_{uuid.uuid4().hex}"
    admin = create_engine(base)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        yield (
            make_url(base)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()
