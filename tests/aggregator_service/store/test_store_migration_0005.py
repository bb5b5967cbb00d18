"""Migrations 0005 (transfer categories) and 0006 (round bytes) on a database written at 0004: old rows keep
their bytes and baseline, and each round's sums per category are filled in from them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from aggregator_service import store

SECRET = "enrol-me-0b7d1c9e"
FAST_PBKDF2 = 1_000
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

OLD = "0004_round_late_pushes"
MODEL = 605_224  # one plain digits-cnn, as the old per-round baseline 2 × cohort × model counted it


def _old_database(url: str) -> tuple[int, list[str]]:
    """A 0004 database: round 1 closed (3 clients, metrics with the old baseline), round 2 open with one fetch."""
    store.upgrade(url, OLD)
    engine = store.create_engine_for(url)
    try:
        with engine.begin() as conn:  # federations at 0004: without 0006's column, so not through the ORM's insert
            conn.execute(
                text(
                    "INSERT INTO federations (name, config_json, state, current_round, enrollment_secret_hash,"
                    " strategy_state_json, policy_state_json, created_at, updated_at)"
                    " VALUES ('old', '{\"model\": \"digits-cnn\"}', 'running', 0, :h, '{}', '{}', :t, :t)"
                ),
                {"h": store.hash_secret(SECRET, iterations=FAST_PBKDF2), "t": T0},
            )
        with store.session_factory(engine).begin() as s:  # these tables are the same at 0004 and head
            fed = store.get_federation(s, "old")
            assert fed is not None
            clients = [store.register_client(s, fed, {}, 1.0, now=T0)[0].id for _ in range(3)]
            store.open_round(s, fed, 1, clients, ["w"], False, T0 + timedelta(minutes=5), now=T0)
            s.flush()
            fed_id = fed.id
        with engine.begin() as conn:
            conn.execute(text("UPDATE rounds SET state = 'closed' WHERE federation_id = :f"), {"f": fed_id})
        with store.session_factory(engine).begin() as s:
            fed = s.get(store.Federation, fed_id)
            store.open_round(s, fed, 2, clients, ["w"], False, T0 + timedelta(minutes=10), now=T0)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO round_metrics (federation_id, round, bytes_down, bytes_up, fedavg_equivalent_bytes)"
                    " VALUES (:f, 1, :d, :u, :b)"
                ),
                {"f": fed_id, "d": 3 * 1000, "u": 3 * 700, "b": 2 * 3 * MODEL},
            )
            rows = [{"f": fed_id, "r": 1, "c": c, "d": "down", "b": 1000} for c in clients]
            rows += [{"f": fed_id, "r": 1, "c": c, "d": "up", "b": 700} for c in clients]
            rows += [{"f": fed_id, "r": 2, "c": clients[0], "d": "down", "b": 40}]
            conn.execute(
                text(
                    "INSERT INTO transfers (federation_id, round, client_id, direction, bytes)"
                    " VALUES (:f, :r, :c, :d, :b)"
                ),
                rows,
            )
    finally:
        engine.dispose()
    return fed_id, clients


def _rows(url: str, sql: str) -> list[tuple]:
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql)).all()]
    finally:
        engine.dispose()


def test_0005_maps_old_directions_to_categories_and_keeps_the_old_baseline(db_url):
    fed_id, clients = _old_database(db_url)
    metrics_before = _rows(db_url, "SELECT * FROM round_metrics")
    store.upgrade(db_url)
    assert store.current_revision(db_url) == store.head_revision()

    got = _rows(
        db_url,
        "SELECT round, client_id, direction, category, bytes, fedavg_equivalent_bytes FROM transfers"
        " ORDER BY round, client_id, direction",
    )
    expected = [
        (1, c, d, cat, b, MODEL)
        for c in sorted(clients)
        for d, cat, b in (("down", "train_fetch", 1000), ("up", "push", 700))
    ]
    expected += [(2, clients[0], "down", "train_fetch", 40, MODEL)]  # an open round takes the federation's model bytes
    assert got == expected
    # round 1's rows sum to its old baseline, 2 × cohort × model; round_metrics is untouched
    assert _rows(db_url, "SELECT SUM(fedavg_equivalent_bytes) FROM transfers WHERE round = 1") == [(2 * 3 * MODEL,)]
    assert _rows(db_url, "SELECT * FROM round_metrics") == metrics_before
    # 0006 sums them per round and category: 3 clients × 1000 down and × 700 up; round 2's one fetch
    round_bytes = "SELECT round, category, bytes, fedavg_equivalent_bytes FROM round_bytes ORDER BY round, category"
    assert _rows(db_url, round_bytes) == [
        (1, "push", 2100, 3 * MODEL),
        (1, "train_fetch", 3000, 3 * MODEL),
        (2, "train_fetch", 40, MODEL),
    ]

    # the upgraded table takes the new categories, one row per (round, client, category)
    engine = store.create_engine_for(db_url)
    try:
        with store.session_factory(engine).begin() as s:
            fed = s.get(store.Federation, fed_id)
            store.record_transfer(s, fed, 1, clients[0], "eval_fetch", 55, fedavg_equivalent_bytes=MODEL)
            store.record_transfer(s, fed, 1, clients[0], "push", 5, fedavg_equivalent_bytes=0)
    finally:
        engine.dispose()
    assert _rows(
        db_url,
        f"SELECT category, bytes, fedavg_equivalent_bytes FROM transfers WHERE round = 1 AND client_id = '{clients[0]}'"
        " ORDER BY category",
    ) == [("eval_fetch", 55, MODEL), ("push", 705, MODEL), ("train_fetch", 1000, MODEL)]
    assert _rows(db_url, round_bytes) == [
        (1, "eval_fetch", 55, MODEL),
        (1, "push", 2105, 3 * MODEL),
        (1, "train_fetch", 3000, 3 * MODEL),
        (2, "train_fetch", 40, MODEL),
    ]

    # and down again: one down row per (round, client) holding both fetches, the up rows as they were
    store.downgrade(db_url, OLD)
    assert _rows(
        db_url, "SELECT round, client_id, direction, bytes FROM transfers ORDER BY round, client_id, direction"
    ) == [
        (1, c, d, b + (55 if c == clients[0] and d == "down" else 5 if c == clients[0] else 0))
        for c in sorted(clients)
        for d, b in (("down", 1000), ("up", 700))
    ] + [(2, clients[0], "down", 40)]


def test_0005_upgrades_an_empty_0004_database(db_url):
    store.upgrade(db_url, OLD)
    store.upgrade(db_url)
    assert store.current_revision(db_url) == store.head_revision()
    assert _rows(db_url, "SELECT COUNT(*) FROM transfers") == [(0,)]
    assert _rows(db_url, "SELECT COUNT(*) FROM round_bytes") == [(0,)]
