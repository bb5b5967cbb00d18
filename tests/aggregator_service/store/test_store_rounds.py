"""Rounds: open/extend/abandon, and close_round — all or nothing, and durable across a restart."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError

from aggregator_service import store

W0 = np.arange(6, dtype=np.float32).reshape(2, 3)


def _seed_round(db, world) -> None:
    """Global model at version 0, and updates from two of the three cohort members."""
    with db.factory.begin() as s:
        store.save_global_tensors(s, world.fed, {"w": (W0, 0, 1), "b": (np.zeros(2, np.int64), 0, 1)})
        for i, cid in enumerate(world.clients[:2]):
            store.store_update(s, world.fed, 1, cid, f"u{i}", 10 + i, {"acc": 0.5}, {"w": W0 + i}, None)
            store.record_transfer(s, world.fed, 1, cid, "down", 100)


def _close_kwargs(world, **overrides):
    kwargs = dict(
        new_tensors={"w": (W0 + 0.5, 1, 2)},
        intervals={"w": 2, "b": 4},
        round_metrics={"test_accuracy": 0.9, "latent_clients": 2, "extra": {"note": "ok"}},
        tensor_metrics=[
            {"name": "w", "role": "coefficients", "d_l": 0.1, "dispersion": 0.2, "interval": 2, "version": 1},
            {"name": "b", "role": "buffer", "interval": 4, "bytes_down": 16},
        ],
        transfers=[
            {"client_id": world.clients[0], "direction": "up", "bytes": 24},
            {"client_id": world.clients[1], "direction": "up", "bytes": 24},
            {"client_id": world.clients[0], "direction": "up", "bytes": 1},
        ],
        strategy_state={"step": 1},
        policy_state={"policy": "fixed", "last_observed": 1},
        strategy_tensors={"w": np.ones((2, 3), np.float32)},
        next_round=2,
        now=world.t0 + timedelta(seconds=90),
    )
    kwargs.update(overrides)
    return kwargs


def _snapshot(db, world) -> dict[str, object]:
    with db.factory() as s:
        fed = store.get_federation(s, world.fed.name)
        rnd = store.get_round(s, world.fed, 1)
        assert fed is not None and rnd is not None
        tensors = store.load_global_tensors(s, world.fed)
        return {
            "tensors": {n: (a.tolist(), v, i) for n, (a, v, i) in tensors.items()},
            "round": (rnd.state, rnd.closed_at, rnd.reported),
            "updates": [h.update_id for h, _, _ in store.iter_round_updates(s, world.fed, 1)],
            "fed": (fed.state, fed.current_round, fed.strategy_state, fed.policy_state),
            "strategy": {n: a.tolist() for n, a in store.load_strategy_tensors(s, world.fed).items()},
            "metrics": s.scalar(select(func.count()).select_from(store.RoundMetrics)),
            "tensor_metrics": s.scalar(select(func.count()).select_from(store.TensorMetric)),
            "transfers": [(t.client_id, t.direction, t.bytes) for t in store.round_transfers(s, world.fed, 1)],
            "joined": sorted(c.rounds_joined for c in store.list_clients(s, world.fed)),
            "bytes": sorted((c.bytes_up, c.bytes_down) for c in store.list_clients(s, world.fed)),
        }


def test_close_round_writes_everything(db, world):
    _seed_round(db, world)
    a, b, c = world.clients
    with db.factory.begin() as s:
        loaded = store.get_client(s, a)  # loaded before the close, in the same session
        rnd = store.close_round(s, world.fed, 1, **_close_kwargs(world))
        assert rnd.state == "closed"
        assert loaded is not None and (loaded.rounds_joined, loaded.bytes_up) == (1, 25)  # kept in sync
    with db.factory() as s:
        rnd = store.get_round(s, world.fed, 1)
        assert rnd is not None
        assert (rnd.state, rnd.reported, rnd.stragglers) == ("closed", 2, 1)
        assert rnd.closed_at == world.t0 + timedelta(seconds=90)
        # the consumed updates' tensors are gone; their headers stay until the next close (late retries)
        assert store.count_updates(s, world.fed, 1) == 2
        assert s.scalar(select(func.count()).select_from(store.UpdateTensor)) == 0
        tensors = store.load_global_tensors(s, world.fed)
        np.testing.assert_array_equal(tensors["w"][0], W0 + 0.5)
        assert tensors["w"][1:] == (1, 2) and tensors["b"][1:] == (0, 4)
        fed = store.get_federation(s, world.fed.name)
        assert fed is not None
        assert (fed.state, fed.current_round) == ("running", 2)
        assert fed.strategy_state == {"step": 1} and fed.policy_state["last_observed"] == 1
        np.testing.assert_array_equal(store.load_strategy_tensors(s, world.fed)["w"], np.ones((2, 3)))

        [(r, m)] = store.list_rounds(s, world.fed)
        assert r.number == 1 and m is not None
        assert (m.test_accuracy, m.latent_clients, m.extra) == (0.9, 2, {"note": "ok"})
        assert (m.bytes_up, m.bytes_down, m.duration_seconds) == (49, 200, 90.0)
        assert m.test_loss is None
        tm = store.round_tensor_metrics(s, world.fed, 1)
        assert [(t.name, t.ordinal, t.interval) for t in tm] == [("w", 0, 2), ("b", 1, 4)]
        assert (tm[0].d_l, tm[0].bytes_up, tm[1].bytes_down, tm[1].d_l) == (0.1, 0, 16, None)
        assert [t.round for t in store.tensor_metric_history(s, world.fed, "w")] == [1]
        transfers = {(t.client_id, t.direction): t.bytes for t in store.round_transfers(s, world.fed, 1)}
        assert transfers == {(a, "down"): 100, (b, "down"): 100, (a, "up"): 25, (b, "up"): 24}
        clients = {x.id: x for x in store.list_clients(s, world.fed)}
        assert (clients[a].rounds_joined, clients[b].rounds_joined, clients[c].rounds_joined) == (1, 1, 0)
        assert (clients[a].bytes_up, clients[a].bytes_down, clients[c].bytes_down) == (25, 100, 0)


def test_close_round_is_atomic_when_a_constraint_fails_midway(db, world):
    _seed_round(db, world)
    before = _snapshot(db, world)
    executed: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda c, cur, stmt, *r: executed.append(stmt.split()[0]))
    ghost = [{"client_id": "no-such-client", "direction": "up", "bytes": 1}]  # violates the clients foreign key
    with pytest.raises(IntegrityError):
        with db.factory.begin() as s:
            store.close_round(s, world.fed, 1, **_close_kwargs(world, transfers=ghost))
    # the failure came after the tensors, the round and the updates had been written
    assert {"UPDATE", "DELETE", "INSERT"} <= set(executed)
    assert _snapshot(db, world) == before


def test_close_round_is_atomic_when_the_caller_fails_after_it(db, world):
    _seed_round(db, world)
    before = _snapshot(db, world)
    with pytest.raises(RuntimeError, match="crash"):
        with db.factory.begin() as s:
            store.close_round(s, world.fed, 1, **_close_kwargs(world))
            assert s.scalar(select(func.count()).select_from(store.UpdateTensor)) == 0  # written, not committed
            raise RuntimeError("crash before commit")
    assert _snapshot(db, world) == before


def test_close_round_validates_before_writing(db, world):
    _seed_round(db, world)
    before = _snapshot(db, world)
    bad = [
        ({"round_metrics": {"accuracy": 1.0}}, "unknown round metrics"),
        ({"intervals": {"nope": 2}}, "not global tensors"),
        ({"transfers": [{"client_id": "x", "direction": "sideways", "bytes": 1}]}, "direction"),
        ({"tensor_metrics": [{"name": "w", "d_l": float("nan")}]}, "finite"),
        ({"tensor_metrics": [{"name": "w"}, {"name": "w"}]}, "twice"),
        ({"next_round": 1}, "next_round"),
        ({"policy_state": {"d": float("inf")}}, "standard JSON"),
    ]
    for override, message in bad:
        with pytest.raises(ValueError, match=message):
            with db.factory.begin() as s:
                store.close_round(s, world.fed, 1, **_close_kwargs(world, **override))
    assert _snapshot(db, world) == before


def test_closed_round_survives_a_restart(db, world):
    _seed_round(db, world)
    with db.factory.begin() as s:
        store.close_round(s, world.fed, 1, **_close_kwargs(world, next_round=None))
    db.engine.dispose()  # the aggregator process goes away
    restarted = store.session_factory(db.new_engine())
    with restarted() as s:
        fed = store.get_federation(s, world.fed.name)
        assert fed is not None and fed.state == "done"
        rnd = store.get_round(s, fed, 1)
        assert rnd is not None and rnd.state == "closed" and rnd.closed_at is not None
        assert rnd.closed_at.utcoffset() == timedelta(0)
        assert store.get_open_round(s, fed) is None
        np.testing.assert_array_equal(store.load_global_tensors(s, fed)["w"][0], W0 + 0.5)
        [(_, metrics)] = store.list_rounds(s, fed)
        assert metrics is not None and metrics.test_accuracy == 0.9


def test_closing_twice_is_refused(db, world):
    _seed_round(db, world)
    with db.factory.begin() as s:
        store.close_round(s, world.fed, 1, **_close_kwargs(world))
    with db.factory.begin() as s:
        with pytest.raises(store.RoundStateError, match="closed"):
            store.close_round(s, world.fed, 1, **_close_kwargs(world))
        with pytest.raises(store.NotFound):
            store.close_round(s, world.fed, 9, **_close_kwargs(world, next_round=10))


def test_open_extend_abandon(db, world):
    t0 = world.t0
    with db.factory.begin() as s:
        with pytest.raises(store.RoundStateError, match="still open"):
            store.open_round(s, world.fed, 2, world.clients, [], True, t0)
        rnd = store.extend_round(s, world.fed, 1, t0 + timedelta(minutes=30))
        assert rnd.extended and rnd.deadline == t0 + timedelta(minutes=30)
        store.store_update(s, world.fed, 1, world.clients[0], "u", 1, {}, {"w": W0})
    with db.factory.begin() as s:
        rnd = store.abandon_round(s, world.fed, 1, now=t0 + timedelta(hours=1))
        assert (rnd.state, rnd.reported, rnd.stragglers) == ("abandoned", 1, 2)
        assert store.count_updates(s, world.fed, 1) == 0
        with pytest.raises(store.RoundStateError):
            store.extend_round(s, world.fed, 1, t0)
        with pytest.raises(store.RoundStateError, match="not new"):
            store.open_round(s, world.fed, 1, world.clients, [], False, t0)
        rnd2 = store.open_round(s, world.fed, 2, world.clients[:2], ["w", "b"], True, t0 + timedelta(hours=2))
        assert rnd2.continue_unsynced and rnd2.due == ["w", "b"]
    with db.factory() as s:
        open_now = store.get_open_round(s, world.fed)
        assert open_now is not None and open_now.number == 2 and open_now.cohort == world.clients[:2]
        fed = store.get_federation(s, world.fed.name)
        assert fed is not None and fed.current_round == 2
        assert [(r.number, r.state, m) for r, m in store.list_rounds(s, world.fed, newest_first=True)] == [
            (2, "open", None),
            (1, "abandoned", None),
        ]


def test_one_open_round_even_across_replicas(db, world):
    """The partial unique index refuses a second open round written behind the repository's back."""
    with pytest.raises(IntegrityError):
        with db.factory.begin() as s:
            s.add(
                store.Round(
                    federation_id=world.fed.id,
                    number=5,
                    state="open",
                    cohort=[],
                    due=[],
                    continue_unsynced=False,
                    deadline=world.t0,
                    extended=False,
                    opened_at=world.t0,
                    reported=0,
                    stragglers=0,
                )
            )


def test_evaluations(db, world):
    a, b, _ = world.clients
    with db.factory.begin() as s:
        assert store.record_evaluation(
            s, world.fed, 1, a, global_accuracy=0.6, global_loss=0.9, personalized_accuracy=0.7, num_samples=10
        )
        assert store.record_evaluation(s, world.fed, 1, b, global_accuracy=0.8, global_loss=0.5, num_samples=30)
        again = store.record_evaluation(s, world.fed, 1, a, global_accuracy=0.1, global_loss=3.0, num_samples=10)
        assert again is False  # the first report stands
        with pytest.raises(store.NotFound):
            store.record_evaluation(s, world.fed, 7, a, global_accuracy=0.1, global_loss=0.1)
        with pytest.raises(ValueError, match="finite"):
            store.record_evaluation(s, world.fed, 1, a, global_accuracy=float("nan"), global_loss=0.1)
    with db.factory() as s:
        evals = store.round_evaluations(s, world.fed, 1)
        assert [(e.client_id, e.global_accuracy) for e in evals] == sorted([(a, 0.6), (b, 0.8)])
        summary = store.evaluation_summary(s, world.fed, 1)
        assert summary["clients"] == 2
        assert summary["mean_client_accuracy"] == pytest.approx((0.6 * 10 + 0.8 * 30) / 40)
        assert summary["personalized_accuracy"] == pytest.approx(0.7)
        client_a, client_b = store.get_client(s, a), store.get_client(s, b)
        assert client_a is not None and client_b is not None
        assert (client_a.last_accuracy, client_b.last_accuracy) == (0.7, 0.8)


def _late_pushes(db, world, number: int) -> int:
    with db.factory() as s:
        rnd = store.get_round(s, world.fed, number)
        assert rnd is not None
        return rnd.late_pushes


def test_late_pushes_are_counted_and_a_consumed_update_answers_its_retry(db, world):
    """A close keeps its updates' headers (not their tensors) until the next close: a retry of a consumed
    update finds it; any other push of a cohort member to the closed round is counted as late."""
    _seed_round(db, world)
    a, b, c = world.clients
    with db.factory.begin() as s:
        store.close_round(s, world.fed, 1, **_close_kwargs(world))
    with db.factory.begin() as s:
        consumed = store.refuse_late_push(s, world.fed, 1, a, "u0")
        assert consumed is not None and (consumed.client_id, consumed.round, consumed.num_samples) == (a, 1, 10)
        assert store.refuse_late_push(s, world.fed, 1, b, "u0") is None  # a's id, b's push: not the same update
        assert store.refuse_late_push(s, world.fed, 1, c, "u-late") is None  # the straggler
        assert store.refuse_late_push(s, world.fed, 1, "not-in-the-cohort", "u-x") is None  # counts nothing
        assert store.refuse_late_push(s, world.fed, 9, c, "u-y") is None  # no such round: counts nothing
    assert _late_pushes(db, world, 1) == 2

    # round 2 closes: round 1's headers go, so the retry is late now; round 2's headers stay
    with db.factory.begin() as s:
        store.open_round(s, world.fed, 2, [a, c], ["w"], False, world.t0 + timedelta(hours=1), now=world.t0)
        store.store_update(s, world.fed, 2, c, "u2", 5, {}, {"w": W0}, None)
        store.close_round(s, world.fed, 2, **_close_kwargs(world, next_round=3, transfers=[]))
    with db.factory.begin() as s:
        assert store.count_updates(s, world.fed, 1) == 0 and store.count_updates(s, world.fed, 2) == 1
        assert store.refuse_late_push(s, world.fed, 1, a, "u0") is None
        assert store.refuse_late_push(s, world.fed, 2, c, "u2") is not None
        assert store.refuse_late_push(s, world.fed, 2, a, "u-late-2") is None  # round 2's straggler
    assert (_late_pushes(db, world, 1), _late_pushes(db, world, 2)) == (3, 1)


def test_an_abandoned_round_keeps_no_headers_and_counts_late_pushes(db, world):
    _seed_round(db, world)
    a, _, c = world.clients
    with db.factory.begin() as s:
        store.abandon_round(s, world.fed, 1, now=world.t0)
    with db.factory.begin() as s:
        assert store.count_updates(s, world.fed, 1) == 0
        assert store.refuse_late_push(s, world.fed, 1, a, "u0") is None  # never aggregated: no duplicate
        assert store.refuse_late_push(s, world.fed, 1, c, "u-late") is None
    assert _late_pushes(db, world, 1) == 2
