"""A flood of wrong-secret Register calls: refused, writes nothing, and enrolled clients are still served.

The aggregator is restarted with a configured secret that is not the one its federation was created
with, so every wrong secret goes the slow way (a 600,000-iteration PBKDF2, as in production) and the
Register gate really fills; the gate, not the secret check, is what keeps the other threads free.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_helpers import SECRET, register, shards, small_federation
from sqlalchemy import func, select
from support import wait_until

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc


def _serve(url: str, secret: str) -> tuple[grpc.Server, grpc.Channel]:
    settings = AggregatorSettings(
        listen="127.0.0.1:0", database_url=url, enrollment_secret=secret, federation=small_federation()
    )
    factory = store.session_factory(store.create_engine_for(url))
    coordinator = Coordinator(settings, factory, enrollment_iterations=store.ENROLLMENT_PBKDF2_ITERATIONS)
    server, port, _ = build_server(settings, coordinator, max_workers=8)
    server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


def _clients(url: str) -> int:
    with store.session_factory(store.create_engine_for(url))() as s:
        return s.scalar(select(func.count()).select_from(store.Client))


def _wrong(stub: pb_grpc.AggregatorStub) -> grpc.StatusCode:
    try:
        stub.Register(
            pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret="guess"), timeout=30
        )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_wrong_secret_flood_leaves_enrolled_clients_served(request, backend) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    store.upgrade(url)
    server, channel = _serve(url, SECRET)
    enrolled = register(pb_grpc.AggregatorStub(channel), 1.0, shards(1)[0])
    channel.close()
    server.stop(grace=None)

    server, channel = _serve(url, "not-the-federation-secret")  # wrong secrets now cost a full PBKDF2 each
    try:
        stub = pb_grpc.AggregatorStub(channel)
        enrolled.stub = stub
        codes: list[grpc.StatusCode] = []
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                codes.append(_wrong(stub))

        threads = [threading.Thread(target=flood) for _ in range(16)]
        for t in threads:
            t.start()
        try:
            # the gate is full: refusals at the door come back while slow checks are inside
            assert wait_until(lambda: grpc.StatusCode.UNAVAILABLE in codes, timeout=30)
            for _ in range(10):
                reply = stub.Heartbeat(pb.HeartbeatRequest(), metadata=enrolled.auth, timeout=5)
                assert reply.server_time_unix > 0
            assert wait_until(lambda: grpc.StatusCode.UNAUTHENTICATED in codes, timeout=30)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED}
        assert _clients(url) == 1  # no refused call wrote a row
        register(stub, 1.0, shards(1)[0])  # the federation's own secret stays in force
        assert _wrong(stub) == grpc.StatusCode.UNAUTHENTICATED
        assert _clients(url) == 2
    finally:
        channel.close()
        server.stop(grace=None)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_guesser_waits_for_its_refusals_and_enrolled_clients_do_not(request, backend) -> None:
    """Past a burst of 5 refusals per host, each further wrong secret or token is answered after
    ``refusal_delay_seconds`` (still UNAUTHENTICATED, nothing written); a correct token never waits."""
    import time

    from grpc_helpers import start_aggregator

    delay = 2.0
    service = start_aggregator(request.getfixturevalue(f"{backend}_url"), refusal_delay_seconds=delay)
    try:
        stub = service.stub
        enrolled = register(stub, 1.0, shards(1)[0])

        def timed(call) -> tuple[object, float]:
            t0 = time.monotonic()
            return call(), time.monotonic() - t0

        guesses = [timed(lambda: _wrong(stub)) for _ in range(7)]
        assert [code for code, _ in guesses] == [grpc.StatusCode.UNAUTHENTICATED] * 7
        assert all(seconds < delay for _, seconds in guesses[:5]), guesses  # the burst: answered at once
        assert all(seconds >= delay for _, seconds in guesses[5:]), guesses  # then held

        def forged() -> grpc.StatusCode:
            try:
                stub.Heartbeat(pb.HeartbeatRequest(), metadata=(("authorization", "Bearer forged"),), timeout=30)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        code, seconds = timed(forged)  # a wrong token is a guess too, from the same host
        assert code == grpc.StatusCode.UNAUTHENTICATED and seconds >= delay
        reply, seconds = timed(lambda: stub.Heartbeat(pb.HeartbeatRequest(), metadata=enrolled.auth, timeout=30))
        assert reply.server_time_unix > 0 and seconds < delay
        assert _clients(service.url) == 1
    finally:
        service.stop()
