"""A push answered ``CANCELLED`` by the other side is retried; one the client cancelled itself (its stop) is not.

An aggregator that stops mid-call during a failover, or a proxy or ingress in front of it (nginx, Envoy), can end
a PushUpdate with ``CANCELLED``. The client did not cancel it: the push resumes where the server holds it, with
its ``update_id``, as after ``UNAVAILABLE``. Here a real gRPC proxy in front of a real aggregator does that.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import torch
from support import serve_aggregator, stored_update

from aggregator_service.config import FederationConfig
from client_agent.transport import MAX_MESSAGE_BYTES, AggregatorClient, Backoff, Stopped
from fedcore.tiers import CapabilityProfile

SECRET = "cancelled-enrollment-secret"


class CancellingProxy(grpc.GenericRpcHandler):
    """A gRPC proxy to the aggregator at ``upstream`` (messages as bytes, the bearer token passed on) for the
    unary calls and PushUpdate. Its first PushUpdate is ended ``CANCELLED`` once ``after`` bytes of it went
    upstream, and the upstream call cancelled, as an ingress does when the aggregator behind it goes away; with
    ``hold``, the first PushUpdate is held unanswered instead (until the test ends)."""

    def __init__(self, upstream: str, after: int, hold: bool = False) -> None:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", -1)]
        self.channel = grpc.insecure_channel(upstream, options=options)
        self.after, self.hold = after, hold
        self.pushes = 0  # PushUpdate calls that reached the proxy
        self.cancelled = 0  # those it ended CANCELLED
        self.holding = threading.Event()  # hold: the first push is here, and held
        self.released = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[self], options=options)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.released.set()
        self.server.stop(grace=None)
        self.channel.close()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.endswith("/PushUpdate"):
            return grpc.stream_unary_rpc_method_handler(functools.partial(self._push, method))
        if method.endswith("/FetchModel"):
            return None  # not carried: UNIMPLEMENTED
        return grpc.unary_unary_rpc_method_handler(functools.partial(self._unary, method))

    @staticmethod
    def _metadata(context: grpc.ServicerContext) -> list[tuple[str, str]]:
        return [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return self.channel.unary_unary(method)(request, metadata=self._metadata(context), timeout=30)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())

    def _push(self, method: str, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self.pushes += 1
        upstream = self.channel.stream_unary(method)
        if self.pushes > 1:  # after the one it ended: a plain proxy
            try:
                return upstream(requests, metadata=self._metadata(context), timeout=60)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())
        if self.hold:
            self.holding.set()
            self.released.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test ended")
        reached, cancelled = threading.Event(), threading.Event()

        def forward() -> Iterator[bytes]:
            sent = 0
            for message in requests:
                yield message
                sent += len(message)
                if sent >= self.after:
                    reached.set()
                    cancelled.wait(30)  # the stream stays open until the call is cancelled: no end to misread
                    return

        call = upstream.future(forward(), metadata=self._metadata(context), timeout=60)
        assert reached.wait(30), "the push never carried enough bytes"
        call.cancel()
        cancelled.set()
        self.cancelled += 1
        context.abort(grpc.StatusCode.CANCELLED, "the upstream connection went away")


@contextlib.contextmanager
def pushing_through(
    tmp_path: Path, **proxy: object
) -> Iterator[tuple[CancellingProxy, AggregatorClient, AggregatorClient, object, list[float]]]:
    """A real aggregator on a SQLite file (McMahan's CNN, two members so round 1 stays open), the proxy in front
    of it, a member on each link: ``(proxy, client through the proxy, direct client, spec, the proxied client's
    waits between retries)``."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    _, server, port = serve_aggregator(
        url,
        enrollment_secret=SECRET,
        federation=FederationConfig(model="mnist-cnn", fraction=1.0, min_clients=2, rounds=2, batch_size=32),
    )
    link = CancellingProxy(f"127.0.0.1:{port}", **proxy)  # type: ignore[arg-type]
    retries: list[float] = []
    proxied = AggregatorClient(link.target, backoff=Backoff(base=0.05, max_elapsed=60), sleep=retries.append)
    direct = AggregatorClient(f"127.0.0.1:{port}")
    try:
        direct.register(CapabilityProfile(num_samples=100), SECRET)  # a second member keeps round 1 open
        _, spec = direct.register(CapabilityProfile(num_samples=100), SECRET)
        proxied.token = direct.token
        yield link, proxied, direct, spec, retries
    finally:
        proxied.close()
        direct.close()
        link.close()
        server.stop(grace=None)


def _update(direct: AggregatorClient, spec: object, round_: int) -> dict[str, torch.Tensor]:
    fetched = direct.fetch(spec, {}, round_=round_)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    return {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, (t, _) in fetched.model.items()}


def test_a_push_the_proxy_ends_cancelled_midway_is_retried_and_stored_once(tmp_path: Path, caplog) -> None:
    """The push (6.6 MB) is ended ``CANCELLED`` after 2 MB went upstream: the client retried it (it ended with a
    traceback), and the server holds the update once, as sent."""
    with pushing_through(tmp_path, after=2 * 2**20) as (proxy, proxied, direct, spec, retries):
        task = direct.get_task()
        update = _update(direct, spec, task.train.round)
        with caplog.at_level(logging.WARNING, logger="fedatoms.client"):
            reply = proxied.push(task.train.round, "u-cancelled", 100, {"train_loss": 0.5}, update)
        stored = stored_update(f"sqlite:///{tmp_path / 'agg.db'}", task.train.round)  # one update, no more
    assert reply.accepted and not reply.duplicate
    assert proxy.cancelled == 1 and proxy.pushes == 2 and len(retries) == 1
    assert any("event=rpc_retry rpc=PushUpdate code=CANCELLED" in r.getMessage() for r in caplog.records)
    assert stored.keys() == update.keys()
    for name, tensor in update.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy(), err_msg=name)


def test_a_push_the_client_cancels_itself_stops_it(tmp_path: Path) -> None:
    """The client's own cancel (its stop: SIGTERM, SIGINT) still ends the push at once, not retried."""
    with pushing_through(tmp_path, after=0, hold=True) as (proxy, proxied, direct, spec, retries):
        stop = threading.Event()
        proxied.stop_on(stop)
        task = direct.get_task()
        update = _update(direct, spec, task.train.round)
        ended: list[BaseException] = []

        def push() -> None:
            try:
                proxied.push(task.train.round, "u-stopped", 100, {}, update)
            except BaseException as exc:
                ended.append(exc)

        pushing = threading.Thread(target=push, daemon=True)
        pushing.start()
        assert proxy.holding.wait(30), "the push never reached the proxy"
        stop.set()
        stopped = time.monotonic()
        pushing.join(timeout=30)
        took = time.monotonic() - stopped
    assert len(ended) == 1 and isinstance(ended[0], Stopped), ended
    assert took < 5 and proxy.pushes == 1 and retries == []
