"""Migrations: from empty to head, idempotent, in agreement with the models; SQLite's connection settings."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import OperationalError

from aggregator_service import store

TABLES = {
    "federations",
    "clients",
    "rounds",
    "global_tensors",
    "strategy_tensors",
    "updates",
    "update_tensors",
    "round_metrics",
    "tensor_metrics",
    "transfers",
    "round_bytes",
    "evaluations",
}


def _tables(url: str) -> set[str]:
    engine = store.create_engine_for(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_creates_every_table_and_is_idempotent(db_url):
    assert store.current_revision(db_url) is None
    assert _tables(db_url) == set()

    store.upgrade(db_url)
    assert _tables(db_url) == TABLES == set(store.Base.metadata.tables)
    assert store.current_revision(db_url) == store.head_revision() == "0009_client_evaluated_through"

    store.upgrade(db_url)  # a second start-up migrates nothing and fails nothing
    assert store.current_revision(db_url) == "0009_client_evaluated_through"
    assert _tables(db_url) == TABLES


def test_a_schema_a_newer_release_migrated_is_refused_in_one_line(db_url, capsys):
    """Rolling the code back after an upgrade: `db upgrade` (and the aggregator, which migrates at start) met a
    revision it does not know with alembic's traceback; it says what happened and what to do, and changes nothing."""
    from fedatoms.cli import main

    store.upgrade(db_url)
    engine = store.create_engine_for(db_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0099_from_a_newer_release'")
    finally:
        engine.dispose()
    assert main(["db", "upgrade", "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "0099_from_a_newer_release" in line]  # log lines aside
    assert len(said) == 1 and "CommandError" not in err, err  # alembic's traceback ended in its CommandError
    assert "schema is at 0099_from_a_newer_release, which this release does not know" in said[0]
    assert f"its newest is {store.head_revision()}" in said[0] and "restore the backup" in said[0]
    assert store.current_revision(db_url) == "0099_from_a_newer_release" and _tables(db_url) == TABLES


def test_migrations_match_the_models(db):
    """Alembic's autogenerate finds nothing to add: the explicit revision and the ORM describe one schema."""
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), store.Base.metadata)
    assert diff == []


def test_downgrade_to_base_and_back(db_url):
    store.upgrade(db_url)
    store.downgrade(db_url, "base")
    assert _tables(db_url) == set()
    assert store.current_revision(db_url) is None
    store.upgrade(db_url)
    assert _tables(db_url) == TABLES


def test_indexes_for_the_dashboard(db):
    insp = inspect(db.engine)
    index_columns = {tuple(ix["column_names"]) for t in TABLES for ix in insp.get_indexes(t)}
    assert ("federation_id", "last_seen") in index_columns  # clients by federation + last seen
    assert insp.get_pk_constraint("rounds")["constrained_columns"] == ["federation_id", "number"]
    assert insp.get_pk_constraint("tensor_metrics")["constrained_columns"][:2] == ["federation_id", "round"]
    assert ("federation_id", "client_id", "update_id") in index_columns  # a retry finds its update


def test_sqlite_connection_settings(tmp_path):
    url = f"sqlite:///{tmp_path / 'settings.db'}"
    store.upgrade(url)
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    finally:
        engine.dispose()
    # WAL is recorded in the file itself: a plain connection, without the engine's pragmas, sees it too
    with closing(sqlite3.connect(tmp_path / "settings.db")) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert raw.execute("PRAGMA page_size").fetchone() == (65536,)  # tensor blobs in large pages


def test_sqlite_deferred_readers_do_not_wait_for_the_writer(tmp_path):
    """The aggregator's engine begins IMMEDIATE (writers queue); a dashboard engine may begin DEFERRED and read
    under WAL while a write transaction is open."""
    url = f"sqlite:///{tmp_path / 'rw.db'}"
    store.upgrade(url)
    writer = store.create_engine_for(url)
    reader = store.create_engine_for(url, sqlite_begin="DEFERRED", sqlite_busy_timeout_ms=50)
    impatient_writer = store.create_engine_for(url, sqlite_busy_timeout_ms=50)
    try:
        with store.session_factory(writer).begin() as s:
            store.create_federation(s, "f", {}, "x", iterations=1_000)
            with store.session_factory(reader)() as r:
                assert store.get_federation(r, "f") is None  # not committed yet, and no waiting
            with pytest.raises(OperationalError, match="locked"):
                with store.session_factory(impatient_writer)() as w:
                    store.get_federation(w, "f")  # BEGIN IMMEDIATE waits for the write lock, then gives up
        with store.session_factory(reader)() as r:
            assert store.get_federation(r, "f") is not None
    finally:
        for e in (writer, reader, impatient_writer):
            e.dispose()


def test_sqlite_foreign_keys_cascade(db, world):
    """foreign_keys=ON is what makes ON DELETE CASCADE work on SQLite (PostgreSQL always enforces it)."""
    with db.factory.begin() as s:
        s.delete(s.get(store.Federation, world.fed.id))
    with db.factory() as s:
        assert s.scalar(select(func.count()).select_from(store.Client)) == 0
        assert s.scalar(select(func.count()).select_from(store.Round)) == 0


def test_upgrade_from_0001_numbers_existing_clients_by_registration(db_url):
    """A database written before clients had numbers gets them in registration order, per federation."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import text

    store.upgrade(db_url, "0001_initial")
    engine = store.create_engine_for(db_url)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    try:
        with engine.begin() as conn:
            for fid, name in ((1, "a"), (2, "b")):
                conn.execute(
                    text(
                        "INSERT INTO federations (id, name, config_json, state, current_round, enrollment_secret_hash,"
                        " strategy_state_json, policy_state_json, created_at, updated_at)"
                        " VALUES (:id, :name, '{}', 'running', 1, 'x', '{}', '{}', :t, :t)"
                    ),
                    {"id": fid, "name": name, "t": t0},
                )
            for i, (cid, fid) in enumerate((("c3", 1), ("c1", 2), ("c2", 1), ("c0", 1))):
                conn.execute(
                    text(
                        "INSERT INTO clients (id, federation_id, name, token_hash, profile_json, tier, registered_at,"
                        " last_seen, rounds_joined, bytes_up, bytes_down) VALUES (:id, :f, :id, :h, '{}', 1.0, :t, :t,"
                        " 0, 0, 0)"
                    ),
                    {"id": cid, "f": fid, "h": f"hash-{cid}", "t": t0 + timedelta(seconds=i)},
                )
        store.upgrade(db_url)
        with engine.connect() as conn:
            numbers = dict(conn.execute(text("SELECT id, number FROM clients")).all())
    finally:
        engine.dispose()
    assert numbers == {"c3": 0, "c2": 1, "c0": 2, "c1": 0}


def test_migrating_down_and_up_keeps_the_rows_that_refer_to_clients(db_url):
    """SQLite alters ``clients`` by copying it; with foreign keys on, dropping the old copy would
    cascade and empty transfers, evaluations and updates. Migrations run with the keys off."""
    from datetime import UTC, datetime, timedelta

    store.upgrade(db_url)
    engine = store.create_engine_for(db_url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.create_federation(s, "keep", {}, "enrol-me-0b7d1c9e", iterations=1000)
            client, _ = store.register_client(s, fed, {}, 1.0, "a")
            store.open_round(s, fed, 1, [client.id], [], False, datetime.now(UTC) + timedelta(hours=1))
            store.record_transfer(s, fed, 1, client.id, "down", 10)
            store.record_evaluation(s, fed, 1, client.id, global_accuracy=0.5, global_loss=1.0, num_samples=3)

        def counts() -> tuple[int, ...]:
            with engine.connect() as conn:
                return tuple(
                    conn.execute(select(func.count()).select_from(t)).scalar_one()
                    for t in (store.Client.__table__, store.Transfer.__table__, store.Evaluation.__table__)
                )

        assert counts() == (1, 1, 1)
        engine.dispose()
        store.downgrade(db_url, "0001_initial")
        assert counts() == (1, 1, 1)
        engine.dispose()
        store.upgrade(db_url)
        assert counts() == (1, 1, 1)
    finally:
        engine.dispose()
