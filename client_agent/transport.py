"""The client's side of the wire: typed calls to the aggregator, with retries a bad link needs.

Every call goes through :meth:`AggregatorClient._call`, which retries transient failures
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``ABORTED``, and a ``CANCELLED`` this client did not cause) with
exponential backoff and full jitter, and turns ``UNAUTHENTICATED`` into :class:`Unauthenticated` so an agent
stops with a clear message instead of polling forever. A push is retried by rebuilding its stream with
the same ``update_id``, so the server stores it once however often the link drops.

A slow link must not turn a transfer into an endless retry: a stream's deadline grows with its
bytes (:attr:`AggregatorClient.min_link_bytes_per_second`), keepalive pings find a dead link
long before that, a fetch cut midway keeps what it received, so its retry asks only for the
rest (from inside the tensor it broke off in, model or SCAFFOLD's control), and a push cut
midway resumes where the server holds it. A stop (SIGTERM, SIGINT)
cancels the call in flight and the wait between retries.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.experimental
import numpy as np
import torch
from torch import Tensor

from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS, check_model_allowed
from client_agent.update import TrainTask
from fedcore import codec
from fedcore.spec import ModelSpec
from fedcore.tiers import CapabilityProfile
from fedcore.training import TrainConfig
from fedwire import framing
from fedwire.flow_control import (
    KEEPALIVE_SECONDS,
    MAX_MESSAGE_BYTES,
    RECEIVE_WINDOW_BYTES,
    MessageSize,
    keepalive_timeout,
    stream_started,
)
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

__all__ = [
    "LONG_POLL_SECONDS",
    "MAX_MESSAGE_BYTES",
    "MIN_LINK_BYTES_PER_SECOND",
    "RETRYABLE",
    "AggregatorClient",
    "Backoff",
    "Fetched",
    "RegistrationRefused",
    "ServerSpeaksTLS",
    "Stopped",
    "Unauthenticated",
    "channel_options",
    "speaks_tls",
    "task_from_proto",
]

log = logging.getLogger("fedatoms.client")

#: How long a GetTask may be held by the server while there is nothing to do (a long poll).
LONG_POLL_SECONDS = 30.0
#: The slowest link a transfer's deadline allows for by default (8 kbit/s): a fetch or push may take
#: ``rpc_timeout`` plus its bytes at this rate before it is cut and retried.
MIN_LINK_BYTES_PER_SECOND = 1_000
#: Status codes a call is retried on. ``CANCELLED`` is one: this client cancels a call only when it stops, and
#: :meth:`AggregatorClient._call` raises :class:`Stopped` for that before it looks at the code, so a ``CANCELLED``
#: that reaches the code came from the other side: an aggregator that stopped mid-call (a failover), a proxy or
#: ingress (nginx, Envoy) that ended the call. The push resumes, as after ``UNAVAILABLE``.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)

_T = TypeVar("_T")
_C = TypeVar("_C", bound=grpc.Future)


def channel_options(
    server_name: str | None = None,
    *,
    min_link_bytes_per_second: float = MIN_LINK_BYTES_PER_SECOND,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> list[tuple[str, Any]]:
    """The options of every channel an agent opens to the aggregator, on links down to ``min_link_bytes_per_second``."""
    timeout = keepalive_timeout(min_link_bytes_per_second, keepalive_seconds)
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # a call in flight pings: a dead link fails the call then, not at its deadline; the ack waits behind
        # up to a receive window of data, which the timeout allows for at the slowest link (fedwire.flow_control)
        ("grpc.keepalive_time_ms", round(keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", round(timeout * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
        # a download's window stays what the timeout counts on (BDP probes would grow it)
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES),
        # FetchModel's stream is read in the calling thread rather than handed over, message by
        # message, from the channel's spin thread: one thread handoff fewer per message
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


_STACK_SIZE = threading.Lock()  # threading.stack_size is process-wide: one swap at a time


@contextmanager
def _small_stack() -> Iterator[None]:
    """A thread started inside gets a 256 KiB stack, not the default 8 MiB: the stop watcher only waits and
    cancels, and on a device with little memory every thread's stack counts."""
    with _STACK_SIZE:
        previous = threading.stack_size(256 * 1024)
        try:
            yield
        finally:
            threading.stack_size(previous)


class Unauthenticated(RuntimeError):
    """The server refused the token (unknown or revoked) or the enrollment secret: retrying cannot help."""


class RegistrationRefused(ValueError):
    """Register answered that this client cannot join as declared (no tier fits, a bad profile): fix the profile."""


class Stopped(RuntimeError):
    """The agent was asked to stop (SIGTERM, SIGINT) while a call was in flight or waiting to be retried."""


class ServerSpeaksTLS(ValueError):
    """A plaintext channel reached a server that answers a TLS handshake: retrying cannot help, --tls-ca can."""


def speaks_tls(target: str, timeout: float = 3.0) -> bool:
    """Whether the server at ``HOST:PORT`` completes a TLS handshake (its certificate is not checked: only asked)."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host or None),
        ):
            return True
    except (OSError, ValueError):
        return False


@dataclass
class Backoff:
    """Exponential backoff with full jitter (sleep uniform in [0, min(cap, base·2^attempt)])."""

    base: float = 0.5
    cap: float = 30.0
    max_elapsed: float | None = None  # give up after this many seconds of failures; None: never
    rng: random.Random | None = None

    def delay(self, attempt: int) -> float:
        rng = self.rng or random
        return rng.uniform(0.0, min(self.cap, self.base * 2 ** min(attempt, 64)))  # 2**1024 is no float


@dataclass
class Fetched:
    """What a FetchModel stream carried: tier tensors with versions, SCAFFOLD's server control, payload bytes."""

    model: dict[str, tuple[Tensor, int]]
    control: dict[str, Tensor]
    nbytes: int


def task_from_proto(train: pb.Task.Train) -> TrainTask:
    """The wire's Train task as the client code's :class:`TrainTask` (server control is fetched separately)."""
    strategy = json.loads(train.strategy_config_json or "{}")
    local = tuple(strategy.pop("local_tensors", ()))
    return TrainTask(
        round=train.round,
        due=tuple(train.due_tensors),
        config=TrainConfig.from_dict(json.loads(train.train_config_json)),
        continue_unsynced=train.continue_unsynced,
        seed=train.seed,
        strategy=strategy,
        local=local,
    )


def _profile_message(profile: CapabilityProfile) -> pb.CapabilityProfile:
    msg = pb.CapabilityProfile(device_name=profile.device_name, num_samples=max(0, int(profile.num_samples)))
    for field in ("compute_macs", "memory_bytes", "uplink_bps", "downlink_bps", "preferred_tier"):
        value = getattr(profile, field)
        if value is not None:
            setattr(msg, field, value)
    return msg


def _credentials(ca: Path | None, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes() if ca else None,
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


class AggregatorClient:
    """One channel to the aggregator; thread-safe (gRPC channels are), so a heartbeat thread may share it."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        server_name: str | None = None,
        backoff: Backoff | None = None,
        rpc_timeout: float = 120.0,
        min_link_bytes_per_second: float = MIN_LINK_BYTES_PER_SECOND,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if min_link_bytes_per_second <= 0:
            raise ValueError(f"min_link_bytes_per_second must be > 0, got {min_link_bytes_per_second}")
        options = channel_options(
            server_name, min_link_bytes_per_second=min_link_bytes_per_second, keepalive_seconds=keepalive_seconds
        )
        if tls_ca or tls_cert:
            self.channel = grpc.secure_channel(target, _credentials(tls_ca, tls_cert, tls_key), options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self._probe_tls = not (tls_ca or tls_cert)  # a plaintext channel failing: ask once whether the server wants TLS
        self.stub = pb_grpc.AggregatorStub(self.channel)
        self._fetch_model = framing.fetch_model(self.channel)  # chunks parsed in place, not as messages
        self._push_update = framing.push_update(self.channel)  # takes the batches push_messages serializes
        self.target = target
        self.token = token
        self.backoff = backoff or Backoff()
        self.rpc_timeout = rpc_timeout
        self.min_link_bytes_per_second = min_link_bytes_per_second
        #: chunk and message size of transfers on this link (shared by the clients :meth:`sharing` it)
        self.message_size = MessageSize()
        self._sleep = sleep
        self._owns_channel = True
        self.stop: threading.Event | None = None  # set (stop_on): calls in flight are cancelled, retries end
        self._inflight: set[grpc.Future] = set()
        self._inflight_lock = threading.Lock()

    @classmethod
    def sharing(cls, other: AggregatorClient) -> AggregatorClient:
        """Another identity (token) over ``other``'s channel: many virtual clients, one connection."""
        new = copy.copy(other)
        new.token = None
        new._owns_channel = False
        new.stop, new._inflight, new._inflight_lock = None, set(), threading.Lock()
        return new

    def stop_on(self, stop: threading.Event) -> None:
        """Once ``stop`` is set, cancel the calls in flight and refuse new ones (:class:`Stopped`): a
        signal handler only sets an event, and a call on a dead link would otherwise hold the agent
        until its deadline."""
        self.stop = stop

        def cancel_when_stopped() -> None:
            stop.wait()
            with self._inflight_lock:
                calls = list(self._inflight)
            for call in calls:
                call.cancel()

        watcher = threading.Thread(target=cancel_when_stopped, name="stop-watch", daemon=True)
        with _small_stack():
            watcher.start()

    def _transfer_timeout(self, nbytes: int) -> float:
        """A stream's deadline: ``rpc_timeout`` plus its bytes over the slowest link allowed for."""
        return self.rpc_timeout + nbytes / self.min_link_bytes_per_second

    def _future(self, method: Any, request: Any, **kwargs: Any) -> Any:
        """``method.future(…)``, tracked (a stop cancels it)."""
        return self._tracked(method.future(request, **kwargs))

    def _tracked(self, call: _C) -> _C:
        """Register a call in flight, so a stop cancels it (at once, if the stop came first)."""
        with self._inflight_lock:
            self._inflight.add(call)
        if self.stop is not None and self.stop.is_set():
            call.cancel()
        return call

    def _untrack(self, call: grpc.Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(call)

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: Any, **kwargs: Any) -> Any:
        """A unary call that a stop can cancel (a plain blocking call when nothing can stop this client)."""
        if self.stop is None:
            return method(request, **kwargs)
        future = self._future(method, request, **kwargs)
        try:
            return future.result()
        finally:
            self._untrack(future)

    def close(self) -> None:
        if self._owns_channel:
            self.channel.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _auth(self) -> tuple[tuple[str, str], ...]:
        if not self.token:
            raise Unauthenticated("no bearer token: register first")
        return (("authorization", f"Bearer {self.token}"),)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _call(self, what: str, fn: Callable[[], _T], moved: Callable[[], int] | None = None) -> _T:
        """Run ``fn`` until it succeeds, retrying transient failures with backoff; :class:`Stopped` once
        the stop event is set (the call in flight is cancelled, the wait between attempts ends).

        ``moved``: the bytes a transfer's attempts have moved so far. An attempt that moved some before it
        failed shows the link up: the failure clock (``give_up_after``) and the backoff start again."""
        failing_since: float | None = None  # the first failure of this call: how long the aggregator is unreachable
        attempt = 0
        while True:
            if self._stopping():
                raise Stopped(f"{what}: stopped")
            before = moved() if moved is not None else 0
            try:
                return fn()
            except grpc.FutureCancelledError as exc:
                if self._stopping():
                    raise Stopped(f"{what}: stopped") from exc
                raise
            except grpc.RpcError as exc:
                if self._stopping():
                    raise Stopped(f"{what}: stopped") from exc
                code = exc.code() if hasattr(exc, "code") else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise Unauthenticated(f"{what}: {exc.details()}") from exc  # type: ignore[attr-defined]
                if code == grpc.StatusCode.UNAVAILABLE and self._probe_tls:
                    self._probe_tls = False
                    if speaks_tls(self.target):
                        raise ServerSpeaksTLS(
                            f"the aggregator at {self.target} speaks TLS and this client connected without it: "
                            "pass --tls-ca CA.pem, the CA bundle that signed the aggregator's certificate"
                        ) from exc
                # a call that held a long poll or moved a slow upload for a while before it failed was no failure
                # until then: give_up_after counts from the first failure, and from the last attempt that moved data
                if moved is not None and moved() > before:
                    failing_since, attempt = None, 0
                if failing_since is None:
                    failing_since = time.monotonic()
                elapsed = time.monotonic() - failing_since
                limit = self.backoff.max_elapsed
                if code not in RETRYABLE or (limit is not None and elapsed >= limit):
                    raise
                delay = self.backoff.delay(attempt)
                if limit is not None:  # the last wait ends at the deadline, for one last attempt there
                    delay = min(delay, limit - elapsed)
                log.warning(
                    "event=rpc_retry rpc=%s code=%s attempt=%d delay=%.2f detail=%s",
                    what,
                    code.name if code else "?",
                    attempt + 1,
                    delay,
                    json.dumps(exc.details() if hasattr(exc, "details") else str(exc)),
                )
                if self.stop is None:
                    self._sleep(delay)
                elif self.stop.wait(delay):
                    raise Stopped(f"{what}: stopped") from exc
                attempt += 1

    # ------------------------------------------------------------------ RPCs

    def register(
        self,
        profile: CapabilityProfile,
        enrollment_secret: str,
        name: str | None = None,
        allowed_models: Sequence[str] = DEFAULT_ALLOWED_MODELS,
    ) -> tuple[pb.RegisterReply, ModelSpec]:
        """Register; the reply's model reference is checked against ``allowed_models`` before it is built."""
        reply = self.register_reply(profile, enrollment_secret, name)
        check_model_allowed(reply.model_spec_json, allowed_models)
        return reply, ModelSpec.from_json(reply.model_spec_json)

    def register_reply(
        self, profile: CapabilityProfile, enrollment_secret: str, name: str | None = None
    ) -> pb.RegisterReply:
        """Register and keep the token; the reply's model spec is left as text (nothing is imported)."""
        request = pb.RegisterRequest(profile=_profile_message(profile), enrollment_secret=enrollment_secret)
        if name:
            request.client_name = name
        try:
            reply = self._call("Register", lambda: self._unary(self.stub.Register, request, timeout=self.rpc_timeout))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):  # type: ignore[attr-defined]
                raise RegistrationRefused(f"the aggregator refused to register this client: {exc.details()}") from exc  # type: ignore[attr-defined]
            raise
        self.token = reply.token
        return reply

    def heartbeat(self, *, retry: bool = True, round_: int = 0) -> pb.HeartbeatReply:
        """``retry=False``: one attempt (a background beat must not sleep through a shutdown); ``round_``:
        also ask what became of that round (``HeartbeatReply.round_outcome``)."""
        request = pb.HeartbeatRequest(round=round_)
        call = lambda: self._unary(self.stub.Heartbeat, request, metadata=self._auth, timeout=10)  # noqa: E731
        return self._call("Heartbeat", call) if retry else call()

    def get_task(
        self,
        report: pb.EvaluationReport | None = None,
        wait_seconds: float = 0.0,
        cancel: threading.Event | None = None,
    ) -> pb.Task:
        """The next task; ``report`` (:meth:`evaluation`) is recorded with it, sparing a ReportEvaluation call.

        ``wait_seconds`` > 0 makes it a long poll: the server may hold the call that long while it has
        nothing for this client, and answers the moment a task is ready (0: at once). The call's deadline
        leaves the server 10 s beyond that to answer; setting ``cancel`` ends a held call early
        (answered as a Wait), so a stopping agent does not wait out the hold.
        """
        request = pb.GetTaskRequest(report=report, wait_seconds=wait_seconds)
        timeout = wait_seconds + 10.0

        def call() -> pb.Task:
            if wait_seconds <= 0 or cancel is None:
                return self._unary(self.stub.GetTask, request, metadata=self._auth, timeout=timeout)
            future = self._future(self.stub.GetTask, request, metadata=self._auth, timeout=timeout)
            try:
                while not future.done():
                    if cancel.wait(0.2) and future.cancel():
                        return pb.Task(wait=pb.Task.Wait(reason="stopping: the held call was cancelled"))
                return future.result()
            finally:
                self._untrack(future)

        return self._call("GetTask", call)

    def fetch(
        self,
        spec: ModelSpec,
        held: Mapping[str, int],
        *,
        round_: int | None = None,
        include_server_control: bool = False,
        evaluate: bool = False,
    ) -> Fetched:
        """Tensors newer than ``held``, checked against the tier's spec (and upcast from fp16 transport).

        ``evaluate``: a closed round's model fetched to evaluate it (counted as an evaluation fetch)."""
        expected = {t.name: (tuple(t.shape), t.dtype) for t in spec.tensors}
        request = pb.FetchRequest(held=[pb.TensorVersion(name=n, version=v) for n, v in held.items()])
        if round_ is not None:
            request.round = round_
        if include_server_control:
            request.include_server_control = True
        request.purpose = pb.FETCH_PURPOSE_EVALUATE if evaluate else pb.FETCH_PURPOSE_TRAIN

        # a fetch cut midway keeps the tensors it completed: the retry declares them held, so the server
        # sends only the rest (a tensor that changed meanwhile is newer than held, and sent again); the tensor
        # it broke off in resumes where it broke off (FetchRequest.resume), so no tensor needs one whole connection;
        # SCAFFOLD's server control alike (held_control, a resume of kind server control)
        kept: dict[str, tuple[np.ndarray, int]] = {}
        kept_control: dict[str, tuple[np.ndarray, int]] = {}
        following: list[codec.Reassembler | None] = [None, None]  # the retry's (model, control), holding a part
        received = [0]
        nbytes = sum(int(np.prod(shape)) * 4 for shape, _ in expected.values()) * (2 if include_server_control else 1)
        cuts = [0]
        size: list[int | None] = [None]  # this fetch's chunk size: the link's, never growing within the fetch

        def once() -> Fetched:
            model, control = following[0] or codec.Reassembler(), following[1] or codec.Reassembler()
            part, control_part = model.part, control.part
            request.ClearField("held")
            request.ClearField("held_control")
            request.ClearField("resume")
            request.ClearField("chunk_bytes")
            size[0] = chunk_size = self.message_size.next(size[0])
            if chunk_size != codec.CHUNK_BYTES:  # unset at the default: any server takes it
                request.chunk_bytes = chunk_size
            if part is not None:
                request.resume.CopyFrom(pb.TensorResume(name=part[0], version=part[1], offset=part[2]))
                control_part = None  # one resume a request: the control's part goes whole again
            elif control_part is not None:
                name, version, offset = control_part
                resume = pb.TensorResume(name=name, version=version, offset=offset, kind=pb.TENSOR_KIND_SERVER_CONTROL)
                request.resume.CopyFrom(resume)
            request.held.extend(
                pb.TensorVersion(name=n, version=v)
                for n, v in held.items()
                if n not in kept and (part is None or n != part[0])
            )
            request.held.extend(pb.TensorVersion(name=n, version=v) for n, (_, v) in kept.items())
            request.held_control.extend(pb.TensorVersion(name=n, version=v) for n, (_, v) in kept_control.items())
            stream = self._tracked(
                self._fetch_model(request, metadata=self._auth, timeout=self._transfer_timeout(nbytes))
            )
            try:
                for batch in stream:
                    for kind, chunk in batch:
                        (control if kind == pb.TENSOR_KIND_SERVER_CONTROL else model).add(chunk)
            except grpc.RpcError as exc:
                cuts[0] += 1
                if stream_started(exc):  # broke under way, not a server that was down
                    size[0] = self.message_size.cut(model.bytes_received + control.bytes_received, chunk_size)
                received[0] += model.bytes_received + control.bytes_received
                for assembler, store_in, i in ((model, kept, 0), (control, kept_control, 1)):
                    versions = assembler.versions()
                    following[i] = assembler.resume()
                    done = assembler.finish(expected if i == 0 else None, complete_only=True)
                    store_in.update((name, (array, versions[name])) for name, array in done.items())
                raise
            finally:
                self._untrack(stream)
            versions = model.versions()
            arrays = {n: a for n, (a, _) in kept.items()} | model.finish(expected)
            versions = {n: v for n, (_, v) in kept.items()} | versions
            controls = {n: a for n, (a, _) in kept_control.items()} | control.finish()
            if not cuts[0]:
                self.message_size.completed()
            return Fetched(
                {n: (torch.from_numpy(a), versions[n]) for n, a in arrays.items()},
                {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in controls.items()},
                received[0] + model.bytes_received + control.bytes_received,
            )

        return self._call("FetchModel", once, moved=lambda: received[0])

    def push(
        self,
        round_: int,
        update_id: str,
        num_samples: int,
        metrics: Mapping[str, float],
        tensors: Mapping[str, Tensor],
        control_delta: Mapping[str, Tensor] | None = None,
        *,
        fp16: bool = False,
        resume: bool = False,
    ) -> pb.PushReply:
        """Stream one update; a retry rebuilds the stream with the same ``update_id`` (stored once).

        A retry first asks what the server kept of the broken stream (``GetUploadProgress``) and sends
        only the rest; where nothing was kept (or the server predates resuming) it sends the update whole.
        ``resume``: ask before the first attempt too (an update an earlier process may have begun to push).
        Tensors go in name order, so a stream rebuilt from a saved update continues the first one's."""

        header = pb.PushHeader(
            round=round_,
            update_id=update_id,
            num_samples=num_samples,
            metrics={k: float(v) for k, v in metrics.items()},
        )
        tensors_ = [(name, tensors[name], 0, pb.TENSOR_KIND_MODEL) for name in sorted(tensors)]
        deltas = control_delta or {}
        tensors_ += [(name, deltas[name], round_, pb.TENSOR_KIND_CONTROL_DELTA) for name in sorted(deltas)]
        sizes = [codec.tensor_encoded_size(t, fp16, name) for name, t, _, _ in tensors_]
        nbytes = sum(sizes)

        def position(start: tuple[int, int]) -> int:
            """Payload bytes before ``start`` (tensors the server holds whole, bytes of the next)."""
            return sum(sizes[: start[0]]) + start[1]

        attempts = [1 if resume else 0]
        # this call's last attempt: where it started, its chunk size, and whether it broke under way
        previous: list[tuple[int, int] | None] = [None]
        size: list[int | None] = [None]
        broke_under_way = [False]
        sent = [0]  # bytes handed to gRPC over every attempt

        def counted(messages: Iterator[bytes]) -> Iterator[bytes]:
            for message in messages:
                sent[0] += len(message)
                yield message

        def once() -> pb.PushReply:
            start = self._upload_progress(update_id, round_) if attempts[0] else (0, 0)
            if previous[0] is not None and broke_under_way[0] and size[0] is not None:
                # what the server kept of the attempt that broke is its progress
                size[0] = self.message_size.cut(position(start) - position(previous[0]), size[0])
            previous[0], broke_under_way[0] = start, False
            attempts[0] += 1
            header.resume = start != (0, 0)
            size[0] = chunk_size = self.message_size.next(size[0])
            messages = counted(framing.push_messages(header, tensors_, fp16=fp16, start=start, chunk_bytes=chunk_size))
            timeout = self._transfer_timeout(nbytes)
            try:
                if self.stop is None:
                    return self._push_update(messages, metadata=self._auth, timeout=timeout)
                future = self._future(self._push_update, messages, metadata=self._auth, timeout=timeout)
                try:
                    return future.result()
                finally:
                    self._untrack(future)
            except grpc.RpcError as exc:
                broke_under_way[0] = stream_started(exc)
                raise

        reply = self._call("PushUpdate", once, moved=lambda: sent[0])
        if attempts[0] == 1 and not resume:
            self.message_size.completed()
        return reply

    def _upload_progress(self, update_id: str, round_: int) -> tuple[int, int]:
        """Where a retried push starts: (tensors the server holds whole, bytes of the next); (0, 0) for all."""
        request = pb.UploadProgressRequest(update_id=update_id)
        try:
            progress = self._unary(self.stub.GetUploadProgress, request, metadata=self._auth, timeout=self.rpc_timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                return 0, 0  # an aggregator from before resumable pushes
            raise  # _call retries it as the push it belongs to
        if not progress.kept or progress.round != round_:
            return 0, 0
        return progress.tensors, progress.offset

    @staticmethod
    def evaluation(
        round_: int, global_accuracy: float, global_loss: float, personalized_accuracy: float | None, num_samples: int
    ) -> pb.EvaluationReport:
        report = pb.EvaluationReport(
            round=round_, global_accuracy=global_accuracy, global_loss=global_loss, num_samples=num_samples
        )
        if personalized_accuracy is not None:
            report.personalized_accuracy = personalized_accuracy
        return report

    def report(self, report: pb.EvaluationReport) -> pb.EvaluationReply:
        """Send an evaluation (:meth:`evaluation`) on its own, when no GetTask will carry it."""
        return self._call(
            "ReportEvaluation", lambda: self._unary(self.stub.ReportEvaluation, report, metadata=self._auth, timeout=30)
        )
