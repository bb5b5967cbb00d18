"""Helpers every integration test shares: free loopback ports, waiting for a server, PostgreSQL and Chromium.

PostgreSQL tests run against ``FEDATOMS_TEST_POSTGRES_URL``, or :data:`PG_DEFAULT` when it is
unset, whenever a server answers there (probed once per process, 2 s connect timeout); set the
variable to an empty string to turn them off. The browser test runs whenever Chromium is installed.
Each skip says why in one line (``-ra`` prints it).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import sqlalchemy
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from aggregator_service import store

PG_ENV = "FEDATOMS_TEST_POSTGRES_URL"
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CHROMIUM_DEFAULT = "/usr/bin/chromium"


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


@functools.cache
def postgres_probe() -> tuple[str, str]:
    """``(url, "")`` when a PostgreSQL server answers on the test URL, else ``("", one-line reason)``."""
    url = os.environ.get(PG_ENV, PG_DEFAULT)
    if not url:
        return "", f"{PG_ENV} is empty: PostgreSQL tests turned off"
    try:
        shown = make_url(url).render_as_string(hide_password=True)
        engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 2})
    except Exception as exc:  # a malformed URL or a missing driver
        return "", f"{PG_ENV} unusable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:
        return "", f"no PostgreSQL answers at {shown} ({type(exc).__name__}); set {PG_ENV} to another URL"
    finally:
        engine.dispose()
    return url, ""


def postgres_base() -> str:
    """The PostgreSQL URL the tests may create schemas in; skips the calling test when none answers."""
    url, reason = postgres_probe()
    if not url:
        pytest.skip(reason)
    return url


def chromium() -> str | None:
    """Debian's Chromium, else a ``chromium`` on PATH; ``None`` when neither exists."""
    return CHROMIUM_DEFAULT if os.path.exists(CHROMIUM_DEFAULT) else shutil.which("chromium")


def spool_files(spool: Path, pid: int | str = "self") -> list[int]:
    """Sizes of the open files in ``spool`` (all unlinked) of this process, or of process ``pid``."""
    sizes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(str(spool)):
                assert target.endswith("(deleted)"), target  # unlinked at once: a crash leaves nothing
                sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
        except FileNotFoundError:  # closed meanwhile
            continue
    return sizes


def stored_update(url: str, round_: int) -> dict[str, np.ndarray]:
    """The one update stored for ``round_`` of the default federation, as the database holds it."""
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s, s.begin():
            fed = store.get_federation(s, "default")
            ((_, tensors, _),) = list(store.iter_round_updates(s, fed, round_))
            return tensors
    finally:
        engine.dispose()


def serve_aggregator(url: str, max_workers: int = 8, **settings: Any) -> tuple[Any, grpc.Server, int]:
    """A real aggregator in this process over ``url`` (migrated), on an ephemeral loopback port, started:
    ``(coordinator, server, port)``; ``settings`` are :class:`AggregatorSettings` fields. Stop it with
    ``server.stop(grace=None)``."""
    from aggregator_service.config import AggregatorSettings
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.server import build_server

    s = AggregatorSettings(listen="127.0.0.1:0", database_url=url, **settings)
    store.upgrade(url)
    coordinator = Coordinator(s, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1000)
    server, port, _ = build_server(s, coordinator, max_workers=max_workers)
    server.start()
    return coordinator, server, port


def digits_agents(links: Mapping[str, Any], root: Path, secret: str, **agent_kwargs: Any) -> dict[str, Any]:
    """An agent per named link (an ``AggregatorClient``), each training on its own 100 digits (in the links'
    order) and evaluating on the first 50 test images, its state under ``root/name``."""
    from client_agent.agent import Agent
    from fedcore.data import load_dataset
    from fedcore.tiers import CapabilityProfile

    train, test = load_dataset("digits")
    return {
        name: Agent(
            link,
            root / name,
            train.subset(np.arange(i * 100, (i + 1) * 100)),
            test.subset(np.arange(50)),
            profile=CapabilityProfile(num_samples=100),
            enrollment_secret=secret,
            **agent_kwargs,
        )
        for i, (name, link) in enumerate(links.items())
    }
