"""One round end to end over real gRPC, equal to the in-process engine; partial fetch; quorum and deadlines."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest
import torch
from grpc_helpers import fill_keys, global_tensors, offline_round, register, shards, small_federation, snapshot
from sqlalchemy import func, select

from aggregator_service import store
from aggregator_service.rounds import RoundPlan
from fedwire.v1 import aggregator_pb2 as pb


def _happy_path(start_service, url: str) -> None:
    svc = start_service(url)
    data = shards(2)
    clients = [register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])]
    fill_keys(url, clients)
    tasks = {c.client_id: c.task() for c in clients}
    assert all(t.WhichOneof("kind") == "train" for t in tasks.values())
    plan = svc.coordinator.open_round
    assert plan is not None and plan.round == 1 and set(plan.cohort) == {c.key for c in clients}
    # the task for the 1/4 tier names its factors; the seed is the simulator's
    low = next(c for c in clients if c.tier == 0.25)
    assert "conv2.coefficients_u" in tasks[low.client_id].train.due_tensors

    replies = []
    for c in clients:
        assert c.fetch() > 0
        push = c.train(tasks[c.client_id])
        replies.append(c.push(1, push.tensors, num_samples=push.num_samples, metrics=push.metrics))
    assert all(r.accepted and not r.duplicate and r.round == 1 for r in replies)
    assert svc.coordinator.open_round is None  # the whole cohort reported: round 1 closed

    offline = offline_round(svc.settings.federation, plan, clients, num_clients_total=2)
    served = global_tensors(url)
    for name, tensor in offline.global_tensors.items():
        got, version = served[name]
        assert version == 1, name
        assert torch.allclose(got, tensor, atol=1e-6, rtol=0), name
    # clients fetch round 1's tensors, shaped for their tiers
    assert all(c.fetch() > 0 for c in clients)
    assert low.state.versions["conv2.coefficients_u"] == 1
    assert tuple(low.state.global_tensors["conv2.coefficients_u"].shape) == (64, 16)


def test_round_over_grpc_equals_in_process_engine_sqlite(start_service, sqlite_url) -> None:
    """The close reads every update back from the store: the result is the in-process engine's."""
    _happy_path(start_service, sqlite_url)


def test_round_over_grpc_equals_in_process_engine_postgres(start_service, postgres_url) -> None:
    _happy_path(start_service, postgres_url)


def test_partial_fetch_sends_nothing_the_client_holds(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    data = shards(2, 50)
    a = register(svc.stub, 0.25, data[0])
    register(svc.stub, 1.0, data[1])
    assert a.fetch() > 0
    assert a.fetch() == 0  # holds every current version: the stream ends without a byte
    # holding all but one tensor fetches exactly that one
    held = [pb.TensorVersion(name=n, version=v) for n, v in a.state.versions.items() if n != "head.bias"]
    chunks = [c for b in a.stub.FetchModel(pb.FetchRequest(held=held), metadata=a.auth) for c in b.chunks]
    assert [c.name for c in chunks] == ["head.bias"]


def _three_in_round_one(start_service, sqlite_url):
    """Three clients in round 1's cohort, quorum 0.5 (2 needed), 60 s deadline."""
    svc = start_service(sqlite_url, federation=small_federation(min_clients=3), quorum=0.5, deadline_seconds=60)
    data = shards(3, 60)
    clients = [register(svc.stub, t, d) for t, d in zip([1.0, 0.25, 1.0], data, strict=True)]
    fill_keys(sqlite_url, clients)
    for c in clients:
        assert c.task().WhichOneof("kind") == "train"
    return svc, clients


def test_deadline_closes_with_quorum(start_service, sqlite_url) -> None:
    svc, clients = _three_in_round_one(start_service, sqlite_url)
    plan = svc.coordinator.open_round
    assert plan is not None and len(plan.cohort) == 3
    for c in clients[:2]:  # the third member never reports
        _, reply = c.round_trip()
        assert reply.accepted
    assert svc.coordinator.open_round is not None
    before = svc.coordinator.shared.open.deadline
    svc.coordinator.tick(before - timedelta(seconds=1))
    assert svc.coordinator.open_round is not None  # not yet
    svc.coordinator.tick(before + timedelta(seconds=1))
    assert svc.coordinator.open_round is None
    offline = offline_round(svc.settings.federation, RoundPlan(1, plan.cohort, plan.due, False), clients[:2], 3)
    served = global_tensors(sqlite_url)
    for name, tensor in offline.global_tensors.items():
        assert torch.allclose(served[name][0], tensor, atol=1e-6, rtol=0), name
    assert _round_counts(sqlite_url, 1) == ("closed", 2, 1, 0)  # reported, stragglers, late pushes
    # the straggler's late push (a whole, valid update) is refused and counted, and changes nothing else
    late = clients[2]
    task = late.task()
    assert task.train.round == 2  # its next task: round 2 is open now
    late.fetch()
    update = late.train(task).tensors
    before = snapshot(sqlite_url)
    with pytest.raises(grpc.RpcError) as info:
        late.push(1, update)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "round 1 is not open" in info.value.details(), info.value.details()
    after = snapshot(sqlite_url)
    assert after["rounds"][0] == (1, "closed", 2, 1, 1)
    assert {**after, "rounds": after["rounds"][1:]} == {**before, "rounds": before["rounds"][1:]}
    # a client that was not in round 1's cohort, or a round that never opened, counts nothing
    outsider = register(svc.stub, 1.0, shards(4, 60)[3])
    for client, round_ in ((outsider, 1), (late, 7)):
        with pytest.raises(grpc.RpcError) as info:
            client.push(round_, {"head.bias": torch.zeros(10)})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _round_counts(sqlite_url, 1) == ("closed", 2, 1, 1)


def _round_counts(url: str, number: int) -> tuple[str, int, int, int]:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s:
            rnd = s.scalars(select(store.Round).where(store.Round.number == number)).one()
            return rnd.state, rnd.reported, rnd.stragglers, rnd.late_pushes
    finally:
        engine.dispose()


def test_deadline_without_quorum_extends_once_then_abandons(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url, quorum=1.0, deadline_seconds=30)
    data = shards(2, 60)
    clients = [register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])]
    for c in clients:
        assert c.task().WhichOneof("kind") == "train"
    clients[0].round_trip()
    op = svc.coordinator.shared.open
    first = op.deadline
    svc.coordinator.tick(first + timedelta(seconds=1))
    assert svc.coordinator.open_round is not None and op.extended and op.deadline > first
    svc.coordinator.tick(op.deadline + timedelta(seconds=1))
    assert svc.coordinator.open_round is None
    task = clients[1].task()  # resampled: round 2 opens
    assert task.train.round == 2 and not task.train.continue_unsynced
    assert all(v == 0 for _, v in global_tensors(sqlite_url).values())  # nothing was aggregated


def test_deadline_counts_a_push_that_committed_but_has_not_counted_itself(start_service, sqlite_url) -> None:
    """A push commits (group commit) before it re-takes the coordinator's lock to count itself: a deadline
    in between must still see it in the store and close with the quorum, never abandon the round with an
    acknowledged update in it, and count its bytes toward the round it closes."""
    svc, clients = _three_in_round_one(start_service, sqlite_url)
    co = svc.coordinator
    clients[0].round_trip()
    op = co.shared.open
    co.tick(op.deadline + timedelta(seconds=1))  # 1 of the 2 needed: extended
    assert op.extended
    commit = co.shared.writes.run

    def commit_then_deadline(write):  # the second deadline fires right after this push's commit
        out = commit(write)
        co.tick(op.deadline + timedelta(seconds=1))
        return out

    co.shared.writes.run = commit_then_deadline
    _, reply = clients[1].round_trip()
    assert reply.accepted and not reply.duplicate
    assert co.open_round is None and co.federation.round == 1  # closed with the quorum, not abandoned
    assert all(v == 1 for _, v in global_tensors(sqlite_url).values())  # both updates were aggregated
    # and the round's bytes_up has both uploads: the close counted the one whose push had not yet
    co.flush()
    engine = store.create_engine_for(sqlite_url)
    try:
        with engine.connect() as conn:
            metrics_up = conn.scalar(select(store.RoundMetrics.bytes_up).where(store.RoundMetrics.round == 1))
            rows = conn.execute(
                select(store.Transfer.client_id, store.Transfer.bytes).where(
                    store.Transfer.round == 1, store.Transfer.direction == "up"
                )
            ).all()
    finally:
        engine.dispose()
    assert {cid for cid, _ in rows} == {clients[0].client_id, clients[1].client_id}
    assert all(n > 0 for _, n in rows) and metrics_up == sum(n for _, n in rows)


def test_an_abandoned_rounds_bytes_count_in_the_records_after_it(start_service, sqlite_url) -> None:
    """Round 1 gets one push of two and is abandoned at its deadline; round 2 closes. The record has no round 1,
    but its cumulative counts hold what round 1 moved, as the transfers table (and the dashboard) do."""
    from fedatoms.simulate_grpc import records_from_store

    svc = start_service(sqlite_url, small_federation(factorization="none", tiers=[1.0]), quorum=1.0)
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.round_trip()[0] == 1  # b fetches nothing, pushes nothing
    deadline = svc.coordinator.shared.open.deadline
    svc.coordinator.tick(deadline + timedelta(seconds=1))  # no quorum: extended once
    svc.coordinator.tick(deadline + timedelta(seconds=svc.settings.deadline_seconds + 2))  # abandoned
    assert a.round_trip()[0] == 2 and b.round_trip()[0] == 2
    svc.coordinator.flush()
    (record,) = records_from_store(sqlite_url)
    assert record["round"] == 2
    engine = store.create_engine_for(sqlite_url)
    try:
        with engine.connect() as conn:
            t = store.Transfer
            for direction in ("down", "up"):
                moved = conn.scalar(select(func.sum(t.bytes)).where(t.direction == direction))
                this_round = conn.scalar(select(func.sum(t.bytes)).where(t.direction == direction, t.round == 2))
                assert record[f"cumulative_bytes_{direction}"] == moved > this_round == record[f"bytes_{direction}"]
    finally:
        engine.dispose()
