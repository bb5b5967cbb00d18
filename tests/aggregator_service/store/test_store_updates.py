"""Client updates: idempotent on update_id (retries, races), one per client and round, read back one at a time."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import event, func, insert, select
from sqlalchemy.exc import IntegrityError

from aggregator_service import store
from fedcore.codec import CodecError


def _tensors(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((3, 2), value, np.float32), "n": np.array([int(value)], np.int64)}


def _push(db, world, client: str, update_id: str, value: float, **kw):
    with db.factory.begin() as s:
        upd, dup = store.store_update(
            s, world.fed, 1, client, update_id, 10, {"loss": value}, _tensors(value), kw.pop("control", None), **kw
        )
        return upd.id, dup


@contextlib.contextmanager
def _statements(db, fragment: str):
    """The statements run on ``db`` meanwhile that contain ``fragment`` (a list that fills as they run)."""
    seen: list[str] = []

    def count(conn, cursor, statement, *rest):
        if fragment in statement:
            seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


def _stored(db, world):
    with db.factory() as s:
        return [(h.client_id, h.update_id, t, c) for h, t, c in store.iter_round_updates(s, world.fed, 1)]


def _insert_copy(conn, world, client: str, update_id: str) -> int:
    """Another copy of ``update_id`` (tensor ``w`` = [1.0]), written straight on ``conn``; its primary key."""
    pk = conn.execute(
        insert(store.Update.__table__).values(
            federation_id=world.fed.id,
            round=1,
            client_id=client,
            update_id=update_id,
            num_samples=5,
            metrics_json={},
            received_at=world.t0,
        )
    ).inserted_primary_key[0]
    conn.execute(
        insert(store.UpdateTensor.__table__).values(
            update_pk=pk, kind="model", name="w", dtype="float32", shape_json=[1], data=b"\x00\x00\x80\x3f"
        )
    )
    return int(pk)


def test_duplicate_update_id_is_acknowledged_and_writes_nothing(db, world):
    a = world.clients[0]
    pk, dup = _push(db, world, a, "u-1", 1.0)
    assert not dup
    pk2, dup2 = _push(db, world, a, "u-1", 9.0)  # a retry; its payload is ignored
    assert dup2 and pk2 == pk
    stored = _stored(db, world)
    assert len(stored) == 1
    np.testing.assert_array_equal(stored[0][2]["w"], np.full((3, 2), 1.0, np.float32))
    with db.factory() as s:
        assert store.count_updates(s, world.fed, 1) == 1
        assert s.scalar(select(store.Update.metrics).where(store.Update.id == pk)) == {"loss": 1.0}


def test_duplicate_in_the_same_transaction(db, world):
    with db.factory.begin() as s:
        first, dup1 = store.store_update(s, world.fed, 1, world.clients[0], "u", 1, {}, _tensors(1))
        second, dup2 = store.store_update(s, world.fed, 1, world.clients[0], "u", 1, {}, _tensors(2))
        assert (dup1, dup2) == (False, True) and first.id == second.id and second.num_samples == 1


def test_race_path_unique_violation_rolls_back_to_savepoint(db, world):
    """Another transaction's copy lands between the duplicate check and the insert (injected right there)."""
    if db.backend == "sqlite":
        pytest.skip("SQLite holds the write lock from BEGIN IMMEDIATE, so no copy can land in between (next test)")
    a = world.clients[0]
    injected: list[int] = []

    def competitor(conn, cursor, statement, parameters, context, executemany):
        if injected or not statement.startswith("SAVEPOINT"):
            return
        injected.append(0)
        injected[0] = _insert_copy(conn, world, a, "u-race")

    event.listen(db.engine, "before_cursor_execute", competitor)
    try:
        pk, dup = _push(db, world, a, "u-race", 7.0)
    finally:
        event.remove(db.engine, "before_cursor_execute", competitor)
    assert injected and pk == injected[0] and dup
    stored = _stored(db, world)
    assert len(stored) == 1
    assert stored[0][2] == {"w": np.array([1.0], np.float32)}  # the winner's tensors, not this call's


def test_sqlite_unique_violation_fails_the_write_instead_of_passing_for_a_duplicate(db, world):
    """SQLite stores without a savepoint (no racing copy is possible); a unique violation there is an error.

    It must not be answered as a duplicate (the row it would find may be this very transaction's),
    and the caller's transaction rolls back whole: nothing is stored.
    """
    if db.backend != "sqlite":
        pytest.skip("PostgreSQL takes the savepoint path (previous test)")
    a = world.clients[0]
    statements: list[str] = []

    def clash(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)
        if statement.startswith("INSERT INTO updates ") and not conn.info.get("clashed"):
            conn.info["clashed"] = True  # the same key, written just before this insert (cannot happen for real)
            _insert_copy(conn, world, a, "u-clash")

    event.listen(db.engine, "before_cursor_execute", clash)
    try:
        with pytest.raises(IntegrityError):
            _push(db, world, a, "u-clash", 7.0)
    finally:
        event.remove(db.engine, "before_cursor_execute", clash)
    assert _stored(db, world) == []
    with db.factory() as s:
        assert s.scalar(select(func.count()).select_from(store.UpdateTensor)) == 0
    assert not [x for x in statements if x.startswith("SAVEPOINT")]  # it would only journal pages on SQLite


def test_concurrent_duplicate_pushes_from_two_engines(db, world):
    """Two replicas store the same update_id at once: one row, one acknowledgement as new, one as duplicate.

    On PostgreSQL the second insert waits on the first's uncommitted unique key and then fails,
    exercising the SAVEPOINT path for real; SQLite serializes the two at BEGIN IMMEDIATE.
    """
    a = world.clients[0]
    other = store.session_factory(db.new_engine())
    savepoint_rollbacks: list[str] = []
    event.listen(
        other.kw["bind"],
        "before_cursor_execute",
        lambda conn, cur, stmt, *rest: savepoint_rollbacks.append(stmt) if stmt.startswith("ROLLBACK TO") else None,
    )
    inserted = threading.Event()
    results: dict[str, bool] = {}

    def first() -> None:
        with db.factory.begin() as s:
            results["first"] = store.store_update(s, world.fed, 1, a, "u-c", 3, {}, _tensors(1))[1]
            inserted.set()
            time.sleep(0.3)  # hold the transaction open while the other replica inserts

    t = threading.Thread(target=first)
    t.start()
    assert inserted.wait(10)
    with other.begin() as s:
        results["second"] = store.store_update(s, world.fed, 1, a, "u-c", 3, {}, _tensors(2))[1]
    t.join()
    assert results == {"first": False, "second": True}
    assert len(_stored(db, world)) == 1
    if db.backend == "postgresql":
        assert savepoint_rollbacks, "the unique-violation path was not taken"


def test_one_update_per_client_and_round(db, world):
    a = world.clients[0]
    _push(db, world, a, "u-a", 1.0)
    with db.factory.begin() as s:
        with pytest.raises(store.UpdateConflict, match="already pushed"):
            store.store_update(s, world.fed, 1, a, "u-a2", 1, {}, _tensors(2))


def test_an_update_id_is_scoped_to_its_client(db, world):
    """PushHeader.update_id is the client's own key: another client's push with the same key is a new update
    (it was refused as "already used"), and a client reusing its key for the next round is refused."""
    a, b, c = world.clients
    _push(db, world, a, "round-1", 1.0)
    assert _push(db, world, b, "round-1", 2.0)[1] is False  # stored, no duplicate
    assert {(cid, uid, float(t["w"][0, 0])) for cid, uid, t, _ in _stored(db, world)} == {
        (a, "round-1", 1.0),
        (b, "round-1", 2.0),
    }
    with db.factory.begin() as s:
        store.close_round(  # it keeps the round's headers until the next close
            s, world.fed, 1, new_tensors={}, intervals={}, round_metrics={}, tensor_metrics=[], transfers=[],
            strategy_state={}, policy_state={}, strategy_tensors={}, next_round=2, now=world.t0,
        )  # fmt: skip
        store.open_round(s, world.fed, 2, world.clients, ["w"], False, world.t0 + timedelta(minutes=9), now=world.t0)
    with db.factory.begin() as s:
        with pytest.raises(store.UpdateConflict, match="already used for this client's update of round 1"):
            store.store_update(s, world.fed, 2, a, "round-1", 1, {}, _tensors(3))
        assert not store.store_update(s, world.fed, 2, c, "round-1", 1, {}, _tensors(3))[1]
    # the schema before held one key per federation: a downgrade says which key it cannot hold, and changes nothing
    with pytest.raises(RuntimeError, match="several clients pushed updates with the id 'round-1'"):
        store.downgrade(db.url, "0007_update_move_scale")
    assert store.current_revision(db.url) == store.head_revision()


def test_refusals_leave_nothing_behind(db, world):
    a = world.clients[0]
    with db.factory.begin() as s:
        outsider, _ = store.register_client(s, world.fed, {}, 1.0)
    with db.factory.begin() as s:
        with pytest.raises(store.NotInCohort):
            store.store_update(s, world.fed, 1, outsider.id, "x1", 1, {}, _tensors(1))
        with pytest.raises(store.NotFound):
            store.store_update(s, world.fed, 2, a, "x2", 1, {}, _tensors(1))
        with pytest.raises(CodecError, match="NaN"):
            store.store_update(s, world.fed, 1, a, "x3", 1, {}, {"w": np.array([np.nan], np.float32)})
        with pytest.raises(ValueError, match="metric"):
            store.store_update(s, world.fed, 1, a, "x4", 1, {"loss": float("inf")}, _tensors(1))
        with pytest.raises(ValueError, match="num_samples"):
            store.store_update(s, world.fed, 1, a, "x5", 0, {}, _tensors(1))
    assert _stored(db, world) == []
    with db.factory.begin() as s:
        store.abandon_round(s, world.fed, 1)
    with db.factory.begin() as s:
        with pytest.raises(store.RoundStateError, match="abandoned"):
            store.store_update(s, world.fed, 1, a, "x6", 1, {}, _tensors(1))


def test_iter_round_updates_in_client_order_one_at_a_time(db, world):
    control = {"w": np.full((3, 2), -1.0, np.float32)}
    for i, cid in enumerate(reversed(world.clients)):  # arrival order is the reverse of id order
        _push(db, world, cid, f"u-{i}", float(i), control=control if i == 0 else None)

    with _statements(db, "FROM update_tensors") as blob_reads, db.factory() as s:
        it = store.iter_round_updates(s, world.fed, 1)
        header, tensors, deltas = next(it)
        assert len(blob_reads) == 1  # only the first update's tensors were read
        assert header.client_id == world.clients[0]
        rest = list(it)
    assert len(blob_reads) == 3
    order = [header.client_id] + [h.client_id for h, _, _ in rest]
    assert order == world.clients
    everything = [(header, tensors, deltas), *rest]
    by_client = {h.client_id: (t, c) for h, t, c in everything}
    last = world.clients[-1]  # pushed first (i = 0), with the control delta
    np.testing.assert_array_equal(by_client[last][1]["w"], control["w"])
    assert all(by_client[c][1] is None for c in world.clients[:-1])
    assert all(set(t) == {"w", "n"} for t, _ in by_client.values())
    assert by_client[world.clients[0]][0]["n"].dtype == np.int64
    with db.factory() as s:
        assert store.reported_clients(s, world.fed, 1) == sorted(world.clients)


def test_lazy_updates_read_a_tensor_when_it_is_looked_up(db, world):
    """``lazy=True`` (what a close folds from): headings only up front, one row per lookup, nothing kept;
    the values are the pushed ones, byte for byte, including the 0-d tensor and the control delta."""
    pushed = {cid: {**_tensors(float(i)), "step": np.array(7 + i, np.int64)} for i, cid in enumerate(world.clients)}
    control = {"w": np.full((3, 2), -1.5, np.float32)}
    for i, cid in enumerate(world.clients):
        with db.factory.begin() as s:
            store.store_update(s, world.fed, 1, cid, f"u-{i}", 10, {}, pushed[cid], control if i == 1 else None)
    with _statements(db, "update_tensors.data") as reads, db.factory() as s:
        for header, tensors, deltas in store.iter_round_updates(s, world.fed, 1, lazy=True):
            assert reads == []  # shapes without a blob
            assert tensors.shapes == {"n": (1,), "step": (), "w": (3, 2)}
            assert "w" in tensors and "nothing" not in tensors and reads == []  # membership reads no blob
            for name, array in pushed[header.client_id].items():
                got = tensors[name]
                assert got.shape == array.shape and got.dtype == array.dtype and got.tobytes() == array.tobytes()
            assert len(reads) == 3  # one row per lookup
            assert tensors["w"] is not tensors["w"] and len(reads) == 5  # never cached: read again
            reads.clear()
            if header.client_id == world.clients[1]:
                assert deltas is not None and set(deltas) == {"w"}
                assert deltas["w"].tobytes() == control["w"].tobytes()
                reads.clear()
            else:
                assert deltas is None


def test_push_racing_a_close_is_refused_not_lost(db, world):
    """The coordinator holds the round lock while it aggregates; a push arriving then waits and is refused."""
    a, b, _ = world.clients
    _push(db, world, a, "u-a", 1.0)
    locked = threading.Event()
    outcome: dict[str, object] = {}

    def coordinator() -> None:
        with db.factory.begin() as s:
            store.lock_round(s, world.fed, 1)
            outcome["consumed"] = [h.client_id for h, _, _ in store.iter_round_updates(s, world.fed, 1)]
            locked.set()
            time.sleep(0.3)
            store.close_round(
                s,
                world.fed,
                1,
                new_tensors={},
                intervals={},
                round_metrics={},
                tensor_metrics=[],
                transfers=[],
                strategy_state={},
                policy_state={},
                strategy_tensors={},
                next_round=2,
            )

    t = threading.Thread(target=coordinator)
    t.start()
    assert locked.wait(10)
    late = store.session_factory(db.new_engine())
    with pytest.raises(store.RoundStateError, match="closed"):
        with late.begin() as s:
            store.store_update(s, world.fed, 1, b, "u-b", 1, {}, _tensors(2))
    t.join()
    assert outcome["consumed"] == [a]
    with db.factory() as s:
        rnd = store.get_round(s, world.fed, 1)
        assert rnd is not None and (rnd.state, rnd.reported, rnd.stragglers) == ("closed", 1, 2)
        assert store.reported_clients(s, world.fed, 1) == [a]  # the consumed header; b's update never landed


def _large_update() -> dict[str, np.ndarray]:
    """Tensors on both sides of ``IN_PLACE_BYTES`` (and one exactly on it), random so any misplaced byte shows."""
    rng = np.random.default_rng(7)
    edge = store.repository.rounds.IN_PLACE_BYTES // 4
    return {
        "big": rng.standard_normal((3, edge // 2 + 5)).astype(np.float32),  # 1.5 MiB and a bit
        "edge": rng.standard_normal(edge).astype(np.float32),  # exactly IN_PLACE_BYTES
        "small": rng.standard_normal((4, 7)).astype(np.float32),
        "ids": np.arange(10, dtype=np.int64),
    }


def test_large_tensors_read_back_exactly(db, world):
    """On SQLite tensors of IN_PLACE_BYTES and more are written through a blob handle; both backends
    return every byte (the store must not care how a row was written)."""
    tensors = _large_update()
    control = {"big": -tensors["big"]}
    inserts: list[str] = []

    def watch(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO update_tensors"):
            inserts.append(statement)

    event.listen(db.engine, "before_cursor_execute", watch)
    try:
        with db.factory.begin() as s:
            store.store_update(s, world.fed, 1, world.clients[0], "u-large", 10, {}, tensors, control)
    finally:
        event.remove(db.engine, "before_cursor_execute", watch)
    with db.factory() as s:
        [(_, got, got_control)] = list(store.iter_round_updates(s, world.fed, 1))
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name
    assert got_control is not None and got_control["big"].tobytes() == control["big"].tobytes()
    in_place = [x for x in inserts if "zeroblob" in x]
    assert len(in_place) == (3 if db.backend == "sqlite" else 0)  # big, edge, control big


def test_a_failed_in_place_write_stores_nothing(db, world):
    """A write that fails after some tensors are in their rows rolls back with the whole update."""
    if db.backend != "sqlite":
        pytest.skip("only SQLite writes tensors through blob handles")
    seen = []

    def fail_second(conn, cursor, statement, parameters, context, executemany):
        if "zeroblob" in statement:
            seen.append(statement)
            if len(seen) == 2:
                raise RuntimeError("disk gone")

    event.listen(db.engine, "before_cursor_execute", fail_second)
    try:
        with pytest.raises(RuntimeError, match="disk gone"):
            with db.factory.begin() as s:
                store.store_update(s, world.fed, 1, world.clients[0], "u-large", 10, {}, _large_update())
    finally:
        event.remove(db.engine, "before_cursor_execute", fail_second)
    assert _stored(db, world) == []
    with db.factory() as s:
        assert s.scalar(select(func.count()).select_from(store.UpdateTensor)) == 0
        assert s.scalar(select(func.count()).select_from(store.Update)) == 0
