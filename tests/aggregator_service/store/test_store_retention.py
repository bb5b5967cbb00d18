"""``prune_history``: old rounds lose their per-client and per-tensor rows, never their totals."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select, update

from aggregator_service import store
from aggregator_service.store.repository import retention


def _close(db, world, number: int) -> None:
    """Round ``number``: every client fetches 100 bytes (tensor ``w``), evaluates the round before, and it closes."""
    a, b, c = world.clients
    t = world.t0 + timedelta(minutes=number)
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        if number > 1:
            store.open_round(s, fed, number, world.clients, ["w"], False, t + timedelta(minutes=5), now=t)
        store.record_transfers(s, fed, [(number, x, "train_fetch", 100, {"w": 100}, 1000) for x in (a, b, c)])
        store.close_round(
            s,
            fed,
            number,
            new_tensors={"w": (np.full(2, number, np.float32), number, 1)},
            intervals={"w": 1},
            round_metrics={},
            tensor_metrics=[{"name": "w", "role": "body", "interval": 1, "version": number}],
            transfers=[],
            strategy_state={},
            policy_state={},
            strategy_tensors={},
            next_round=number + 1,
            now=t + timedelta(seconds=30),
        )
    with db.factory.begin() as s:  # a and b evaluate: 0.5 on 10 samples and 0.8 on 30
        fed = store.get_federation(s, world.fed.name)
        for x, acc, n in ((a, 0.5, 10), (b, 0.8, 30)):
            assert store.record_evaluation(s, fed, number, x, global_accuracy=acc, global_loss=1.0, num_samples=n)


def _rounds_with_rows(db, table) -> set[int]:
    with db.factory() as s:
        return set(s.scalars(select(table.round).distinct()))


def test_old_rounds_keep_their_totals_and_late_reports_add_to_them(db, world):
    for number in (1, 2, 3):
        _close(db, world, number)
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        assert store.prune_history(s, fed, last_closed=3, keep_rounds=1) == 2
    for table in (store.Transfer, store.Evaluation, store.TensorMetric):
        assert _rounds_with_rows(db, table) == {3}, table.__tablename__
    with db.factory() as s:
        for number in (1, 2):
            m = s.get(store.RoundMetrics, (world.fed.id, number))
            assert m.mean_client_accuracy == pytest.approx((0.5 * 10 + 0.8 * 30) / 40)  # 0.725, by hand
            assert m.extra["evaluations"] == 2
        bytes_ = {
            (r, c): b
            for r, c, b in s.execute(select(store.RoundBytes.round, store.RoundBytes.category, store.RoundBytes.bytes))
        }
        assert bytes_ == {(1, "train_fetch"): 300, (2, "train_fetch"): 300, (3, "train_fetch"): 300}

    a, c = world.clients[0], world.clients[2]
    with db.factory.begin() as s:  # late: c's evaluation and eval fetch of round 2, after its history went
        fed = store.get_federation(s, world.fed.name)
        assert store.record_evaluation(s, fed, 2, c, global_accuracy=0.0, global_loss=9.0, num_samples=1000)
        store.record_transfers(s, fed, [(2, c, "eval_fetch", 40, {"w": 40}, 1000)])
    with db.factory.begin() as s:  # retries: c's of round 2, a's of round 2 (it has reported round 3 since)
        fed = store.get_federation(s, world.fed.name)
        assert not store.record_evaluation(s, fed, 2, c, global_accuracy=0.0, global_loss=9.0, num_samples=1000)
        assert not store.record_evaluation(s, fed, 2, a, global_accuracy=0.5, global_loss=1.0, num_samples=10)
        assert not store.record_evaluation(s, fed, 1, c, global_accuracy=0.1, global_loss=1.0, num_samples=10)
    for table in (store.Transfer, store.Evaluation, store.TensorMetric):
        assert _rounds_with_rows(db, table) == {3}, table.__tablename__
    with db.factory() as s:
        m2 = s.get(store.RoundMetrics, (world.fed.id, 2))
        assert m2.mean_client_accuracy == pytest.approx((0.5 * 10 + 0.8 * 30 + 0.0 * 1000) / 1040)  # by hand
        assert m2.extra["evaluations"] == 3
        assert s.get(store.RoundMetrics, (world.fed.id, 1)).extra["evaluations"] == 2
        assert s.get(store.RoundBytes, (world.fed.id, 2, "eval_fetch")).bytes == 40
        assert s.get(store.Client, c).bytes_down == 3 * 100 + 40  # its lifetime counter has every byte
        assert s.get(store.Client, c).last_accuracy == 0.0

    with db.factory.begin() as s:  # nothing newer to prune: the same watermark
        fed = store.get_federation(s, world.fed.name)
        assert store.prune_history(s, fed, last_closed=3, keep_rounds=1) == 2


def test_a_round_pruned_before_anyone_evaluated_it_takes_late_reports(db, world):
    """Round 1 is pruned with no evaluation yet (reports come after the close): late ones make its figures."""
    _close(db, world, 1)
    with db.factory.begin() as s:
        s.execute(store.Evaluation.__table__.delete())  # as if nobody had reported round 1 yet
        s.execute(update(store.Client).values(evaluated_through=0))
    a, b, _ = world.clients
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        assert store.prune_history(s, fed, last_closed=2, keep_rounds=1) == 1
        m = s.get(store.RoundMetrics, (fed.id, 1))
        assert m.mean_client_accuracy is None and m.extra["evaluations"] == 0
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        assert store.record_evaluation(s, fed, 1, a, global_accuracy=0.5, global_loss=1.0, num_samples=10)
        assert store.record_evaluation(
            s, fed, 1, b, global_accuracy=0.8, global_loss=2.0, personalized_accuracy=0.9, num_samples=30
        )
    with db.factory() as s:
        m = s.get(store.RoundMetrics, (world.fed.id, 1))
        assert m.mean_client_accuracy == pytest.approx(0.725)
        assert m.personalized_accuracy == pytest.approx(0.9)
        assert m.extra["evaluations"] == 2


def test_upgrading_counts_no_report_for_rounds_pruned_before(db, world):
    """0009 sets each client's evaluated_through to its latest evaluated round and at least to what its
    federation pruned: those rounds kept no sums, so a report for one stays refused."""
    for number in (1, 2, 3):
        _close(db, world, number)
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        store.prune_history(s, fed, last_closed=3, keep_rounds=1)
    store.downgrade(db.url, "0008_update_id_per_client")
    store.upgrade(db.url)
    with db.factory() as s:
        got = {cid: s.get(store.Client, cid).evaluated_through for cid in world.clients}
    a, b, c = world.clients
    assert got == {a: 3, b: 3, c: 2}


def test_a_long_backlog_is_pruned_over_several_closes(db, world, monkeypatch):
    monkeypatch.setattr(retention, "MAX_ROUNDS_PER_PRUNE", 2)
    for number in range(1, 7):
        _close(db, world, number)
    seen = []
    for _ in range(3):
        with db.factory.begin() as s:
            fed = store.get_federation(s, world.fed.name)
            seen.append(store.prune_history(s, fed, last_closed=6, keep_rounds=1))
    assert seen == [2, 4, 5]
    assert _rounds_with_rows(db, store.Transfer) == {6}


def test_downgrade_below_the_pruning_is_refused(db, world):
    _close(db, world, 1)
    _close(db, world, 2)
    store.downgrade(db.url, "0005_transfer_categories")  # nothing pruned yet: allowed, and back up
    store.upgrade(db.url)
    with db.factory.begin() as s:
        fed = store.get_federation(s, world.fed.name)
        store.prune_history(s, fed, last_closed=2, keep_rounds=1)
    with pytest.raises(RuntimeError, match="pruned old rounds"):
        store.downgrade(db.url, "0005_transfer_categories")
    assert store.current_revision(db.url) == store.head_revision()
