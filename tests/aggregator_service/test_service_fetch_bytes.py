"""A fetch cut midway: the ledger counts the bytes it sent, and that share of a FedAvg transfer as its equivalent.

Counted as a whole transfer, a cut fetch and the retry after it were two FedAvg transfers, so plain FedAvg on a bad
link read fewer bytes than FedAvg. The oracles: plain FedAvg's equivalent is its bytes exactly; FedAvg's transfer
of McMahan's CNN is its 1,663,370 fp32 parameters (the paper's count).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_helpers import register, shards, small_federation
from sqlalchemy import select
from support import wait_until

from aggregator_service import store
from fedwire.v1 import aggregator_pb2 as pb

MNIST_CNN_FP32_BYTES = 1_663_370 * 4


def _fetches(url: str) -> dict[str, tuple[int, int]]:
    """client id → (bytes, FedAvg-equivalent bytes) of its ``train_fetch`` transfers, as the database holds them."""
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            t = store.Transfer
            rows = conn.execute(
                select(t.client_id, t.bytes, t.fedavg_equivalent_bytes).where(t.category == "train_fetch")
            ).all()
    finally:
        engine.dispose()
    out: dict[str, tuple[int, int]] = {}
    for client_id, nbytes, fedavg in rows:
        was = out.get(client_id, (0, 0))
        out[client_id] = (was[0] + int(nbytes), was[1] + int(fedavg))
    return out


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
@pytest.mark.parametrize("factorization", ["none", "atoms"])
def test_a_fetch_cut_midway_counts_its_share_of_a_fedavg_transfer(backend, factorization, request, start_service):
    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization=factorization, tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    cut, whole = (register(service.stub, 1.0, d) for d in shards(2))
    assert [c.task().WhichOneof("kind") for c in (cut, whole)] == ["train", "train"]  # round 1: fetches count to it
    model_bytes = whole.fetch()  # the whole model of this federation, received
    stream = cut.stub.FetchModel(pb.FetchRequest(), metadata=cut.auth)
    first = next(stream)  # one message of several (1 MiB each), then the link is gone
    stream.cancel()
    assert first.chunks

    def both_counted() -> bool:
        service.coordinator.flush()  # what the ticker does every second
        return {cut.client_id, whole.client_id} <= _fetches(url).keys()

    assert wait_until(both_counted, 15), _fetches(url)
    counted = _fetches(url)
    assert counted[whole.client_id] == (model_bytes, MNIST_CNN_FP32_BYTES)
    sent, equivalent = counted[cut.client_id]
    assert 0 < sent < model_bytes  # the server stopped sending at the cut
    assert equivalent == round(MNIST_CNN_FP32_BYTES * sent / model_bytes)
    if factorization == "none":
        assert equivalent == sent  # plain FedAvg reads 1.000 against itself, cut or not


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
@pytest.mark.parametrize("factorization", ["none", "atoms"])
def test_a_fetch_cut_and_resumed_by_the_client_counts_what_moved(backend, factorization, request, start_service):
    """The agent's retry after a cut declares the tensors it completed as held, so the server offers only the rest.
    Counted as a whole FedAvg transfer, that retry made plain FedAvg read 0.97× against itself. The first connection
    here is cut after 1 MB of the 6.65 MB model (the convs complete, fc1 does not), the retry completes. The
    oracles: plain FedAvg's FedAvg-equivalent is its bytes; for atoms, the bytes' share of the whole model, of
    1,663,370 fp32 parameters."""
    from links import LinkProxy

    from client_agent.transport import AggregatorClient, Backoff

    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization=factorization, tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    cut, whole = (register(service.stub, 1.0, d) for d in shards(2))
    assert [c.task().WhichOneof("kind") for c in (cut, whole)] == ["train", "train"]
    model_bytes = whole.fetch()
    proxy = LinkProxy(service.port, cut_first_down_after=1_000_000)
    agent = AggregatorClient(proxy.target, backoff=Backoff(base=0.05))
    agent.token = cut.token
    try:
        fetched = agent.fetch(cut.spec, {})
    finally:
        agent.close()
        proxy.close()
    assert proxy.cuts == 1 and fetched.model.keys() == {t.name for t in cut.spec.tensors}

    def both_counted() -> bool:
        service.coordinator.flush()
        return {cut.client_id, whole.client_id} <= _fetches(url).keys()

    assert wait_until(both_counted, 15), _fetches(url)
    sent, equivalent = _fetches(url)[cut.client_id]
    assert model_bytes < sent < 2 * model_bytes  # what the cuts lost was sent again
    if factorization == "none":
        assert equivalent == sent  # 1.000× against itself
    else:
        assert abs(equivalent - MNIST_CNN_FP32_BYTES * sent / model_bytes) <= 3  # each part rounded to the byte


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_fetch_the_server_handed_over_whole_and_a_retry_of_part_of_it_count_what_moved(
    backend, request, start_service
):
    """Socket and proxy buffers can take a whole model before the link is cut: the server saw a complete fetch,
    and the client's retry, holding the tensors that did arrive, was counted as a second whole FedAvg transfer
    for part of the model (plain FedAvg read 1.03× against itself on a bad link). Here the client reads the whole
    stream, then fetches again holding the convs only, as such a client does. The oracle: plain FedAvg's
    FedAvg-equivalent is its bytes."""
    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization="none", tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    lost, other = (register(service.stub, 1.0, d) for d in shards(2))
    assert [c.task().WhichOneof("kind") for c in (lost, other)] == ["train", "train"]
    model_bytes = lost.fetch()
    arrived = [pb.TensorVersion(name=n, version=v) for n, v in lost.state.versions.items() if n.startswith("conv")]
    retried = 0
    for batch in lost.stub.FetchModel(pb.FetchRequest(held=arrived), metadata=lost.auth):
        retried += sum(len(chunk.data) for chunk in batch.chunks)
    assert 0 < retried < model_bytes  # the convs were not sent again

    def counted() -> bool:
        service.coordinator.flush()
        return lost.client_id in _fetches(url)

    assert wait_until(counted, 15)
    assert _fetches(url)[lost.client_id] == (model_bytes + retried, model_bytes + retried)


def _stream(client, request: pb.FetchRequest, messages: int | None = None) -> list[pb.TensorChunk]:
    """The chunks of a fetch, all of them or those of its first ``messages`` messages (then the link is cut)."""
    stream = client.stub.FetchModel(request, metadata=client.auth)
    chunks: list[pb.TensorChunk] = []
    for i, batch in enumerate(stream):
        chunks += batch.chunks
        if messages is not None and i + 1 == messages:
            stream.cancel()
            break
    return chunks


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_fetch_cut_midway_through_a_tensor_resumes_inside_it(backend, request, start_service):
    """McMahan's CNN's fc1 is 6.4 MB, seven 1 MiB chunks: a link that drops every few MB never carries it whole.
    A fetch cut after four of its chunks resumes with FetchRequest.resume at byte 4 MiB of it; fc1 then arrives
    as a clean link's fetch has it, bit for bit, no chunk of it is sent twice, and the ledger counts what moved at
    FedAvg's rate (plain FedAvg: its equivalent is its bytes)."""
    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization="none", tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    cut, whole = (register(service.stub, 1.0, d) for d in shards(2))
    assert [c.task().WhichOneof("kind") for c in (cut, whole)] == ["train", "train"]
    reference = {c.name: c for c in _stream(whole, pb.FetchRequest())}
    # the first attempt, cut after five messages: the small convs, then fc1's first four 1 MiB chunks
    received = _stream(cut, pb.FetchRequest(), messages=5)
    cut_at = 4 * 2**20
    assert (received[-1].name, received[-1].offset + len(received[-1].data)) == ("fc1.weight", cut_at)
    done = [
        pb.TensorVersion(name=c.name, version=c.version) for c in received if c.offset + len(c.data) == c.total_bytes
    ]
    fc1 = reference["fc1.weight"]
    resume = pb.TensorResume(name="fc1.weight", version=fc1.version, offset=cut_at)
    rest = _stream(cut, pb.FetchRequest(held=done, resume=resume))
    assert rest[0].name == "fc1.weight" and rest[0].offset == cut_at  # no byte of fc1 before the cut again
    payload = b"".join(c.data for c in received if c.name == "fc1.weight") + b"".join(
        c.data for c in rest if c.name == "fc1.weight"
    )
    whole_fc1 = b"".join(c.data for c in _stream(whole, pb.FetchRequest()) if c.name == "fc1.weight")
    assert len(payload) == fc1.total_bytes and payload == whole_fc1
    assert {c.name for c in rest} == {c.name for c in reference.values()} - {d.name for d in done}

    def counted() -> bool:
        service.coordinator.flush()
        return cut.client_id in _fetches(url)

    assert wait_until(counted, 15)
    moved, equivalent = _fetches(url)[cut.client_id]
    assert moved == equivalent  # 1.000× against itself: the resumed part counts at FedAvg's rate too
    assert moved >= sum(len(c.data) for c in received) + sum(len(c.data) for c in rest)


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_resume_no_cut_fetch_could_leave_is_refused_and_a_stale_one_gets_the_tensor_whole(
    backend, request, start_service
):
    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization="none", tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    client, _ = (register(service.stub, 1.0, d) for d in shards(2))
    assert client.task().WhichOneof("kind") == "train"
    fc1 = next(c for c in _stream(client, pb.FetchRequest()) if c.name == "fc1.weight")
    refused = {
        "does not hold": pb.TensorResume(name="fc9.weight", version=fc1.version, offset=2**20),
        "is not where a chunk": pb.TensorResume(name="fc1.weight", version=fc1.version, offset=2**20 + 4),
        "is not where a chunk ": pb.TensorResume(name="fc1.weight", version=fc1.version, offset=-(2**20)),
        "is not inside": pb.TensorResume(name="fc1.weight", version=fc1.version, offset=7 * 2**20),
        # FedAvg sends no server control, SCAFFOLD's
        "which this fetch does not send": pb.TensorResume(
            name="fc1.weight", version=fc1.version, offset=2**20, kind=pb.TENSOR_KIND_SERVER_CONTROL
        ),
        "is neither": pb.TensorResume(
            name="fc1.weight", version=fc1.version, offset=2**20, kind=pb.TENSOR_KIND_CONTROL_DELTA
        ),
    }
    for says, resume in refused.items():
        with pytest.raises(grpc.RpcError) as caught:
            _stream(client, pb.FetchRequest(resume=resume))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, says
        assert says.strip() in caught.value.details(), caught.value.details()
    control = [pb.TensorVersion(name="fc1.weight", version=fc1.version)]
    with pytest.raises(grpc.RpcError) as caught:
        _stream(client, pb.FetchRequest(held_control=control, include_server_control=True))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "FetchRequest.held_control lists 1 versions; this fetch's server control has 0" in caught.value.details()
    # a part of another version (a round closed since the cut): the tensor comes whole, from its first byte
    stale = pb.TensorResume(name="fc1.weight", version=fc1.version + 1, offset=2**20)
    again = [c for c in _stream(client, pb.FetchRequest(resume=stale)) if c.name == "fc1.weight"]
    assert again[0].offset == 0 and sum(len(c.data) for c in again) == fc1.total_bytes


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_fetch_asking_for_small_chunks_gets_them_and_resumes_on_their_grid(backend, request, start_service):
    """A client whose link breaks before 1 MiB arrives asks for 16 KiB chunks: every message then carries at most
    16 KiB of data, the tensors are a default fetch's bit for bit, and a cut fetch resumes at a multiple of 16 KiB.
    Sizes that are no power of two from 16 KiB to 1 MiB are refused, as are resumes off the fetch's grid."""
    url = request.getfixturevalue(backend)
    federation = small_federation(model="mnist-cnn", factorization="none", tiers=[1.0])
    service = start_service(url, federation, poll_interval_seconds=0.05)
    client, _ = (register(service.stub, 1.0, d) for d in shards(2))
    assert client.task().WhichOneof("kind") == "train"

    def payloads(chunks: list[pb.TensorChunk]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for c in chunks:
            assert c.offset == len(out.get(c.name, b"")), c.name  # contiguous, in order
            out[c.name] = out.get(c.name, b"") + c.data
        return out

    whole = payloads(_stream(client, pb.FetchRequest()))
    messages = list(client.stub.FetchModel(pb.FetchRequest(chunk_bytes=2**14), metadata=client.auth))
    assert max(sum(len(c.data) for c in m.chunks) for m in messages) <= 2**14
    assert len(messages) >= sum(len(p) for p in whole.values()) // 2**14  # 6.6 MB: hundreds of messages
    assert payloads([c for m in messages for c in m.chunks]) == whole

    fc1 = next(c for m in messages for c in m.chunks if c.name == "fc1.weight")
    resume = pb.TensorResume(name="fc1.weight", version=fc1.version, offset=3 * 2**14)
    resumed = _stream(client, pb.FetchRequest(chunk_bytes=2**14, resume=resume))
    rest = [c for c in resumed if c.name == "fc1.weight"]
    assert rest[0].offset == 3 * 2**14 and b"".join(c.data for c in rest) == whole["fc1.weight"][3 * 2**14 :]
    # the ledger: every byte streamed, and at FedAvg's rate (the resumed offer is the rest of fc1, at any size)
    streamed = 2 * sum(len(p) for p in whole.values()) + sum(len(c.data) for c in resumed)

    def counted() -> bool:
        service.coordinator.flush()
        return _fetches(url).get(client.client_id, (0, 0))[0] >= streamed

    assert wait_until(counted, 15)
    assert _fetches(url)[client.client_id] == (streamed, streamed)

    for size in (0, 1000, 2**13, 3 * 2**14, 2**21, -(2**14)):
        with pytest.raises(grpc.RpcError) as caught:
            _stream(client, pb.FetchRequest(chunk_bytes=size))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, size
        assert "chunk_bytes must be a power of two from 16384 to 1048576" in caught.value.details(), size
    with pytest.raises(grpc.RpcError) as caught:  # 16 KiB in: on the small grid, not on the default's
        _stream(client, pb.FetchRequest(resume=resume))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "this fetch cuts tensors in chunks of 1048576 bytes" in caught.value.details()
