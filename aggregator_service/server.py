"""The gRPC face of the aggregator: authenticate, decode, call the coordinator, encode.

The servicer is thin on purpose: validation and the round state machine live in
:mod:`aggregator_service.coordinator` (plain Python); domain errors leave through
``context.abort(code, message)``. :func:`build_server` wires the servicer, the standard
health and reflection services, message limits and TLS; :func:`serve` runs it until
SIGTERM/SIGINT with a background thread that enforces round deadlines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as DatabaseTimeout
from torch import Tensor

from aggregator_service import request_checks, store
from aggregator_service.admission import Gate, LatestPerClient
from aggregator_service.config import DEMO_ENROLLMENT_SECRET, AggregatorSettings, unread_environment
from aggregator_service.coordinator import ClientInfo, Coordinator, Done, ModelFetch, OpenRound, PushResult, Train, kv
from aggregator_service.database_url import driver_says, unreadable
from aggregator_service.errors import (
    Aborted,
    IncompleteUpdate,
    InvalidArgument,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from aggregator_service.kept_uploads import KeptUpload, KeptUploads
from aggregator_service.logfmt import configure_logging
from aggregator_service.tarpit import Tarpit
from aggregator_service.validation import check_header
from fedcore import codec
from fedcore.tiers import CapabilityProfile
from fedwire import framing
from fedwire.allocator import release_free_memory, reuse_message_buffers
from fedwire.flow_control import MAX_MESSAGE_BYTES, RECEIVE_WINDOW_BYTES, STREAM_STARTED, check_chunk_bytes
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SERVICE_NAME",
    "AggregatorServicer",
    "DeadlineTicker",
    "LockWatch",
    "build_server",
    "serve",
]

log = logging.getLogger("fedatoms.aggregator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name
# How long a push refused as incomplete waits to learn whether its call was cut (then what arrived is kept
# for the retry) rather than ended by the client: a cut call is marked over within milliseconds.
CUT_STREAM_GRACE_SECONDS = 1.0

_F = TypeVar("_F", bound=Callable[..., Any])


#: The longest error message sent: it travels in a trailer, and gRPC cuts a call whose metadata passes 8 KiB
#: (RESOURCE_EXHAUSTED, "Stream removed"), which a message quoting a hostile 20,000-character name would.
MAX_DETAIL_CHARS = 2000


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    if len(message) > MAX_DETAIL_CHARS:
        message = f"{message[: MAX_DETAIL_CHARS - 40]} … ({len(message)} characters in all)"
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # pragma: no cover


def _is_abort(exc: Exception) -> bool:
    """``context.abort`` ends a handler by raising a bare ``Exception``: it must pass through untouched."""
    return type(exc) is Exception


def _database_away(exc: Exception) -> bool:
    """A database error a retry can outlive: the server or the connection is away (restarting, failing over,
    refusing connections), the pool is exhausted, or SQLite's file is locked past the busy timeout or cannot be
    opened. A statement the schema cannot run (a missing table or column) is a bug: INTERNAL, with its traceback."""
    if isinstance(exc, DatabaseTimeout) or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return True
    if not isinstance(exc, OperationalError | InterfaceError | sqlite3.OperationalError):
        return False
    cause = getattr(exc, "orig", None) or exc
    if isinstance(cause, sqlite3.Error):
        said = str(cause).lower()
        return any(m in said for m in ("database is locked", "database is busy", "unable to open database", "disk i/o"))
    return True  # PostgreSQL's OperationalError and InterfaceError are the server's or the connection's


def _handle(context: grpc.ServicerContext, exc: Exception, method: str) -> NoReturn:
    code: grpc.StatusCode | None = None
    if isinstance(exc, ServiceError):
        code = getattr(grpc.StatusCode, exc.code)
    elif isinstance(exc, codec.CodecError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.kind == "too_large" else grpc.StatusCode.INVALID_ARGUMENT
    if code is not None:  # the client's error, told to the client; at debug level for whoever traces one
        log.debug(kv("rpc_refused", method=method, code=code.name, peer=context.peer(), detail=str(exc)))
        _abort(context, code, str(exc))
    if _database_away(exc):
        # the call may succeed later, so it is UNAVAILABLE, which every client retries; INTERNAL ended the agents
        log.warning(kv("rpc_unavailable", method=method, error=type(exc).__name__, detail=driver_says(exc)))
        _abort(context, grpc.StatusCode.UNAVAILABLE, f"the aggregator cannot reach its database ({method}): retry")
    log.exception(kv("rpc_failed", method=method, error=type(exc).__name__))
    _abort(context, grpc.StatusCode.INTERNAL, f"internal error in {method} ({type(exc).__name__}); see the server log")


class _CutStream(Exception):
    """A push stream that gRPC ended as finished, on a call that was in fact cut or cancelled."""


def _push_reply(result: PushResult) -> pb.PushReply:
    return pb.PushReply(
        accepted=result.accepted,
        duplicate=result.duplicate,
        round=result.round,
        message=result.message,
        move_scale=result.move_scale,
    )


def _header_key(header: pb.PushHeader) -> tuple[int, int, tuple[tuple[str, float], ...]]:
    """What a resumed push must repeat of its first attempt's header."""
    return header.round, header.num_samples, tuple(sorted(header.metrics.items()))


def _rpc(fn: _F) -> _F:
    """Map domain errors of a unary/client-streaming handler to status codes."""

    @functools.wraps(fn)
    def wrapper(self: AggregatorServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Unauthenticated as exc:
            self.tarpit.refused(context.peer())  # a guesser waits for its answer (aggregator_service/tarpit.py)
            _handle(context, exc, fn.__name__)
        except grpc.RpcError:
            # a request stream's iterator raises this when the call ended under it: the client cancelled
            # or broke off (a bad link), or gRPC refused a message. The client already has its status, and
            # gRPC drops this error quietly: no server fault to log (the update, if any, stored nothing)
            log.info(kv("rpc_ended_early", method=fn.__name__, peer=context.peer()))
            raise
        except Exception as exc:
            if _is_abort(exc):
                raise
            _handle(context, exc, fn.__name__)

    return wrapper  # type: ignore[return-value]


_ROUND_OUTCOMES = {
    "open": pb.ROUND_OUTCOME_OPEN,
    "closed": pb.ROUND_OUTCOME_CLOSED,
    "abandoned": pb.ROUND_OUTCOME_ABANDONED,
    "unknown": pb.ROUND_OUTCOME_UNKNOWN,
}


class AggregatorServicer(pb_grpc.AggregatorServicer):
    def __init__(self, coordinator: Coordinator, settings: AggregatorSettings, push_waiters: int = 16) -> None:
        self.coordinator = coordinator
        # pushes received at once (into spool files), and of those, decoded at once: memory flat in the cohort
        self._pushes = Gate(settings.max_concurrent_pushes, push_waiters)
        # a client's push ends its push before: however many it opens, it holds one thread and one slot
        self._client_pushes = LatestPerClient()
        # what broken push streams delivered, so a retry sends only the rest (GetUploadProgress)
        self._kept = KeptUploads(settings.kept_push_limit, ttl_seconds=settings.kept_push_seconds)
        self._progress_calls: set[str] = set()  # clients whose GetUploadProgress is waiting for their push to end
        self._progress_lock = threading.Lock()
        # decoding, validating and storing run on these threads, not the RPC's: the updates in memory are
        # bounded by their number, and so are the thread-local caches numpy and torch keep per thread
        self._decoders = futures.ThreadPoolExecutor(settings.max_pushes_in_memory, thread_name_prefix="decode")
        self.spool_dir = settings.spool_dir
        # registrations at once, and as many waiting: a flood of them leaves every other worker to enrolled clients
        n = settings.max_concurrent_registrations
        self._registrations = Gate(n, n)
        self.tarpit = Tarpit(settings.refusal_delay_seconds, settings.refusal_waiters)
        self.settings = settings
        self.push_limit = settings.push_limit
        # the names a push may carry: any tier's (a name's header costs memory even where its tensor is empty)
        fed = settings.federation
        self.push_names = frozenset(n for tier in fed.tiers for n in fed.spec.at_tier(tier).names)
        self.fp16 = settings.federation.fp16
        self.mtls = settings.tls_client_ca is not None
        self._cert_digests: dict[bytes, str] = {}  # PEM → sha256 of its DER
        # (tier, kind, name) → (the tensor object and version it was built from, its serialized frames)
        self._wire_cache: dict[tuple[float, int, str], tuple[Tensor, int, tuple[tuple[bytes, int], ...]]] = {}

    def housekeeping(self) -> None:
        """What must happen even when no call comes (the server's :class:`DeadlineTicker` calls it): kept pushes
        past their lifetime let go of their spool files."""
        self._kept.expire()

    def close(self) -> None:
        """Let go of the kept pushes' spool files, once the server has stopped."""
        self._kept.close()

    def _client(self, context: grpc.ServicerContext) -> ClientInfo:
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        if not values:
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token from Register>'")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed authorization metadata: expected 'Bearer <token>'")
        return self.coordinator.authenticate(token.strip(), self._peer_certificate(context))

    def _peer_certificate(self, context: grpc.ServicerContext) -> str | None:
        """SHA-256 (hex) of the client certificate under mutual TLS; ``None`` without it."""
        if not self.mtls:
            return None
        pems = context.auth_context().get("x509_pem_cert")
        if not pems:
            raise Unauthenticated("mutual TLS: the connection carries no client certificate")
        pem = pems[0]
        digest = self._cert_digests.get(pem)
        if digest is None:
            digest = store.certificate_sha256(pem)
            if len(self._cert_digests) > 4096:  # a bound on memory, not a cache policy: rebuilt on demand
                self._cert_digests.clear()
            self._cert_digests[pem] = digest
        return digest

    @_rpc
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        if not self._registrations.enter():
            raise Unavailable("the aggregator is busy registering other devices: retry the registration shortly")
        try:
            return self._register(request, context)
        finally:
            self._registrations.leave()

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        p = request.profile
        try:
            profile = CapabilityProfile(
                device_name=p.device_name or "unknown",
                compute_macs=p.compute_macs if p.HasField("compute_macs") else None,
                memory_bytes=p.memory_bytes if p.HasField("memory_bytes") else None,
                uplink_bps=p.uplink_bps if p.HasField("uplink_bps") else None,
                downlink_bps=p.downlink_bps if p.HasField("downlink_bps") else None,
                num_samples=p.num_samples,
                preferred_tier=p.preferred_tier if p.HasField("preferred_tier") else None,
            )
        except ValueError as exc:  # NaN, infinite or negative capacities: the caller's mistake
            raise InvalidArgument(f"profile: {exc}") from exc
        name = request.client_name if request.HasField("client_name") else None
        reg = self.coordinator.register(profile, request.enrollment_secret, name, self._peer_certificate(context))
        return pb.RegisterReply(
            client_id=reg.client_id,
            token=reg.token,
            tier=reg.tier,
            model_spec_json=reg.spec_json,
            federation=self.settings.federation_name,
            heartbeat_interval_seconds=self.settings.heartbeat_timeout_seconds / 3,
            **_normalization_fields(self.coordinator.shared.config.normalization),
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        now, current, closed = self.coordinator.heartbeat(self._client(context))
        outcome = _ROUND_OUTCOMES[self.coordinator.round_outcome(request.round)] if request.round else 0
        return pb.HeartbeatReply(
            server_time_unix=now, current_round=current, last_closed_round=closed, round_outcome=outcome
        )

    @_rpc
    def GetTask(self, request: pb.GetTaskRequest, context: grpc.ServicerContext) -> pb.Task:
        client = self._client(context)
        if request.HasField("report"):  # an evaluation sent along: recorded first, or the call fails
            self._record_evaluation(client, request.report)
        wait = request.wait_seconds
        if not (math.isfinite(wait) and wait >= 0):
            raise InvalidArgument(f"GetTaskRequest.wait_seconds must be a finite number of seconds ≥ 0, got {wait}")
        left = context.time_remaining()
        if wait > 0 and left is not None:  # answer before the caller's deadline, with a margin for the reply
            wait = min(wait, left - min(1.0, left / 10))
        task = self.coordinator.get_task(client, wait)
        if isinstance(task, Train):
            strategy = dict(task.strategy_config)
            if task.local:  # no proto field yet: tensors that never leave the client travel in the strategy JSON
                strategy["local_tensors"] = list(task.local)
            return pb.Task(
                train=pb.Task.Train(
                    round=task.round,
                    due_tensors=list(task.due),
                    train_config_json=_json(task.train_config.to_dict()),
                    strategy_config_json=_json(strategy),
                    continue_unsynced=task.continue_unsynced,
                    seed=task.seed,
                    deadline_unix=task.deadline.timestamp(),
                    personal_atoms=task.personal_atoms,
                )
            )
        if isinstance(task, Done):
            return pb.Task(done=pb.Task.Done(reason=task.reason, final_round=task.final_round))
        return pb.Task(wait=pb.Task.Wait(retry_after_seconds=task.retry_after, reason=task.reason))

    def FetchModel(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Streams serialized ``TensorChunkBatch`` messages, packed from cached entries (:meth:`_entries`)."""
        try:
            client = self._client(context)
            tensors = len(self.coordinator.federation.tier_spec(client.tier).tensors)
            if len(request.held) > tensors:  # more than a client can hold: each costs the server a lookup
                raise InvalidArgument(
                    f"FetchRequest.held lists {len(request.held)} versions; a client of tier {client.tier:g} holds at "
                    f"most its model's {tensors} tensors"
                )
            held = {v.name: v.version for v in request.held}
            round_ = self.coordinator.download_round(request.round if request.HasField("round") else None)
            category = "eval_fetch" if request.purpose == pb.FETCH_PURPOSE_EVALUATE else "train_fetch"
            model, control = self.coordinator.fetch(client, held, request.include_server_control)
            if len(request.held_control) > len(control):
                raise InvalidArgument(
                    f"FetchRequest.held_control lists {len(request.held_control)} versions; this fetch's server "
                    f"control has {len(control)} tensors"
                )
            held_control = {v.name: v.version for v in request.held_control}
            control = [(n, t, v) for n, t, v in control if held_control.get(n) != v]
            chunk_bytes = codec.CHUNK_BYTES
            if request.HasField("chunk_bytes"):
                try:
                    chunk_bytes = check_chunk_bytes(request.chunk_bytes)
                except ValueError as exc:
                    raise InvalidArgument(f"FetchRequest.{exc}") from None
            # a tensor the client holds in part (a fetch cut midway through it) goes on where it broke off
            resumed = (
                self._resumed_fetch(client, request.resume, model, control, chunk_bytes)
                if request.HasField("resume")
                else {}
            )
        except Exception as exc:
            if _is_abort(exc):
                raise
            if isinstance(exc, Unauthenticated):
                self.tarpit.refused(context.peer())
            _handle(context, exc, "FetchModel")
        context.send_initial_metadata((STREAM_STARTED,))  # the transfer is under way (fedwire.flow_control)
        sent: dict[str, int] = {}

        def tensor_entries(kind: int, name: str, tensor: Tensor, version: int) -> tuple[tuple[bytes, int], ...]:
            """The tensor's entries from where this fetch starts it; at a chunk size the client asked for,
            built when the stream reaches the tensor and dropped once sent (never a whole model per fetch)."""
            all_of_it = self._entries(client.tier, kind, name, tensor, version, chunk_bytes)
            start = resumed.get((kind, name), 0)
            return all_of_it[start // chunk_bytes :] if start else all_of_it

        def payload(name: str, tensor: Tensor, version: int) -> int:
            """The model tensor's bytes from where this fetch starts it, counted on the shared entries."""
            whole = self._entries(client.tier, pb.TENSOR_KIND_MODEL, name, tensor, version)
            return sum(n for _, n in whole) - resumed.get((pb.TENSOR_KIND_MODEL, name), 0)

        # the model's bytes, offered and sent: a fetch cut midway counts that share of a FedAvg transfer (the
        # control alone, SCAFFOLD's, is none)
        offered = {name: (version, payload(name, t, version)) for name, t, version in model}
        model_sent: dict[str, int] = {}

        def entries() -> Iterator[tuple[bytes, int, tuple[str, bool]]]:
            for kind, tensors in ((pb.TENSOR_KIND_MODEL, model), (pb.TENSOR_KIND_SERVER_CONTROL, control)):
                for name, tensor, version in tensors:
                    for entry, nbytes in tensor_entries(kind, name, tensor, version):
                        yield entry, nbytes, (name, kind == pb.TENSOR_KIND_MODEL)

        try:
            for group in framing.packed(entries(), chunk_bytes):
                for _, nbytes, (name, of_model) in group:  # handed to the transport: sent, unless the call ends first
                    sent[name] = sent.get(name, 0) + nbytes
                    if of_model:
                        model_sent[name] = model_sent.get(name, 0) + nbytes
                yield group[0][0] if len(group) == 1 else b"".join(entry for entry, _, _ in group)
        finally:  # the last message out, or the call cut (gRPC then drops this generator, which closes it)
            total = sum(sent.values())
            try:
                parts = {n: o for (k, n), o in resumed.items() if k == pb.TENSOR_KIND_MODEL}
                fetch = ModelFetch(offered, model_sent, held, parts)
                self.coordinator.record_download(client, total, sent, round_, category, model=fetch)
            except Exception:
                log.exception(kv("record_download_failed", client=client.id, bytes=total))

    def _resumed_fetch(
        self,
        client: ClientInfo,
        resume: pb.TensorResume,
        model: list[tuple[str, Tensor, int]],
        control: list[tuple[str, Tensor, int]],
        chunk_bytes: int,
    ) -> dict[tuple[int, str], int]:
        """``{(kind, name): offset}`` where ``resume`` continues a tensor this fetch sends at the version the
        client holds part of; ``{}`` where that tensor changed since (it goes whole). A request no fetch could
        have left is INVALID_ARGUMENT."""
        kind = resume.kind or pb.TENSOR_KIND_MODEL
        if kind == pb.TENSOR_KIND_MODEL:
            names, tensors = self.coordinator.federation.tier_spec(client.tier).names, model
            if resume.name not in names:
                raise InvalidArgument(
                    f"FetchRequest.resume names {resume.name!r}, which a client of tier {client.tier:g} does not hold"
                )
        elif kind == pb.TENSOR_KIND_SERVER_CONTROL:
            tensors = control
            if resume.name not in {n for n, _, _ in control}:
                raise InvalidArgument(
                    f"FetchRequest.resume names the server control of {resume.name!r}, which this fetch does not send "
                    "(without include_server_control, or held in held_control, or no such tensor)"
                )
        else:
            raise InvalidArgument(
                f"FetchRequest.resume.kind {kind} is neither TENSOR_KIND_MODEL nor TENSOR_KIND_SERVER_CONTROL"
            )
        if resume.offset <= 0 or resume.offset % chunk_bytes:
            raise InvalidArgument(
                f"FetchRequest.resume.offset {resume.offset} is not where a chunk of {resume.name!r} began: "
                f"this fetch cuts tensors in chunks of {chunk_bytes} bytes, a cut fetch resumes at a multiple of that"
            )
        for name, tensor, version in tensors:
            if name == resume.name and version == resume.version:
                total = sum(n for _, n in self._entries(client.tier, kind, name, tensor, version))
                if resume.offset >= total:
                    raise InvalidArgument(
                        f"FetchRequest.resume.offset {resume.offset} is not inside {name!r} at version {version}: "
                        f"its payload is {total} bytes"
                    )
                return {(kind, name): int(resume.offset)}
        return {}

    def _entries(
        self, tier: float, kind: int, name: str, tensor: Tensor, version: int, chunk_bytes: int = codec.CHUNK_BYTES
    ) -> tuple[tuple[bytes, int], ...]:
        """The tensor encoded (fp16 per the federation), cut into ≤ 1 MiB chunks and serialized as
        ``TensorChunkBatch`` entries (:func:`framing.batch_entry`), with their payload sizes: built once
        per version and shared by every fetch. A fetch asking for smaller chunks (a client on a link that
        breaks before 1 MiB arrives) gets its own, built for it alone.

        FetchModel's serializer passes ``bytes`` through (:func:`framing.serialize`), so concurrent and
        repeated fetches send the same bytes (a 1 MiB chunk is its own batch, sent without a copy)
        instead of encoding and serializing the model per fetch. The coordinator hands out the same
        tensor object until its version changes (or a reload rolls it back), so object and version
        together say the entries are current.
        """
        if chunk_bytes != codec.CHUNK_BYTES:
            encoded = codec.encode(tensor, fp16=self.fp16, name=name)
            chunks = codec.iter_chunks(name, encoded, version=version, chunk_bytes=chunk_bytes)
            return tuple((framing.batch_entry(c, kind), len(c.data)) for c in chunks)
        key = (tier, kind, name)
        hit = self._wire_cache.get(key)
        if hit is not None and hit[0] is tensor and hit[1] == version:
            return hit[2]
        encoded = codec.encode(tensor, fp16=self.fp16, name=name)
        entries = tuple(
            (framing.batch_entry(c, kind), len(c.data)) for c in codec.iter_chunks(name, encoded, version=version)
        )
        self._wire_cache[key] = (tensor, version, entries)  # a race only builds the same entries twice
        return entries

    @_rpc
    def PushUpdate(
        self, request_iterator: Iterator[pb.PushMessage | list[framing.Received]], context: grpc.ServicerContext
    ) -> pb.PushReply:
        """Messages arrive as :func:`framing.parse_push_message` gives them: chunks parsed in place, else messages."""
        client = self._client(context)
        self._client_pushes.enter(client.id, context)
        try:
            first = next(request_iterator, None)
            if not isinstance(first, pb.PushMessage) or first.WhichOneof("payload") != "header":
                raise InvalidArgument("the first PushMessage must carry the PushHeader (round, update_id, num_samples)")
            header = first.header
            repeated = self.coordinator.stored_already(client, header.round, header.update_id)
            if repeated is not None:  # its acknowledgement was lost: the rest of the stream is not read
                return _push_reply(repeated)
            if not self._pushes.enter():
                raise Unavailable("the aggregator is receiving other clients' updates: retry the push shortly")
            try:
                # taken only once inside the gate: a resume waiting in line leaves it for GetUploadProgress
                kept = self._resumed(client, header)
                context.send_initial_metadata((STREAM_STARTED,))  # the transfer is under way (fedwire.flow_control)
                result, complete = self._receive(header, client, request_iterator, kept, context)
            finally:
                self._pushes.leave()
        finally:
            self._client_pushes.leave(client.id, context)
        if complete is not None:  # this update completed the round: closed with the update's arrays dropped
            self.coordinator.close_complete(complete)
        return _push_reply(result)

    def _resumed(self, client: ClientInfo, header: pb.PushHeader) -> KeptUpload | None:
        """The kept part of the push a resumed stream continues; a push sent whole drops what was kept."""
        if not header.resume:
            self._kept.drop(client.id)
            return None
        kept = self._kept.take(client.id, header.update_id)
        if kept is None:
            raise Aborted(
                f"nothing is kept of update {header.update_id!r} (expired, dropped for room, or the aggregator "
                "restarted): push it whole, without resume"
            )
        if _header_key(header) != kept.header:
            kept.files.close()  # ABORTED, not INVALID_ARGUMENT: the client pushes whole, rather than drop its update
            raise Aborted(
                f"a resumed push repeats its first attempt's round, num_samples and metrics; update "
                f"{header.update_id!r} was round {kept.header[0]}, num_samples {kept.header[1]}: push it whole, "
                "without resume"
            )
        return kept

    @_rpc
    def GetUploadProgress(self, request: pb.UploadProgressRequest, context: grpc.ServicerContext) -> pb.UploadProgress:
        """Where the client's push of ``update_id`` that broke off resumes; its stream still in flight is ended."""
        client = self._client(context)
        check_header(request.update_id, 1, {})
        with self._progress_lock:  # one at a time per client: each may wait for the client's push to end
            if client.id in self._progress_calls:
                raise Unavailable("this client's GetUploadProgress is already waiting for its push to end: retry")
            self._progress_calls.add(client.id)
        try:
            # the server may not see a cut link for minutes: the client asks because its stream broke, so end it
            self._client_pushes.end(client.id, timeout=10.0)
        finally:
            with self._progress_lock:
                self._progress_calls.discard(client.id)
        kept = self._kept.peek(client.id, request.update_id)
        if kept is None:
            return pb.UploadProgress(kept=False)
        tensors, offset = kept.progress
        return pb.UploadProgress(kept=True, round=kept.header[0], tensors=tensors, offset=offset)

    def _receive(
        self,
        header: pb.PushHeader,
        client: ClientInfo,
        request_iterator: Iterator[Any],
        kept: KeptUpload | None,
        context: grpc.ServicerContext,
    ) -> tuple[PushResult, OpenRound | None]:
        """Receive the update's chunks into spool files (inside the push gate), then decode and store it on a
        decoding thread (their number bounds the updates in memory); the round it completed, if any.

        ``kept``: what an earlier stream of this update delivered; this one continues it. A stream that ends
        under the server leaves what it delivered in :attr:`_kept` for the next one."""
        with contextlib.ExitStack() as files:

            def spool() -> Any:
                return files.enter_context(tempfile.TemporaryFile(prefix="fedatoms-push-", dir=self.spool_dir))

            if kept is not None:
                files.enter_context(kept.files)  # closed with this stream's files, unless kept again
                upload = kept
            else:
                model = codec.Reassembler(max_total_bytes=self.push_limit, spool=spool(), accepted=self.push_names)
                upload = KeptUpload(header.update_id, _header_key(header), model, None, {}, contextlib.ExitStack())
            ended = threading.Event()  # the call is over: cancelled, cut, past its deadline (or answered)
            if not context.add_callback(ended.set):
                ended.set()

            def keep() -> None:
                def save() -> None:
                    upload.files = files.pop_all()
                    self._kept.keep(client.id, upload)

                if self._client_pushes.if_latest(client.id, context, save):  # not replaced by a newer push
                    tensors, offset = upload.progress
                    log.info(
                        kv(
                            "push_kept",
                            client=client.id,
                            update_id=header.update_id,
                            bytes=upload.bytes_received,
                            tensors=tensors,
                            offset=offset,
                        )
                    )

            try:
                for msg in request_iterator:
                    self._add_chunks(upload, msg, spool)
            except grpc.RpcError:
                keep()
                raise
            except (codec.CodecError, InvalidArgument) as exc:
                if kept is None:
                    raise
                raise Aborted(  # the client's tensors differ from the first attempt's (order, encoding): start over
                    f"the resumed push does not continue what is kept of update {header.update_id!r} ({exc}): "
                    "push it whole, without resume"
                ) from exc
            model, control, tensor_bytes = upload.model, upload.control, upload.tensor_bytes
            nbytes = model.bytes_received + (control.bytes_received if control is not None else 0)

            def decode_and_store() -> tuple[PushResult, OpenRound | None]:
                try:
                    tensors = model.finish(allow_nonfinite=True)  # the coordinator names NaN/Inf per tensor
                    deltas = control.finish(allow_nonfinite=True) if control is not None else None
                    if ended.is_set():  # cut, not finished: gRPC ended the stream as if the client had
                        raise _CutStream
                    return self.coordinator.store_update(
                        client,
                        header.round,
                        header.update_id,
                        header.num_samples,
                        dict(header.metrics),
                        tensors,
                        deltas,
                        nbytes=nbytes,
                        tensor_bytes=tensor_bytes,
                    )
                finally:
                    release_free_memory()  # the update's arrays are gone: so are their pages

            try:
                return self._decoders.submit(decode_and_store).result()
            except _CutStream:
                keep()
                raise Aborted("the push stream ended before the update was acknowledged: retry it") from None
            except (codec.CodecError, IncompleteUpdate) as exc:
                # gRPC may end a request stream that was cut or cancelled as if the client had finished it,
                # and mark the call over a moment later: an update refused as incomplete is kept if so
                incomplete = isinstance(exc, IncompleteUpdate) or exc.kind == "truncated"
                if incomplete and ended.wait(CUT_STREAM_GRACE_SECONDS):
                    keep()
                raise

    def _add_chunks(self, upload: KeptUpload, msg: pb.PushMessage | list[framing.Received], spool: Any) -> None:
        """One message's chunks into the update's reassemblers: model tensors, then control deltas."""
        for kind, piece in self._chunks(msg):
            upload.tensor_bytes[piece.name] = upload.tensor_bytes.get(piece.name, 0) + len(piece.data)
            if kind == pb.TENSOR_KIND_MODEL:
                if upload.control is not None:
                    raise InvalidArgument(f"model tensor {piece.name!r} after control deltas: send model tensors first")
                upload.model.add(piece)
            elif kind == pb.TENSOR_KIND_CONTROL_DELTA:
                if upload.control is None:
                    limit = max(0, self.push_limit - upload.model.bytes_received)
                    upload.control = codec.Reassembler(max_total_bytes=limit, spool=spool(), accepted=self.push_names)
                upload.control.add(piece)
            else:
                raise InvalidArgument(
                    f"tensor {piece.name!r}: chunk kind {framing.KIND_NAMES.get(kind, kind)} cannot be "
                    "pushed; use TENSOR_KIND_MODEL or TENSOR_KIND_CONTROL_DELTA"
                )

    @staticmethod
    def _chunks(msg: pb.PushMessage | list[framing.Received]) -> list[framing.Received]:
        if not isinstance(msg, pb.PushMessage):
            return msg
        payload = msg.WhichOneof("payload")
        if payload == "chunk":
            return [(msg.chunk.kind, framing.to_chunk(msg.chunk))]
        if payload == "chunks":
            return [(c.kind, framing.to_chunk(c)) for c in msg.chunks.chunks]
        if payload == "header":
            raise InvalidArgument("PushHeader sent twice: only the first PushMessage carries the header")
        raise InvalidArgument("empty PushMessage: after the header, every message carries chunk or chunks")

    @_rpc
    def ReportEvaluation(self, request: pb.EvaluationReport, context: grpc.ServicerContext) -> pb.EvaluationReply:
        return pb.EvaluationReply(recorded=self._record_evaluation(self._client(context), request))

    def _record_evaluation(self, client: ClientInfo, report: pb.EvaluationReport) -> bool:
        return self.coordinator.report_evaluation(
            client,
            report.round,
            report.global_accuracy,
            report.global_loss,
            report.personalized_accuracy if report.HasField("personalized_accuracy") else None,
            report.num_samples,
        )


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


# --------------------------------------------------------------------------- server


def _credentials(settings: AggregatorSettings) -> grpc.ServerCredentials:
    assert settings.tls_cert is not None and settings.tls_key is not None

    def read(path: Path, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from exc

    pair = (read(settings.tls_key, "tls_key"), read(settings.tls_cert, "tls_cert"))
    ca = read(settings.tls_client_ca, "tls_client_ca") if settings.tls_client_ca is not None else None
    check_tls_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def check_tls_files(cert: Path, key: Path, client_ca: Path | None) -> None:
    """Say which TLS file is wrong, and how, before gRPC is given them: gRPC only fails to bind
    ("Failed to bind …"), which reads as a port in use. Checked with OpenSSL through :mod:`ssl`."""
    import ssl

    def no_password() -> bytes:
        raise ValueError(f"tls_key {key} is encrypted: give the aggregator an unencrypted PEM key")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_verify_locations(cafile=str(cert))
    except ssl.SSLError as exc:
        raise ValueError(f"tls_cert {cert} is not a PEM certificate ({exc.reason or exc})") from exc
    try:
        ctx.load_cert_chain(str(cert), str(key), password=no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"tls_key {key} is not the private key of tls_cert {cert}: they do not match") from exc
        raise ValueError(f"tls_key {key} is not a PEM private key ({exc.reason or exc})") from exc
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(client_ca))
        except ssl.SSLError as exc:
            raise ValueError(
                f"tls_client_ca {client_ca} is not a PEM bundle of CA certificates ({exc.reason or exc})"
            ) from exc


def _add_servicer(servicer: AggregatorServicer, server: grpc.Server) -> None:
    """What ``add_AggregatorServicer_to_server`` does, but with :func:`framing.serialize` for every method,
    PushUpdate's chunks parsed in place, and requests decoded and checked by :mod:`.request_checks`
    (gRPC's own deserializer would answer INTERNAL to bytes that do not parse).

    Built from the service descriptor, so every RPC the proto declares is served (a test checks it).
    """
    service = pb.DESCRIPTOR.services_by_name["Aggregator"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    in_place = {"PushUpdate": framing.parse_push_message}  # megabytes of chunk data are not copied into messages
    handlers = {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            _decoding(
                getattr(servicer, m.name),
                in_place.get(m.name, getattr(pb, m.input_type.name).FromString),
                m.input_type.full_name,
                m.client_streaming,
            ),
            request_deserializer=None,  # bytes: decoded by _decoding
            response_serializer=framing.serialize,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _decoding(behaviour: Callable[..., Any], parse: Callable[[bytes], Any], what: str, streaming: bool) -> Any:
    """``behaviour`` fed decoded, checked requests; a request that fails either is INVALID_ARGUMENT."""

    def checked(data: bytes) -> Any:
        message = request_checks.decode(parse, data, what)
        if isinstance(message, Message):
            request_checks.check_message(message)
        else:  # PushUpdate's chunks, parsed in place: their strings by the same rules
            for _kind, chunk in message:
                request_checks.check_name("chunk.name", chunk.name)
                request_checks.check_name("chunk.dtype", chunk.dtype)
        return message

    if streaming:  # the handler iterates: its errors map as every other refusal does (_rpc)
        return lambda requests, context: behaviour(map(checked, requests), context)

    def unary(data: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = checked(data)
        except InvalidArgument as exc:
            log.debug(kv("rpc_refused", method=what, code="INVALID_ARGUMENT", peer=context.peer(), detail=str(exc)))
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return behaviour(request, context)

    return unary


def build_server(
    settings: AggregatorSettings, coordinator: Coordinator | None = None, *, max_workers: int = 32
) -> tuple[grpc.Server, int, Coordinator]:
    """A bound (not yet started) server: the Aggregator service, health, reflection, limits, TLS.

    Returns ``(server, port, coordinator)``; ``port`` is the bound port (useful with ``:0``).
    """
    coordinator = coordinator or Coordinator.from_settings(settings)
    # held GetTask calls (long polls) and held refusals take at most long_poll_waiters and refusal_waiters
    # threads: the workers stay for the rest
    held = settings.long_poll_waiters + settings.refusal_waiters
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers + held, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # gRPC Python binds with SO_REUSEPORT by default: a second aggregator on the same port would start
            # and silently take half the clients; the port is this server's alone
            ("grpc.so_reuseport", 0),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES),
        ],
    )
    servicer = AggregatorServicer(coordinator, settings, push_waiters=max(1, max_workers // 2))
    _add_servicer(servicer, server)
    server.aggregator_servicer = servicer  # type: ignore[attr-defined]  # for serve(): its housekeeping and close
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.health_servicer = health_servicer  # type: ignore[attr-defined]  # for serve()
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        if settings.tls:
            port = server.add_secure_port(settings.listen, _credentials(settings))
        else:
            port = server.add_insecure_port(settings.listen)
    except RuntimeError as exc:
        raise ValueError(f"cannot listen on {settings.listen}: {exc} (is the port in use?)") from exc
    if port == 0:
        raise ValueError(f"cannot listen on {settings.listen}: the address is in use or not available")
    return server, port, coordinator


class DeadlineTicker(threading.Thread):
    """Calls ``coordinator.tick()``, then ``housekeeping()`` if given, every ``interval`` seconds.

    The housekeeping (:meth:`AggregatorServicer.housekeeping`) runs even when the coordinator's tick fails: it
    needs no database, and spool files must not outlive their hour because the database is away.

    A failing tick (the database away for an hour) is logged with its traceback once per kind of error
    (its exception type: a driver's message often varies with the statement or the attempt); the
    failures after it as one line every ``repeat_log_seconds``, counting them, and the first tick that
    succeeds after them as ``tick_recovered``. Health does not follow a pause: a paused federation is a
    healthy server that must stay reachable, to tell its clients it is paused and to be resumed.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        interval: float = 1.0,
        *,
        housekeeping: Callable[[], None] | None = None,
        repeat_log_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="deadline-ticker", daemon=True)
        self.coordinator, self.interval, self.housekeeping = coordinator, interval, housekeeping
        self.repeat_log_seconds, self.clock = repeat_log_seconds, clock
        self.stopped = threading.Event()
        self.failures = 0  # consecutive failed ticks
        self._traced: set[type] = set()  # exception types logged with their traceback in this run of failures
        self._last_logged = 0.0

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.tick_once()

    def tick_once(self) -> None:
        """One tick, logged as above; a failing housekeeping is a failing tick."""
        try:
            try:
                self.coordinator.tick()
            finally:  # both failing: the housekeeping's error is logged, with the tick's chained to it
                if self.housekeeping is not None:
                    self.housekeeping()
        except Exception as exc:
            self._failed(exc)
            return
        if self.failures:
            log.info(kv("tick_recovered", failures=self.failures))
            self.failures = 0
            self._traced.clear()

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        now = self.clock()
        text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        if type(exc) not in self._traced:  # the first failure of its kind: with its traceback
            log.exception(kv("tick_failed", failures=self.failures, error=text))
            self._traced.add(type(exc))
            self._last_logged = now
        elif now - self._last_logged >= self.repeat_log_seconds:
            log.error(kv("tick_failed", failures=self.failures, error=text))
            self._last_logged = now

    def stop(self) -> None:
        self.stopped.set()


LOCK_CHECK_SECONDS = 5.0  # how often a running aggregator confirms it still holds its federation's lock
SHUTDOWN_STEP_SECONDS = 5.0  # the most a shutdown step that needs the database (the last flush) may take


class LockWatch(threading.Thread):
    """Confirms every ``interval`` seconds that this process still holds its federation's lock
    (:meth:`store.FederationLock.check`), on a thread of its own: a check stuck on a database that hangs never
    holds up the loop that waits for SIGTERM.

    A lock taken again after its session ended (``event=federation_lock_retaken``) reloads the coordinator from
    the database: another aggregator may have held the lock meanwhile and closed, abandoned or opened rounds
    this one's memory knows nothing of. A reload that fails (the database away again) is tried at every check
    until one succeeds. A lock another aggregator took (``event=federation_lock_lost``) sets :attr:`lost` and
    ``stop``: this one must not serve on.
    """

    def __init__(
        self,
        lock: store.FederationLock,
        coordinator: Coordinator,
        stop: threading.Event,
        interval: float = LOCK_CHECK_SECONDS,
    ) -> None:
        super().__init__(name="federation-lock", daemon=True)
        self.lock, self.coordinator, self.stop, self.interval = lock, coordinator, stop, interval
        self.lost = False
        self.reloads = 0  # reloads done after a retake
        self._unreachable = False
        self._reload_pending = False

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.check_once()

    def check_once(self) -> None:
        try:
            retaken = self.lock.check()
            self._unreachable = False
        except store.LockUnconfirmed as exc:  # the database is away (a restart, a failover): wait for it
            if not self._unreachable:
                log.error(kv("database_unreachable", detail=str(exc), hint="serving on; checking every 5 s"))
            self._unreachable = True
            return
        except store.FederationBusy as exc:  # another aggregator serves it now: this one must not
            log.error(kv("federation_lock_lost", detail=str(exc)))
            self.lost = True
            self.stop.set()
            return
        if retaken:
            log.warning(
                kv(
                    "federation_lock_retaken",
                    hint="the database session that held it had ended; reloading the federation from the database",
                )
            )
            self._reload_pending = True
        if self._reload_pending and not self.stop.is_set():
            try:
                self.coordinator.reload()
            except Exception as exc:
                log.error(kv("federation_reload_failed", error=f"{type(exc).__name__}: {exc}", hint="retried"))
                return
            self._reload_pending = False
            self.reloads += 1


def _bounded(step: Callable[[], None], name: str, seconds: float = SHUTDOWN_STEP_SECONDS) -> None:
    """Run a shutdown ``step`` that may need the database for at most ``seconds``: a database that hangs
    must not hold the process (whatever the step did not write, a restart reloads from the store)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except Exception as exc:
            failed.append(exc)

    worker = threading.Thread(target=run, name=f"shutdown-{name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.error(kv("shutdown_step_timed_out", step=name, seconds=seconds, hint="the database does not answer"))
    elif failed:
        log.error(kv("shutdown_step_failed", step=name, error=f"{type(failed[0]).__name__}: {failed[0]}"))


def serve(settings: AggregatorSettings) -> int:
    """Run the aggregator until SIGTERM or SIGINT; returns the process exit code.

    Refuses to start (exit code 1) while another aggregator serves the same federation on the
    same database (:func:`aggregator_service.store.exclusive_federation`).
    """
    configure_logging(log_format=settings.log_format)
    for found in unread_environment():
        log.warning(kv("unread_environment_variable", name=found.name, did_you_mean=found.did_you_mean))
    reuse_message_buffers()
    try:
        with store.exclusive_federation(settings.database_url, settings.federation_name) as lock:
            return _serve(settings, lock)
    except store.FederationBusy as exc:
        log.error(kv("federation_busy", detail=str(exc)))
        return 1
    except (OperationalError, InterfaceError) as exc:  # no server, no such database, credentials refused
        raise unreadable(settings.database_url, exc) from exc


def _serve(settings: AggregatorSettings, lock: store.FederationLock) -> int:
    server, port, coordinator = build_server(settings)
    health_servicer: health.HealthServicer = server.health_servicer  # type: ignore[attr-defined]
    servicer: AggregatorServicer = server.aggregator_servicer  # type: ignore[attr-defined]
    ticker = DeadlineTicker(coordinator, housekeeping=servicer.housekeeping)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info(kv("shutdown_requested", signal=signal.Signals(signum).name))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.enrollment_secret == DEMO_ENROLLMENT_SECRET:
        log.warning(kv("demo_enrollment_secret", hint="set enrollment_secret before anyone else can reach this server"))
    server.start()
    ticker.start()
    log.info(
        kv(
            "serving",
            listen=settings.listen,
            port=port,
            tls=settings.tls,
            mtls=settings.tls_client_ca is not None,
            federation=settings.federation_name,
            database=make_url(settings.database_url).render_as_string(hide_password=True),
        )
    )
    watch = LockWatch(lock, coordinator, stop)
    watch.start()
    while not stop.wait(1.0):  # a timeout: the signal handler runs between waits on every platform
        pass
    health_servicer.enter_graceful_shutdown()  # NOT_SERVING first: nothing below waits for the database
    _bounded(coordinator.shared.stop_waiting, "stop_waiting", 2.0)  # held GetTask calls answer now
    ticker.stop()
    grace = 10
    if not server.stop(grace=grace).wait(grace + 5):
        log.error(kv("shutdown_step_timed_out", step="server_stop", seconds=grace + 5))
    servicer.close()
    _bounded(coordinator.flush, "flush")
    code = 1 if watch.lost else 0
    log.info(kv("stopped"))
    return code


def _normalization_fields(normalization: dict[str, list[float]] | None) -> dict[str, list[float]]:
    """RegisterReply's normalization: the federation's, or none (each client computes its own)."""
    if normalization is None:
        return {}
    return {"normalization_mean": normalization["mean"], "normalization_std": normalization["std"]}
