"""``fedcore.codec.Chunk`` ⇄ ``fedatoms.v1.TensorChunk``: the tensor framing both ends of the wire share.

The aggregator's servicer and the client agent use the same three helpers, so chunking
(≤ 1 MiB of data per message), fp16 transport and the header fields are defined once::

    for msg in tensor_messages("conv1.atoms", tensor, version=3, kind=pb.TENSOR_KIND_MODEL):
        ...                                          # stream out
    reassembler.add(to_chunk(msg))                   # stream in
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fedatoms.v1 import aggregator_pb2 as pb
from fedcore import codec

__all__ = ["KIND_NAMES", "from_chunk", "tensor_messages", "to_chunk"]

KIND_NAMES = {
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
        data=chunk.data,
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
