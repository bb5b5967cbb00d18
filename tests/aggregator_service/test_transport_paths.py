"""The fast paths of the transport: handler registration, shared FetchModel entries, write-behind last-seen."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from grpc_helpers import SECRET, small_federation

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.coordinator import Coordinator
from aggregator_service.errors import Unauthenticated
from aggregator_service.server import AggregatorServicer, _add_servicer
from fedcore import codec
from fedcore.tiers import CapabilityProfile
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb


class _Recorder:
    """Stands in for ``grpc.Server``: keeps what is registered."""

    def __init__(self) -> None:
        self.registered: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered = handlers


class _Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def coordinator(sqlite_url: str) -> tuple[Coordinator, _Clock]:
    settings = AggregatorSettings(
        listen="127.0.0.1:0", database_url=sqlite_url, enrollment_secret=SECRET, federation=small_federation()
    )
    store.upgrade(sqlite_url)
    clock = _Clock()
    factory = store.session_factory(store.create_engine_for(sqlite_url))
    return Coordinator(settings, factory, clock=clock, enrollment_iterations=1_000), clock


def _last_seen(c: Coordinator, client_id: str) -> datetime:
    with c.factory.begin() as s:
        row = store.get_client(s, client_id)
        assert row is not None
        return row.last_seen


def test_every_rpc_of_the_proto_is_registered_with_its_streaming_kind(coordinator) -> None:
    """The handlers are built from the descriptor, so an RPC added to the proto cannot be left unserved."""
    c, _ = coordinator
    server = _Recorder()
    _add_servicer(AggregatorServicer(c, c.settings), server)  # type: ignore[arg-type]
    methods = pb.DESCRIPTOR.services_by_name["Aggregator"].methods
    assert set(server.registered) == {m.name for m in methods}
    for m in methods:
        h: grpc.RpcMethodHandler = server.registered[m.name]
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming, m.server_streaming)
        assert h.response_serializer is framing.serialize
        # bytes reach the handler, which decodes them itself: gRPC's deserializer would answer INTERNAL to bad bytes
        assert h.request_deserializer is None


def test_serialize_passes_bytes_through() -> None:
    msg = pb.PushReply(accepted=True, round=3)
    assert framing.serialize(msg) == msg.SerializeToString()
    assert framing.serialize(b"\x08\x01") == b"\x08\x01"


def test_fetch_entries_are_built_once_per_version(coordinator) -> None:
    """Repeated fetches reuse the serialized batch entries; a new version rebuilds them."""
    c, _ = coordinator
    servicer = AggregatorServicer(c, c.settings)
    tier = 1.0
    client = _client(c)
    name, tensor, version = c.fetch(client, {})[0][0]
    entries = servicer._entries(tier, pb.TENSOR_KIND_MODEL, name, tensor, version)
    again = c.fetch(client, {})[0][0]  # the coordinator hands out the same tensor until its version changes
    assert again[1] is tensor and servicer._entries(tier, pb.TENSOR_KIND_MODEL, *again) is entries
    asm = codec.Reassembler()
    for entry, nbytes in entries:
        (msg,) = pb.TensorChunkBatch.FromString(entry).chunks  # an entry is a batch of one chunk
        assert msg.kind == pb.TENSOR_KIND_MODEL and len(msg.data) == nbytes
        asm.add(framing.to_chunk(msg))
    assert asm.versions() == {name: version}
    rebuilt = servicer._entries(tier, pb.TENSOR_KIND_MODEL, name, tensor + 1, version + 1)
    assert rebuilt is not entries and pb.TensorChunkBatch.FromString(rebuilt[0][0]).chunks[0].version == version + 1


def _client(c: Coordinator) -> Any:
    reg = c.register(CapabilityProfile(num_samples=10, preferred_tier=1.0), SECRET)
    return c.authenticate(reg.token)


def test_last_seen_refreshes_are_batched_but_never_let_a_client_look_offline(coordinator) -> None:
    """Fresh refreshes wait for a batch; one whose stored time is old is written at once; revocation is immediate."""
    c, clock = coordinator
    a = c.register(CapabilityProfile(num_samples=10, preferred_tier=1.0), SECRET)
    b = c.register(CapabilityProfile(num_samples=10, preferred_tier=1.0), SECRET)
    registered = _last_seen(c, a.client_id)

    clock.now += c.registry.touch_every + timedelta(seconds=1)
    c.authenticate(a.token)  # due, but the stored time is recent: deferred
    assert _last_seen(c, a.client_id) == registered
    first = clock.now

    clock.now += c.registry.TOUCH_BATCH
    c.authenticate(b.token)  # a due refresh finds the batch old enough: both are written
    assert _last_seen(c, a.client_id) == first
    assert _last_seen(c, b.client_id) == clock.now

    clock.now += timedelta(seconds=c.settings.heartbeat_timeout_seconds)
    c.authenticate(a.token)  # stored time half a timeout old: written now, not batched
    assert _last_seen(c, a.client_id) == clock.now

    with c.factory.begin() as s:
        assert store.revoke_client(s, a.client_id)
    with pytest.raises(Unauthenticated, match="revoked"):  # no cached authentication outlives a revocation
        c.authenticate(a.token)


def test_what_is_remembered_per_client_stays_bounded_as_clients_come_and_go(coordinator) -> None:
    """Months of devices enrolling once and never returning leave no per-client memory behind."""
    c, clock = coordinator
    regs = [c.register(CapabilityProfile(num_samples=10 + i, preferred_tier=1.0), SECRET) for i in range(6)]
    for reg in regs:  # each call a little later: a wave of clients that then goes quiet
        c.authenticate(reg.token)
        clock.now += timedelta(seconds=0.1)
    assert len(c.registry._touched) == 6
    clock.now += c.registry.touch_every
    last = c.authenticate(regs[0].token)  # the next refresh forgets those older than the refresh interval
    assert set(c.registry._touched) == {last.id}
    assert _last_seen(c, last.id) <= clock.now

    c.uploads.DECLARED_CACHE = 4  # the registered sample counts, read back whatever was forgotten
    for _ in range(2):
        assert [c.uploads._declared_samples(r.client_id) for r in regs] == [10 + i for i in range(6)]
        assert len(c.uploads._declared) <= 4
