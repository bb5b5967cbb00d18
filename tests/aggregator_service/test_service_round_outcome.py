"""Heartbeat answers what became of a round a client asks about, after later rounds as well.

A client whose update was taken keeps its strategy state's step aside until it learns this; the
case ``last_closed_round`` cannot settle is a round abandoned and a later one closed since.
"""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest
from grpc_helpers import register, shards, small_federation

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
