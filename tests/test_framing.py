"""The in-place wire paths agree with protobuf: batches of chunks, parsed without copying their data."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from google.protobuf.message import DecodeError

from fedcore import codec
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb

RNG = np.random.default_rng(0)
TENSORS = {
    "features.0.atoms": RNG.standard_normal((9, 3, 3), dtype=np.float32),
    "big": RNG.standard_normal(300_000, dtype=np.float32),  # 1.2 MB: two chunks
    "head.bias": np.arange(10, dtype=np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "steps": np.array(7, np.int64),
}


def _chunks(kind: int = pb.TENSOR_KIND_MODEL) -> list[pb.TensorChunk]:
    return [
        framing.from_chunk(c, kind)
        for name, array in TENSORS.items()
        for c in codec.iter_chunks(name, codec.encode(array), version=3)
    ]


def _as_tuple(kind: int, chunk: codec.Chunk) -> tuple:
    return (
        kind,
        chunk.name,
        chunk.dtype,
        chunk.shape,
        chunk.version,
        chunk.offset,
        bytes(chunk.data),
        chunk.total_bytes,
    )


def _expected(chunks: list[pb.TensorChunk]) -> list[tuple]:
    return [_as_tuple(c.kind, framing.to_chunk(c)) for c in chunks]


def test_parse_batch_equals_protobuf_and_keeps_the_data_in_place() -> None:
    chunks = _chunks(pb.TENSOR_KIND_SERVER_CONTROL)
    buf = pb.TensorChunkBatch(chunks=chunks).SerializeToString()
    parsed = framing.parse_batch(buf)
    assert [_as_tuple(k, c) for k, c in parsed] == _expected(chunks)
    for _, chunk in parsed:
        if chunk.data:  # protobuf omits empty bytes: nothing to keep in place
            assert isinstance(chunk.data, memoryview) and chunk.data.obj is buf  # a view, not a copy


def test_unusual_encodings_get_protobufs_answer() -> None:
    first, second = _chunks()[:2]
    # two serialized chunks concatenated are one message with every field twice: the last value wins
    merged = first.SerializeToString() + second.SerializeToString()
    entry = b"\x0a" + _VarintBytes(len(merged)) + merged
    expected = pb.TensorChunkBatch.FromString(entry)
    assert [_as_tuple(k, c) for k, c in framing.parse_batch(entry)] == _expected(list(expected.chunks))
    # an unknown field beside the chunks: protobuf keeps it as unknown and still yields the chunks
    unknown = pb.TensorChunkBatch(chunks=[first]).SerializeToString() + b"\x10\x05"
    assert [_as_tuple(k, c) for k, c in framing.parse_batch(unknown)] == _expected([first])


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_truncated_bytes_are_refused_as_protobuf_refuses_them(cut: int) -> None:
    buf = pb.TensorChunkBatch(chunks=_chunks()[:1]).SerializeToString()
    with pytest.raises(DecodeError):
        framing.parse_batch(buf[:-cut])
    with pytest.raises(DecodeError):
        framing.parse_push_message(
            pb.PushMessage(chunks=pb.TensorChunkBatch(chunks=_chunks()[:1])).SerializeToString()[:-cut]
        )


def test_batch_entries_concatenate_into_one_batch() -> None:
    chunks = [c for name, a in TENSORS.items() for c in codec.iter_chunks(name, codec.encode(a), version=5)]
    entries = [framing.batch_entry(c, pb.TENSOR_KIND_CONTROL_DELTA) for c in chunks]
    batch = pb.TensorChunkBatch.FromString(b"".join(entries))
    assert _expected(list(batch.chunks)) == [_as_tuple(pb.TENSOR_KIND_CONTROL_DELTA, c) for c in chunks]


def test_packed_groups_stay_under_the_limit_in_order() -> None:
    sizes = [10, 500, 600, 1000, 1, 0, 2000, 30]
    entries = [(b"e%d" % i, n, f"t{i}") for i, n in enumerate(sizes)]
    groups = list(framing.packed(entries, limit=1000))
    assert [e for g in groups for e in g] == entries  # every entry, once, in order
    assert all(g for g in groups)
    for g in groups:
        assert sum(n for _, n, _ in g) <= 1000 or len(g) == 1  # only a lone entry may exceed the limit
    assert [[name for _, _, name in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"], ["t7"]]


def test_push_messages_carry_header_then_packed_tensors() -> None:
    header = pb.PushHeader(round=4, update_id="u-1", num_samples=12)
    model = {n: a for n, a in TENSORS.items() if n != "steps"}
    tensors = [(n, a, 0, pb.TENSOR_KIND_MODEL) for n, a in model.items()]
    tensors.append(("big", TENSORS["big"] * 2, 4, pb.TENSOR_KIND_CONTROL_DELTA))
    frames = list(framing.push_messages(header, tensors, fp16=True))
    assert pb.PushMessage.FromString(frames[0]).header == header
    assert framing.parse_push_message(frames[0]) == pb.PushMessage(header=header)
    model_asm, control_asm = codec.Reassembler(), codec.Reassembler()
    for frame in frames[1:]:
        msg = pb.PushMessage.FromString(frame)
        assert msg.WhichOneof("payload") == "chunks"
        assert sum(len(c.data) for c in msg.chunks.chunks) <= codec.CHUNK_BYTES
        parsed = framing.parse_push_message(frame)
        assert [_as_tuple(k, c) for k, c in parsed] == _expected(list(msg.chunks.chunks))
        for kind, chunk in parsed:
            (control_asm if kind == pb.TENSOR_KIND_CONTROL_DELTA else model_asm).add(chunk)
    assert len(frames) - 1 < sum(len(list(codec.iter_chunks(n, codec.encode(a)))) for n, a, _, _ in tensors)
    got = model_asm.finish()
    for name, array in model.items():
        np.testing.assert_array_equal(got[name], array.astype(np.float16))  # fp16 transport
    assert control_asm.versions() == {"big": 4}


def test_parse_push_message_leaves_everything_but_chunks_to_protobuf() -> None:
    chunk = _chunks()[0]
    assert [
        _as_tuple(k, c) for k, c in framing.parse_push_message(pb.PushMessage(chunk=chunk).SerializeToString())
    ] == (_expected([chunk]))
    assert framing.parse_push_message(b"") == pb.PushMessage()
    # header and chunks in one message: the oneof keeps the last, as protobuf decides
    both = (
        pb.PushMessage(header=pb.PushHeader(round=1)).SerializeToString()
        + pb.PushMessage(chunks=pb.TensorChunkBatch(chunks=[chunk])).SerializeToString()
    )
    parsed = framing.parse_push_message(both)
    assert isinstance(parsed, pb.PushMessage) and parsed.WhichOneof("payload") == "chunks"
