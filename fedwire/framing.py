"""``fedcore.codec.Chunk`` ⇄ ``fedatoms.v1.TensorChunk``: the tensor framing both ends of the wire share.

The aggregator's servicer and the client agent use the same three helpers, so chunking
(≤ 1 MiB of data per message), fp16 transport and the header fields are defined once::

    for msg in tensor_messages("conv1.atoms", tensor, version=3, kind=pb.TENSOR_KIND_MODEL):
        ...                                          # stream out
    reassembler.add(to_chunk(msg))                   # stream in

Chunks travel packed in ``TensorChunkBatch`` messages of up to 1 MiB of data (:func:`packed`),
since gRPC's per-message cost would otherwise dominate a model of many small tensors. Large
payloads are parsed in place: :func:`parse_batch` and :func:`parse_push_message` are the gRPC
deserializers of FetchModel (client side) and PushUpdate (server side). They hand the
Reassembler a memoryview of each chunk's ``data`` field, where protobuf would copy each
megabyte twice (into the message, then out of it as ``bytes``) before it lands in place. On
the way out, :func:`batch_entry` serializes a chunk with one copy of its data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from fedcore import codec
from fedwire.v1 import aggregator_pb2 as pb

__all__ = [
    "KIND_NAMES",
    "Received",
    "batch_entry",
    "fetch_model",
    "from_chunk",
    "packed",
    "parse_batch",
    "parse_push_message",
    "push_messages",
    "push_update",
    "serialize",
    "tensor_messages",
    "to_chunk",
]

Received = tuple[int, codec.Chunk]
"""A parsed ``TensorChunk``: its ``TensorKind`` and the chunk, ``data`` a view of the received bytes."""

_LEN = 2  # protobuf's length-delimited wire type
_DATA = pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].number
_BATCH_CHUNKS = pb.TensorChunkBatch.DESCRIPTOR.fields_by_name["chunks"].number
_PUSH_CHUNK = pb.PushMessage.DESCRIPTOR.fields_by_name["chunk"].number
_PUSH_CHUNKS = pb.PushMessage.DESCRIPTOR.fields_by_name["chunks"].number
_SERVICE = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int) -> bytes:
    """The key of a length-delimited field."""
    return _varint(number << 3 | _LEN)


KIND_NAMES: dict[int, str] = {
    pb.TENSOR_KIND_UNSPECIFIED: "unspecified",
    pb.TENSOR_KIND_MODEL: "model",
    pb.TENSOR_KIND_SERVER_CONTROL: "server_control",
    pb.TENSOR_KIND_CONTROL_DELTA: "control_delta",
}


def to_chunk(msg: pb.TensorChunk) -> codec.Chunk:
    """A received ``TensorChunk`` as a codec chunk (``kind`` is the caller's to route)."""
    return codec.Chunk(msg.name, msg.dtype, tuple(msg.shape), msg.version, msg.offset, msg.data, msg.total_bytes)


def from_chunk(chunk: codec.Chunk, kind: int = pb.TENSOR_KIND_MODEL) -> pb.TensorChunk:
    return pb.TensorChunk(
        name=chunk.name,
        dtype=chunk.dtype,
        shape=list(chunk.shape),
        version=chunk.version,
        offset=chunk.offset,
        data=bytes(chunk.data),  # no copy when it is bytes already
        total_bytes=chunk.total_bytes,
        kind=kind,  # type: ignore[arg-type]
    )


def tensor_messages(
    name: str,
    tensor: Any,
    version: int = 0,
    kind: int = pb.TENSOR_KIND_MODEL,
    *,
    fp16: bool = False,
    chunk_bytes: int = codec.CHUNK_BYTES,
) -> Iterator[pb.TensorChunk]:
    """Encode one tensor (numpy or torch) and yield its ``TensorChunk`` messages."""
    encoded = codec.encode(tensor, fp16=fp16, name=name)
    for chunk in codec.iter_chunks(name, encoded, version=version, chunk_bytes=chunk_bytes):
        yield from_chunk(chunk, kind)


def _fields(view: memoryview) -> list[tuple[int, int, int, int, int]] | None:
    """The top-level fields of an encoded message as ``(number, wire type, tag start, value start, end)``.

    ``None`` for anything this walk does not follow (groups, truncation): the caller then lets
    protobuf's own parser decide, so a malformed message fails exactly as it always did.
    """

    def varint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if pos >= len(view) or shift > 63:
                raise IndexError
            byte = view[pos]
            value |= (byte & 0x7F) << shift
            pos += 1
            if byte < 0x80:
                return value, pos
            shift += 7

    out = []
    pos = 0
    try:
        while pos < len(view):
            tag, start = varint(pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, end = varint(start)
            elif wire_type == 1:
                end = start + 8
            elif wire_type == 5:
                end = start + 4
            elif wire_type == _LEN:
                size, start = varint(start)
                end = start + size
            else:
                return None
            if end > len(view):
                return None
            out.append((number, wire_type, pos, start, end))
            pos = end
    except IndexError:
        return None
    return out


def _parse_chunk(view: memoryview) -> Received:
    """An encoded ``TensorChunk`` with ``data`` left in place; the same result as protobuf's parser.

    The small fields are parsed by protobuf from the message minus its ``data`` field. Only the
    plain encoding (one ``data`` field) takes this path; anything else goes through
    ``FromString`` whole, so protobuf's rules (last value wins, errors) still hold.
    """
    fields = _fields(view)
    data = [f for f in fields if f[0] == _DATA] if fields is not None else []
    if len(data) != 1 or data[0][1] != _LEN:
        msg = pb.TensorChunk.FromString(bytes(view))
        return msg.kind, to_chunk(msg)
    _, _, tag_start, start, end = data[0]
    head = pb.TensorChunk.FromString(bytes(view[:tag_start]) + bytes(view[end:]))
    chunk = codec.Chunk(
        head.name, head.dtype, tuple(head.shape), head.version, head.offset, view[start:end], head.total_bytes
    )
    return head.kind, chunk


def _parse_batch(view: memoryview) -> list[Received] | None:
    fields = _fields(view)
    if fields is None or any(f[:2] != (_BATCH_CHUNKS, _LEN) for f in fields):
        return None
    return [_parse_chunk(view[start:end]) for _, _, _, start, end in fields]


def parse_batch(buf: bytes) -> list[Received]:
    """FetchModel's response deserializer: a ``TensorChunkBatch`` as its chunks, each parsed in place."""
    chunks = _parse_batch(memoryview(buf))
    if chunks is None:  # not the plain encoding: protobuf decides (and raises on garbage)
        return [(c.kind, to_chunk(c)) for c in pb.TensorChunkBatch.FromString(buf).chunks]
    return chunks


def parse_push_message(buf: bytes) -> pb.PushMessage | list[Received]:
    """PushUpdate's request deserializer: chunks (``chunk`` or ``chunks``) parsed in place, else the ``PushMessage``."""
    view = memoryview(buf)
    fields = _fields(view)
    if fields is not None and len(fields) == 1:
        number, wire_type, _, start, end = fields[0]
        if (number, wire_type) == (_PUSH_CHUNK, _LEN):
            return [_parse_chunk(view[start:end])]
        if (number, wire_type) == (_PUSH_CHUNKS, _LEN):
            chunks = _parse_batch(view[start:end])
            if chunks is not None:
                return chunks
    return pb.PushMessage.FromString(buf)


def batch_entry(chunk: codec.Chunk, kind: int = pb.TENSOR_KIND_MODEL) -> bytes:
    """One chunk, serialized as an entry of a ``TensorChunkBatch``; its data is copied once.

    Entries concatenate into a batch (:func:`packed`). Building the message with protobuf would
    copy the data into the message and again when serializing it.
    """
    head = pb.TensorChunk(
        name=chunk.name,
        dtype=chunk.dtype,
        shape=list(chunk.shape),
        version=chunk.version,
        offset=chunk.offset,
        total_bytes=chunk.total_bytes,
        kind=kind,  # type: ignore[arg-type]
    ).SerializeToString()
    size = _varint(len(chunk.data))
    data_key = _key(_DATA)
    body = len(head) + len(data_key) + len(size) + len(chunk.data)
    return b"".join((_key(_BATCH_CHUNKS), _varint(body), head, data_key, size, chunk.data))


_Tag = TypeVar("_Tag")


def packed(
    entries: Iterable[tuple[bytes, int, _Tag]], limit: int = codec.CHUNK_BYTES
) -> Iterator[list[tuple[bytes, int, _Tag]]]:
    """Groups of consecutive ``(batch entry, data bytes, tag)`` (the tag, e.g. the tensor's name, is the caller's):
    a group grows until the next entry would take its data past ``limit``; a group's entries joined are one
    ``TensorChunkBatch``."""
    group: list[tuple[bytes, int, _Tag]] = []
    data = 0
    for entry in entries:
        if group and data + entry[1] > limit:
            yield group
            group, data = [], 0
        group.append(entry)
        data += entry[1]
    if group:
        yield group


def push_messages(
    header: pb.PushHeader,
    tensors: Iterable[tuple[str, Any, int, int]],
    *,
    fp16: bool = False,
    start: tuple[int, int] = (0, 0),
    chunk_bytes: int = codec.CHUNK_BYTES,
) -> Iterator[bytes]:
    """A PushUpdate stream, serialized: the header, then ``(name, tensor, version, kind)`` in chunks of at most
    ``chunk_bytes``, packed in batches of at most that much data.

    ``start``: a resumed push's (tensors the server holds whole, bytes it holds of the next), as
    ``UploadProgress`` gives them: the stream begins there.
    """
    yield pb.PushMessage(header=header).SerializeToString()
    skip, offset = start

    def entries() -> Iterator[tuple[bytes, int, str]]:
        for i, (name, tensor, version, kind) in enumerate(tensors):
            if i < skip:
                continue
            encoded = codec.encode(tensor, fp16=fp16, name=name)
            first = offset if i == skip else 0
            for chunk in codec.iter_chunks(name, encoded, version=version, chunk_bytes=chunk_bytes, start=first):
                yield batch_entry(chunk, kind), len(chunk.data), name

    key = _key(_PUSH_CHUNKS)
    for group in packed(entries(), chunk_bytes):
        entries_ = [entry for entry, _, _ in group]
        yield b"".join((key, _varint(sum(map(len, entries_))), *entries_))


def serialize(message: bytes | Message) -> bytes:
    """Messages, or ``bytes`` already serialized (shared frames, in-place encodings)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def fetch_model(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """FetchModel for ``channel``, yielding each batch's chunks parsed in place (:func:`parse_batch`)."""
    return channel.unary_stream(
        f"/{_SERVICE}/FetchModel",
        request_serializer=pb.FetchRequest.SerializeToString,
        response_deserializer=parse_batch,
    )


def push_update(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """PushUpdate for ``channel`` that takes serialized messages (:func:`push_messages`) as well as ``PushMessage``."""
    return channel.stream_unary(
        f"/{_SERVICE}/PushUpdate", request_serializer=serialize, response_deserializer=pb.PushReply.FromString
    )
