"""Store fixtures: every test runs on a real SQLite file and, when configured, on a real PostgreSQL.

PostgreSQL runs when a server answers on ``FEDATOMS_TEST_POSTGRES_URL`` (by default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``, see support.py), a database the tests may
create schemas in; each test gets its
own ``t_<uuid>`` schema (via ``search_path`` in the connection options), dropped afterwards,
so parallel pytest workers never see each other's tables.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from support import postgres_base

from aggregator_service import store

SECRET = "enrol-me-0b7d1c9e"  # a value no column may ever contain
FAST_PBKDF2 = 1_000  # the default (600k) costs ~0.15 s per hash; one test checks it
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """URL of an empty database (not migrated) on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fedatoms.db'}"
        return
    base = postgres_base()
    schema = f"t_{uuid.uuid4().hex}"
    admin = create_engine(base)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


@dataclass
class StoreDB:
    backend: str
    url: str
    engine: Engine
    factory: sessionmaker[Session]
    extra_engines: list[Engine] = field(default_factory=list)

    def new_engine(self) -> Engine:
        """A second engine on the same database (another replica, or the service after a restart)."""
        engine = store.create_engine_for(self.url)
        self.extra_engines.append(engine)
        return engine


@pytest.fixture
def db(db_url: str) -> Iterator[StoreDB]:
    """A database migrated to head, with an engine and a session factory."""
    store.upgrade(db_url)
    engine = store.create_engine_for(db_url)
    handle = StoreDB(make_url(db_url).get_backend_name(), db_url, engine, store.session_factory(engine))
    try:
        yield handle
    finally:
        for e in [engine, *handle.extra_engines]:
            e.dispose()


@dataclass
class World:
    """A federation with three registered clients (ids sorted) and round 1 open for all of them."""

    fed: store.Federation
    clients: list[str]
    tokens: dict[str, str]
    secret: str = SECRET
    t0: datetime = T0


@pytest.fixture
def world(db: StoreDB) -> World:
    with db.factory.begin() as s:
        fed = store.create_federation(s, "digits", {"model": "digits-cnn"}, SECRET, iterations=FAST_PBKDF2, now=T0)
        tokens = {}
        for i in range(3):
            client, token = store.register_client(s, fed, {"device": f"dev{i}"}, 1.0, now=T0)
            tokens[client.id] = token
        clients = list(tokens)  # registration order: the order rounds fold updates in
        store.open_round(s, fed, 1, clients, ["w"], False, T0 + timedelta(minutes=5), now=T0)
    return World(fed, clients, tokens)
