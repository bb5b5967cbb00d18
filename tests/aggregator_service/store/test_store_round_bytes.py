"""``round_bytes``: each round's sums per category, always equal to the ``transfers`` rows they sum."""

from __future__ import annotations

import random
from datetime import timedelta

import numpy as np
from sqlalchemy import func, select

from aggregator_service import store


def _round_bytes(db) -> dict[tuple[int, str], tuple[int, int]]:
    b = store.RoundBytes
    with db.factory() as s:
        rows = s.execute(select(b.round, b.category, b.bytes, b.fedavg_equivalent_bytes)).all()
    return {(r, c): (n, f) for r, c, n, f in rows}


def _transfers_grouped(db) -> dict[tuple[int, str], tuple[int, int]]:
    t = store.Transfer
    with db.factory() as s:
        rows = s.execute(
            select(t.round, t.category, func.sum(t.bytes), func.sum(t.fedavg_equivalent_bytes)).group_by(
                t.round, t.category
            )
        ).all()
    return {(r, c): (int(n), int(f)) for r, c, n, f in rows}


def test_a_rounds_sums_by_hand_through_fetches_a_close_and_a_late_evaluation(db, world):
    a, b, c = world.clients
    with db.factory.begin() as s:
        store.save_global_tensors(s, world.fed, {"w": (np.zeros(2, np.float32), 0, 1)})
        store.record_transfers(
            s,
            world.fed,
            [(1, a, "train_fetch", 100, {}, 1000), (1, b, "down", 100, {}, 1000), (1, a, "up", 24, {}, 1000)],
        )
        store.record_transfer(s, world.fed, 1, a, "train_fetch", 5)  # a resumed fetch adds to a's row
    with db.factory.begin() as s:  # a write that fails changes neither table
        store.record_transfer(s, world.fed, 1, c, "push", 999, fedavg_equivalent_bytes=1000)
        s.rollback()
    with db.factory.begin() as s:
        store.close_round(
            s,
            world.fed,
            1,
            new_tensors={"w": (np.ones(2, np.float32), 1, 1)},
            intervals={"w": 1},
            round_metrics={},
            tensor_metrics=[],
            transfers=[{"client_id": b, "direction": "up", "bytes": 30}],
            strategy_state={},
            policy_state={},
            strategy_tensors={},
            next_round=2,
            now=world.t0 + timedelta(seconds=60),
        )
    with db.factory() as s:  # the close's snapshot: 100 + 5 + 100 down; 24 + 30 up; three transfers' baseline
        m = s.get(store.RoundMetrics, (world.fed.id, 1))
        assert (m.bytes_down, m.bytes_up, m.fedavg_equivalent_bytes) == (205, 54, 3000)
    with db.factory.begin() as s:  # evaluating the closed round counts toward it
        store.record_transfer(s, world.fed, 1, c, "eval_fetch", 40, fedavg_equivalent_bytes=1000)
    expected = {(1, "train_fetch"): (205, 2000), (1, "push"): (54, 1000), (1, "eval_fetch"): (40, 1000)}
    assert _round_bytes(db) == expected
    assert _transfers_grouped(db) == expected


def test_many_writers_worth_of_transfers_sum_to_the_ledger(db, world):
    """Random batches, some rolled back, with repeated keys within a batch: the sums stay the ledger's."""
    rng = random.Random(7)
    for batch in range(30):
        moves = [
            (
                1,
                rng.choice(world.clients),
                rng.choice(("train_fetch", "eval_fetch", "push", "down", "up")),
                rng.randrange(10**9),
                {},
                rng.randrange(10**9),
            )
            for _ in range(rng.randrange(1, 12))
        ]
        with db.factory.begin() as s:
            store.record_transfers(s, world.fed, moves)
            if batch % 4 == 3:
                s.rollback()
    got = _round_bytes(db)
    assert got == _transfers_grouped(db)
    assert sum(n for n, _ in got.values()) > 2**32  # past 32 bits: BigInteger on both backends
