"""One enrolled client's pushes hold one server thread and one push slot, however many it opens.

The service has 8 workers, 8 push slots and 4 places in line. A client that opens 20 pushes and
sends nothing after the header would take all of them, and every other client would wait or be
refused. Each new push of a client ends its push before (a client that opens another has given up
on it, as after a broken link), so the earlier ones end CANCELLED and another client's calls go through.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from grpc_helpers import global_tensors, register, shards, small_federation

from fedwire.v1 import aggregator_pb2 as pb

STREAMS = 20


def _wait_done(calls: list[grpc.Future], count: int, seconds: float = 30.0) -> list[grpc.Future]:
    deadline = time.monotonic() + seconds
    while sum(c.done() for c in calls) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [c for c in calls if c.done()]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_clients_stalled_pushes_leave_the_others_their_slots(start_service, request, backend) -> None:
    svc = start_service(request.getfixturevalue(f"{backend}_url"), small_federation(factorization="none", tiers=[1.0]))
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().train.round == 1
    release = threading.Event()

    def stalled() -> Iterator[pb.PushMessage]:
        yield pb.PushMessage(header=pb.PushHeader(round=1, update_id=uuid.uuid4().hex, num_samples=len(a.data)))
        release.wait(60)

    calls = [a.stub.PushUpdate.future(stalled(), metadata=a.auth, timeout=60) for _ in range(STREAMS)]
    try:
        ended = _wait_done(calls, STREAMS - 1)
        assert len(ended) == STREAMS - 1, f"{len(ended)} of {STREAMS} stalled pushes ended"
        assert all(c.code() == grpc.StatusCode.CANCELLED for c in ended), [c.code() for c in ended]
        assert b.stub.Heartbeat(pb.HeartbeatRequest(), metadata=b.auth, timeout=20).current_round == 1
        model = {n: t for n, (t, _v) in global_tensors(svc.url).items()}
        assert b.push(1, model, timeout=20).accepted  # a push slot was free
    finally:
        release.set()
        for call in calls:  # the last one ends too (a header and no tensor), before the service stops
            call.exception(timeout=30)
