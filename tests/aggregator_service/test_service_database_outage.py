"""The aggregator's database goes away and comes back: the calls made meanwhile are UNAVAILABLE, which every
client retries, and the service answers again once the database does.

INTERNAL, which a database outage used to be, ended every client agent within a second of the cut (the
protocol calls it a server bug, and nothing retries it). The outage is real: a PostgreSQL database of this test
that stops taking connections, with its sessions terminated, then takes them again.
"""

from __future__ import annotations

import sqlite3
import uuid

import grpc
import psycopg
import pytest
from grpc_helpers import register, shards, start_aggregator
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError
from support import postgres_base, wait_until

from fedwire.v1 import aggregator_pb2 as pb


def test_calls_during_a_postgresql_outage_are_unavailable_and_the_service_recovers() -> None:
    base = postgres_base()
    name = f"outage_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)

    def connections(allowed: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}'))
            if not allowed:
                conn.execute(
                    text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name}
                )

    try:
        svc = start_aggregator(url)
        try:
            client = register(svc.stub, 1.0, shards(1)[0])

            def beat() -> pb.HeartbeatReply:
                return svc.stub.Heartbeat(pb.HeartbeatRequest(), metadata=client.auth, timeout=30)

            assert beat().current_round >= 0
            connections(False)
            for call in (beat, client.task):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
                assert "cannot reach its database" in info.value.details()
            connections(True)

            def answers() -> bool:
                try:
                    beat()
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                    return False
                return True

            assert wait_until(answers, timeout=60), "the service never answered again"
            assert client.task().WhichOneof("kind") in ("train", "wait")
        finally:
            svc.stop()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


def test_a_statement_the_schema_cannot_run_stays_internal(tmp_path) -> None:
    """UNAVAILABLE is for a database that is away, which a retry can outlive. A statement the schema cannot
    run is the server's bug: clients retrying it forever would hide it, so it stays INTERNAL (its traceback in
    the server's log). Here a column the token lookup reads is gone, on SQLite (its raw sqlite3 path)."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    svc = start_aggregator(url)
    try:
        client = register(svc.stub, 1.0, shards(1)[0])
        with sqlite3.connect(tmp_path / "agg.db") as conn:
            conn.execute("ALTER TABLE clients RENAME COLUMN last_seen TO seen_gone")
        with pytest.raises(grpc.RpcError) as info:
            svc.stub.Heartbeat(pb.HeartbeatRequest(), metadata=client.auth, timeout=30)
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    finally:
        svc.stop()


@pytest.mark.parametrize(
    ("error", "away"),
    [
        (OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked")), True),
        (OperationalError("SELECT 1", {}, sqlite3.OperationalError("unable to open database file")), True),
        (OperationalError("SELECT x", {}, sqlite3.OperationalError("no such column: x")), False),
        (OperationalError("SELECT 1", {}, sqlite3.OperationalError("no such table: clients")), False),
        (sqlite3.OperationalError("database is locked"), True),  # the token lookup's raw sqlite3
        (OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused")), True),
        (ProgrammingError("SELECT x", {}, psycopg.errors.UndefinedColumn("column x does not exist")), False),
        (ValueError("not a database error"), False),
    ],
    ids=[
        "sqlite-locked",
        "sqlite-file",
        "sqlite-column",
        "sqlite-table",
        "raw-locked",
        "pg-down",
        "pg-column",
        "other",
    ],
)
def test_which_database_errors_a_retry_can_outlive(error: Exception, away: bool) -> None:
    from aggregator_service.server import _database_away

    assert _database_away(error) is away
