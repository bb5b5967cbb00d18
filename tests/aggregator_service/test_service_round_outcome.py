"""Heartbeat answers what became of a round a client asks about, after later rounds as well.

A client whose update was taken keeps its strategy state's step aside until it learns this; the
case ``last_closed_round`` cannot settle is a round abandoned and a later one closed since.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import grpc
import pytest
from grpc_helpers import register, shards, small_federation
from sqlalchemy import select
from sqlalchemy.orm import Session

from aggregator_service import store
from fedwire.v1 import aggregator_pb2 as pb


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def test_heartbeat_tells_open_closed_abandoned_and_unknown_rounds_apart(start_service, url: str) -> None:
    svc = start_service(url, small_federation(factorization="none", tiers=[1.0], rounds=3), quorum=1.0)
    data = shards(2, 60)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])

    def beat(round_: int) -> pb.HeartbeatReply:
        return svc.stub.Heartbeat(pb.HeartbeatRequest(round=round_), metadata=a.auth)

    assert beat(0).round_outcome == pb.ROUND_OUTCOME_UNSPECIFIED  # nothing asked
    assert beat(1).round_outcome == pb.ROUND_OUTCOME_UNKNOWN  # not opened yet
    assert a.round_trip()[0] == 1  # b pushes nothing: round 1 cannot reach its quorum
    assert beat(1).round_outcome == pb.ROUND_OUTCOME_OPEN
    deadline = svc.coordinator.shared.open.deadline
    svc.coordinator.tick(deadline + timedelta(seconds=1))  # extended once
    assert beat(1).round_outcome == pb.ROUND_OUTCOME_OPEN
    svc.coordinator.tick(deadline + timedelta(seconds=svc.settings.deadline_seconds + 2))  # abandoned
    assert beat(1).round_outcome == pb.ROUND_OUTCOME_ABANDONED
    assert a.round_trip()[0] == 2 and b.round_trip()[0] == 2  # round 2 closes on both
    reply = beat(1)
    # what a client cannot tell from the round numbers alone: round 1 ended before a closed round 2
    assert reply.last_closed_round == 2 and reply.round_outcome == pb.ROUND_OUTCOME_ABANDONED
    assert beat(2).round_outcome == pb.ROUND_OUTCOME_CLOSED
    assert beat(3).round_outcome == pb.ROUND_OUTCOME_UNKNOWN  # opens at the next GetTask
    assert beat(2**31 - 1).round_outcome == pb.ROUND_OUTCOME_UNKNOWN


@pytest.mark.parametrize("round_", [-1, 2**62])
def test_a_round_out_of_range_is_refused_and_changes_nothing(start_service, url: str, round_: int) -> None:
    svc = start_service(url, small_federation(factorization="none", tiers=[1.0]), quorum=1.0)
    a = register(svc.stub, 1.0, shards(1, 60)[0])
    with pytest.raises(grpc.RpcError) as refused:
        svc.stub.Heartbeat(pb.HeartbeatRequest(round=round_), metadata=a.auth)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "round" in (refused.value.details() or "")
    reply = svc.stub.Heartbeat(pb.HeartbeatRequest(), metadata=a.auth)
    assert reply.current_round == 0 and reply.last_closed_round == 0


def _rounds_and_state(url: str) -> tuple[list[tuple[int, str]], str]:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            rounds = [tuple(r) for r in s.execute(select(store.Round.number, store.Round.state).order_by("number"))]
            return rounds, s.execute(select(store.Federation.state)).scalar_one()
    finally:
        engine.dispose()


def test_an_abandoned_last_round_ends_the_federation(start_service, url: str) -> None:
    """docs/aggregator.md: after round ``rounds`` ends, closed or abandoned, every GetTask answers Done. Round 2
    of 2 misses its quorum twice: no round 3 opens, now or after a restart; raising ``rounds`` lets it go on."""
    fed = small_federation(factorization="none", tiers=[1.0], rounds=2)
    svc = start_service(url, fed, quorum=1.0)
    data = shards(2, 60)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.round_trip()[0] == 1 and b.round_trip()[0] == 1  # round 1 closes
    assert a.round_trip()[0] == 2  # b pushes nothing: round 2 cannot reach its quorum
    deadline = svc.coordinator.shared.open.deadline
    svc.coordinator.tick(deadline + timedelta(seconds=1))  # extended once
    svc.coordinator.tick(deadline + timedelta(seconds=svc.settings.deadline_seconds + 2))  # abandoned
    for c in (a, b):
        task = c.task()
        assert task.WhichOneof("kind") == "done", task
        assert task.done.final_round == 1 and "after 2 rounds" in task.done.reason  # the model is round 1's
    assert _rounds_and_state(url) == ([(1, "closed"), (2, "abandoned")], "done")

    svc.stop()
    svc = start_service(url, fed, quorum=1.0)  # the same federation, restarted
    a.stub = b.stub = svc.stub
    assert a.task().WhichOneof("kind") == "done" and b.task().WhichOneof("kind") == "done"
    assert _rounds_and_state(url) == ([(1, "closed"), (2, "abandoned")], "done")

    svc.stop()
    svc = start_service(url, replace(fed, rounds=3), quorum=1.0)  # rounds raised: round 3 opens
    a.stub = b.stub = svc.stub
    assert a.round_trip()[0] == 3 and b.round_trip()[0] == 3
    assert _rounds_and_state(url) == ([(1, "closed"), (2, "abandoned"), (3, "closed")], "done")
