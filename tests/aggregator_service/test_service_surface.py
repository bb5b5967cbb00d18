"""The aggregator's standard gRPC surface over real loopback: reflection, health (which a pause leaves SERVING),
gRPC's own message limit, ReportEvaluation's authentication, and mutual TLS against a foreign CA.

Every refused call must leave the database exactly as it was (:func:`grpc_helpers.snapshot`, plus the
evaluations table, which the snapshot does not cover).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import Client, register, shards, snapshot
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import wait_until

# the TLS fixture and openssl helpers of the operations tests (a fixture imported here is a fixture here)
from test_service_operations import _ca, _register, _signed, pki  # noqa: F401

from aggregator_service import store
from aggregator_service.server import MAX_MESSAGE_BYTES, SERVICE_NAME, DeadlineTicker
from client_agent.transport import channel_options
from fedcore import codec
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
METHODS = {
    # name: (client streaming, server streaming, request type, response type)
    "Register": (False, False, "RegisterRequest", "RegisterReply"),
    "Heartbeat": (False, False, "HeartbeatRequest", "HeartbeatReply"),
    "GetTask": (False, False, "GetTaskRequest", "Task"),
    "FetchModel": (False, True, "FetchRequest", "TensorChunkBatch"),
    "PushUpdate": (True, False, "PushMessage", "PushReply"),
    "GetUploadProgress": (False, False, "UploadProgressRequest", "UploadProgress"),
    "ReportEvaluation": (False, False, "EvaluationReport", "EvaluationReply"),
}


def _evaluations(url: str) -> int:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return int(s.scalar(select(func.count()).select_from(store.Evaluation)) or 0)
    finally:
        engine.dispose()


def _state(url: str) -> dict[str, Any]:
    """The snapshot of a refused call, with the evaluations table counted as well."""
    return {**snapshot(url), "evaluations": _evaluations(url)}


def _rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _health(channel: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _await_health(channel: grpc.Channel, want: int, timeout: float = 4.0) -> None:
    """Poll both health names until each reports ``want``; fail with the last answers after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = {name: _health(channel, name) for name in ("", SERVICE_NAME)}
        if all(status == want for status in got.values()):
            return
        if time.monotonic() > deadline:
            names = {k: health_pb2.HealthCheckResponse.ServingStatus.Name(v) for k, v in got.items()}
            pytest.fail(f"health did not become {health_pb2.HealthCheckResponse.ServingStatus.Name(want)}: {names}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- reflection and health


def test_reflection_lists_the_services_and_resolves_the_aggregator(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    database = ProtoReflectionDescriptorDatabase(svc.channel)
    services = set(database.get_services())
    assert {SERVICE_NAME, HEALTH, reflection.SERVICE_NAME} <= services, services
    assert SERVICE_NAME == "fedatoms.v1.Aggregator" and HEALTH == "grpc.health.v1.Health"

    # a descriptor pool fed only by the server (not by the generated module) resolves the service
    pool = DescriptorPool(database)
    service = pool.FindServiceByName(SERVICE_NAME)
    got = {
        m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name) for m in service.methods
    }
    assert got == METHODS
    for m in service.methods:
        assert m.input_type.full_name == f"fedatoms.v1.{METHODS[m.name][2]}"
    # message types come with their fields: what a generic client (grpcurl) needs to build a push
    push = pool.FindMessageTypeByName("fedatoms.v1.PushMessage")
    assert {f.name for f in push.fields} == {"header", "chunk", "chunks"}
    assert {f.name for f in push.oneofs_by_name["payload"].fields} == {"header", "chunk", "chunks"}
    assert pool.FindServiceByName(HEALTH).methods_by_name["Check"].output_type.full_name == (
        "grpc.health.v1.HealthCheckResponse"
    )
    with pytest.raises(KeyError):
        pool.FindServiceByName("fedatoms.v1.NoSuchService")


def test_health_check_is_serving_without_authorization(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    before = _state(sqlite_url)
    for name in ("", SERVICE_NAME):
        assert _health(svc.channel, name) == SERVING, name  # no metadata at all: probes carry no token
    err = _rpc_error(lambda: _health(svc.channel, "fedatoms.v1.NoSuchService"))
    assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
    # the Aggregator itself still asks for a token on the same channel
    err = _rpc_error(lambda: svc.stub.Heartbeat(pb.HeartbeatRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert _state(sqlite_url) == before


def test_health_stays_serving_while_the_federation_is_paused(start_service, sqlite_url) -> None:
    """Readiness probes ask the health service: NOT_SERVING while paused would take the only aggregator out of
    its Service, and clients could no longer even be told that the federation is paused."""
    svc = start_service(sqlite_url)
    a = register(svc.stub, 1.0, shards(2, 60)[0])
    ticker = DeadlineTicker(svc.coordinator, interval=0.02)
    ticker.start()
    try:
        _await_health(svc.channel, SERVING)
        svc.coordinator.set_paused(True)  # in process
        time.sleep(0.2)  # ten ticks
        _await_health(svc.channel, SERVING, timeout=0)
        assert "paused" in a.task().wait.reason  # reachable, and told why there is no task

        # what the dashboard does from its own process: write the state; the ticker re-reads it
        engine = store.create_engine_for(sqlite_url)
        try:
            for state in ("running", "paused", "running"):
                with store.session_factory(engine).begin() as s:
                    fed = store.get_federation(s, "default")
                    assert fed is not None
                    store.set_federation_state(s, fed, state)
                assert wait_until(lambda state=state: svc.coordinator.state == state)
                _await_health(svc.channel, SERVING, timeout=0)
        finally:
            engine.dispose()
    finally:
        ticker.stop()
        ticker.join(timeout=5)
    assert not ticker.is_alive()


# --------------------------------------------------------------------------- gRPC's message limit


def _push_message_of_size(size: int) -> bytes:
    """A serialized ``PushMessage`` carrying one chunk, exactly ``size`` bytes long."""

    def build(data_bytes: int) -> bytes:
        chunk = pb.TensorChunk(
            name="head.weight",
            dtype="float32",
            shape=[data_bytes // 4],
            data=bytes(data_bytes),
            total_bytes=data_bytes,
            kind=pb.TENSOR_KIND_MODEL,
        )
        return pb.PushMessage(chunk=chunk).SerializeToString()

    data_bytes = size - (len(build(size)) - size)
    for _ in range(8):  # varint lengths shift by a byte near their boundaries
        out = build(data_bytes)
        if len(out) == size:
            return out
        data_bytes += size - len(out)
    raise AssertionError(f"cannot build a PushMessage of {size} bytes")


def test_a_push_message_over_the_server_message_limit_is_refused_by_grpc(start_service, sqlite_url) -> None:
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, _ = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().WhichOneof("kind") == "train"  # round 1 open, ``a`` in its cohort
    options = dict(channel_options())
    assert options["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES  # the agent's own limit, as the server's
    options["grpc.max_send_message_length"] = 4 * MAX_MESSAGE_BYTES  # so the client does not refuse first
    header = pb.PushMessage(header=pb.PushHeader(round=1, update_id=uuid.uuid4().hex, num_samples=10))

    with grpc.insecure_channel(f"127.0.0.1:{svc.port}", options=list(options.items())) as channel:
        push = framing.push_update(channel)

        def send(size: int) -> grpc.RpcError:
            frames = [header.SerializeToString(), _push_message_of_size(size)]
            return _rpc_error(lambda: push(iter(frames), metadata=a.auth, timeout=10))

        before = _state(sqlite_url)
        # one byte over: gRPC refuses the message before the servicer sees it
        err = send(MAX_MESSAGE_BYTES + 1)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "larger than max" in err.details() and str(MAX_MESSAGE_BYTES) in err.details(), err.details()
        assert "chunk limit" not in err.details()
        assert _state(sqlite_url) == before
        # exactly the limit: gRPC delivers it, and the servicer refuses it by its own rule (the push limit)
        assert svc.settings.push_limit < MAX_MESSAGE_BYTES
        err = send(MAX_MESSAGE_BYTES)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert f"limit is {svc.settings.push_limit}" in err.details(), err.details()
        assert "larger than max" not in err.details()
        assert _state(sqlite_url) == before
    # the refusals did not break the round: ``a`` trains and pushes as usual afterwards
    a.fetch()
    push_ = a.train(a.task())
    reply = a.push(1, push_.tensors, num_samples=push_.num_samples, metrics=push_.metrics)
    assert reply.accepted and not reply.duplicate
    assert snapshot(sqlite_url)["updates"] == 1


# --------------------------------------------------------------------------- ReportEvaluation authentication


@pytest.fixture
def closed_round(start_service, sqlite_url) -> Iterator[tuple[Any, Client, Client]]:
    """Round 1 closed: both clients may report their evaluation of it."""
    svc = start_service(sqlite_url)
    data = shards(2, 60)
    a, b = register(svc.stub, 0.25, data[0]), register(svc.stub, 1.0, data[1])
    for c in (a, b):
        _, reply = c.round_trip()
        assert reply.accepted
    assert svc.coordinator.federation.round == 1 and svc.coordinator.open_round is None
    yield svc, a, b


def test_report_evaluation_needs_a_valid_unrevoked_token(closed_round, sqlite_url) -> None:
    svc, a, b = closed_round
    report = pb.EvaluationReport(round=1, global_accuracy=0.5, global_loss=1.25, num_samples=30)
    engine = store.create_engine_for(sqlite_url)
    try:
        with store.session_factory(engine).begin() as s:
            assert store.revoke_client(s, a.client_id)
    finally:
        engine.dispose()
    cases = [
        ("no metadata", (), "missing bearer token"),
        ("unknown token", (("authorization", "Bearer not-a-token"),), "unknown token"),
        ("another client's id as token", (("authorization", f"Bearer {b.client_id}"),), "unknown token"),
        ("revoked token", a.auth, "token revoked"),
    ]
    before = _state(sqlite_url)
    assert before["evaluations"] == 0
    for label, metadata, fragment in cases:
        err = _rpc_error(partial(svc.stub.ReportEvaluation, report, metadata=metadata, timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, f"{label}: {err.code()} {err.details()}"
        assert fragment in err.details(), f"{label}: {err.details()}"
        assert _state(sqlite_url) == before, f"{label}: the database changed"
    # the same report with a valid token is recorded: the refusals were about the token alone
    assert svc.stub.ReportEvaluation(report, metadata=b.auth, timeout=10).recorded
    assert _evaluations(sqlite_url) == 1


# --------------------------------------------------------------------------- mutual TLS


@pytest.fixture
def foreign_pki(pki: Path) -> Path:  # noqa: F811
    """Another CA with the same subject as ``pki``'s, and a client certificate it signed with the same name."""
    d = pki.parent / "foreign"
    d.mkdir()
    _ca(d)  # the same subject as pki's CA
    _signed(d, "client", "clientAuth", None)
    assert (d / "ca.pem").read_bytes() != (pki / "ca.pem").read_bytes()
    return d


def test_mutual_tls_refuses_a_client_certificate_of_another_ca(
    start_service,
    sqlite_url,
    pki: Path,  # noqa: F811
    foreign_pki: Path,
) -> None:
    svc = start_service(
        sqlite_url, tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem"
    )
    target = f"127.0.0.1:{svc.port}"
    root = (pki / "ca.pem").read_bytes()  # the client trusts the server: only its own certificate is foreign

    def creds(d: Path, *, with_ca: bool = False) -> grpc.ChannelCredentials:
        chain = (d / "client.pem").read_bytes() + ((d / "ca.pem").read_bytes() if with_ca else b"")
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=(d / "client.key").read_bytes(), certificate_chain=chain
        )

    before = _state(sqlite_url)
    assert before["clients"] == []
    for chain, foreign in (
        ("leaf", creds(foreign_pki)),
        ("leaf and its CA", creds(foreign_pki, with_ca=True)),  # presenting the foreign CA too changes nothing
    ):
        with grpc.secure_channel(target, foreign) as channel:
            err = _rpc_error(partial(_register, channel))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, f"{chain}: {err.code()} {err.details()}"
            health = _rpc_error(partial(_health, channel, ""))  # not even the unauthenticated probe
            assert health.code() == grpc.StatusCode.UNAVAILABLE, f"{chain}: {health.details()}"
        assert _state(sqlite_url) == before, f"{chain}: the database changed"  # no client registered
    # the certificate of the server's CA, same subject, is accepted on the same server
    with grpc.secure_channel(target, creds(pki)) as channel:
        reply = _register(channel)
    assert [row[0] for row in _state(sqlite_url)["clients"]] == [reply.client_id]


# --------------------------------------------------------------------------- a client that breaks off


def test_a_push_the_client_breaks_off_is_no_server_error(start_service, sqlite_url, caplog) -> None:
    """An edge device on a bad link drops a push half-way: the server stores nothing and logs it as the
    client's doing (``rpc_ended_early``), not as a failure of its own with a traceback (``rpc_failed``)."""
    svc = start_service(sqlite_url)
    a, _ = register(svc.stub, 1.0, shards(2, 60)[0]), register(svc.stub, 1.0, shards(2, 60)[1])
    task = a.task()
    assert task.WhichOneof("kind") == "train"
    a.fetch()
    update = a.train(task).tensors
    before = snapshot(sqlite_url)
    sent_some = threading.Event()
    hold = threading.Event()

    def messages() -> Iterator[pb.PushMessage]:
        header = pb.PushHeader(round=task.train.round, update_id=uuid.uuid4().hex, num_samples=10)
        yield pb.PushMessage(header=header)
        for chunk in codec.iter_chunks("head.weight", codec.encode(update["head.weight"].numpy()), chunk_bytes=256):
            yield pb.PushMessage(chunk=framing.from_chunk(chunk))
            sent_some.set()
            hold.wait(10)  # the link goes quiet after the first chunk

    caplog.set_level(logging.DEBUG, logger="fedatoms.aggregator")
    call = a.stub.PushUpdate.future(messages(), metadata=a.auth, timeout=30)
    try:
        assert sent_some.wait(10)
        time.sleep(0.2)  # the server is now waiting for the next message
        call.cancel()
    finally:
        hold.set()

    def ended() -> bool:
        # the stream's iterator raises (the call is cancelled), or, if the cancellation has not reached the
        # call's state yet, ends as if the client had half-closed: then the update is truncated and refused
        return any(
            "event=rpc_ended_early method=PushUpdate" in r.getMessage()
            or ("event=rpc_refused method=PushUpdate" in r.getMessage() and "truncated" in r.getMessage())
            for r in caplog.records
        )

    assert wait_until(ended), [(r.levelname, r.getMessage()[:300]) for r in caplog.records]
    assert not [r.getMessage() for r in caplog.records if "rpc_failed" in r.getMessage() or r.levelno >= logging.ERROR]
    assert snapshot(sqlite_url) == before
    assert a.round_trip()[1].accepted  # the same client pushes again, whole, and is stored
