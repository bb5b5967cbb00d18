"""Tensors ⇄ bytes for the wire.

Server and clients run on different machines, numpy/torch versions and possibly byte
orders, so a tensor travels as an explicit ``(dtype name, shape, little-endian C-order
bytes)`` triple rather than a pickle, and everything that arrives is validated before it
can reach an aggregate: a single NaN or a mis-shaped tensor from one client would
otherwise poison the global model for everyone. Tensors are cut into chunks of at most
1 MiB so no gRPC message nears the 4 MiB default limit.

Every rejection is a :class:`CodecError` that names the tensor, so the server can turn it
into an ``INVALID_ARGUMENT`` (or, for ``kind == "too_large"``, ``RESOURCE_EXHAUSTED``)
message a person can act on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHUNK_BYTES",
    "DTYPES",
    "Chunk",
    "CodecError",
    "EncodedTensor",
    "Reassembler",
    "all_finite",
    "as_delivered",
    "decode",
    "encode",
    "encoded_size",
    "iter_chunks",
]

CHUNK_BYTES = 1 << 20
#: Dimensions a tensor may declare: numpy holds at most 64, and no layer has more than a handful.
MAX_DIMS = 32
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)

# Wire name → little-endian numpy dtype. The names are torch's (``str(t.dtype)`` minus ``torch.``).
DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_FLOATS = frozenset({"float16", "float32", "float64"})
_FP16_MAX = float(np.finfo(np.float16).max)


class CodecError(ValueError):
    """A tensor that must not be accepted; ``kind`` is a stable machine-readable category.

    Kinds: ``unsupported_dtype``, ``unknown_dtype``, ``bad_shape``, ``truncated``, ``oversized``,
    ``too_large``, ``shape_mismatch``, ``dtype_mismatch``, ``nonfinite``, ``invalid_bool``,
    ``fp16_overflow``, ``unknown_tensor``, ``duplicate``, ``offset``, ``header_changed``,
    ``empty_chunk``.
    """

    def __init__(self, tensor: str, reason: str, kind: str = "invalid") -> None:
        self.tensor = tensor
        self.reason = reason
        self.kind = kind
        super().__init__(f"tensor {tensor!r}: {reason}")

    def __reduce__(self) -> tuple[type[CodecError], tuple[str, str, str]]:
        """Pickled whole: an error raised in a worker process (``--jobs``, Ray) reaches the parent as itself."""
        return type(self), (self.tensor, self.reason, self.kind)


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor as it travels: wire dtype name, shape and raw little-endian C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Chunk:
    """A piece of one tensor; every chunk repeats the header so a receiver can check it never changes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    version: int
    offset: int
    data: bytes | memoryview  # a memoryview when parsed in place from a received message (fedwire.framing)
    total_bytes: int


def _wire_name(dtype: np.dtype[Any], tensor: str) -> str:
    kind, size = dtype.kind, dtype.itemsize
    for name, wire in DTYPES.items():
        if wire.kind == kind and wire.itemsize == size:
            return name
    raise CodecError(tensor, f"unsupported dtype {dtype.name!r} (supported: {', '.join(DTYPES)})", "unsupported_dtype")


def _as_numpy(array: npt.ArrayLike | torch.Tensor, tensor: str) -> np.ndarray:
    if hasattr(array, "detach") and hasattr(array, "numpy"):  # a torch.Tensor, without importing torch here
        t: Any = array
        try:
            return np.asarray(t.detach().cpu().numpy())
        except TypeError as exc:  # e.g. bfloat16 has no numpy equivalent
            raise CodecError(tensor, f"unsupported dtype {t.dtype} ({exc})", "unsupported_dtype") from exc
    return np.asarray(array)


def as_delivered(tensor: torch.Tensor, fp16: bool) -> torch.Tensor:
    """``tensor`` as the receiver decodes it: rounded through float16 where :func:`encode` would send it so."""
    if not fp16 or str(tensor.dtype) not in ("torch.float32", "torch.float64"):  # without importing torch here
        return tensor
    if str(tensor.dtype) == "torch.float32":
        return tensor.half().to(tensor.dtype)
    # float64: rounded once, as numpy's cast in encode rounds it (torch's goes through float32: twice)
    half = tensor.detach().cpu().numpy().astype(DTYPES["float16"]).astype(np.float64)
    return tensor.new_tensor(half)


def encode(array: npt.ArrayLike | torch.Tensor, *, fp16: bool = False, name: str = "<unnamed>") -> EncodedTensor:
    """Serialize a numpy array or torch tensor; ``fp16`` halves float32/float64 payloads for transport.

    Finiteness is not checked here (the receiver does that), except that ``fp16`` refuses to turn
    finite values beyond float16's range (±65504) into Inf, which the receiver would then reject
    with a misleading message. ``name`` only labels errors.
    """
    arr = _as_numpy(array, name)
    wire = _wire_name(arr.dtype, name)
    if fp16 and wire in ("float32", "float64"):
        with np.errstate(over="ignore"):
            half = arr.astype(DTYPES["float16"])
        if arr.size and float(np.nanmax(np.abs(arr), initial=0.0)) > _FP16_MAX:
            overflow = np.isfinite(arr) & ~np.isfinite(half)
            if overflow.any():
                raise CodecError(
                    name,
                    f"{int(overflow.sum())} finite values exceed the float16 range (±{_FP16_MAX:g}); "
                    "send it without fp16",
                    "fp16_overflow",
                )
        arr, wire = half, "float16"
    le = np.ascontiguousarray(arr, dtype=DTYPES[wire])
    return EncodedTensor(wire, tuple(int(s) for s in arr.shape), le.tobytes(order="C"))


def all_finite(array: np.ndarray) -> bool:
    """No NaN or Inf in ``array`` (true for non-float dtypes).

    NaN and Inf survive a sum, so a finite sum settles it in one pass without ``isfinite``'s
    temporary array; a non-finite sum (NaN/Inf, or finite values that overflow) and float16
    (whose sums overflow easily) take the exact check. Every received model passes here.
    """
    if array.dtype.kind != "f":
        return True
    if array.dtype.itemsize >= 4:
        with np.errstate(over="ignore", invalid="ignore"):
            if math.isfinite(array.sum()):
                return True
    return bool(np.isfinite(array).all())


def encoded_size(shape: tuple[int, ...] | list[int], dtype: str, fp16: bool = False) -> int:
    """Bytes :func:`encode` produces for this shape and dtype, without building the tensor (bandwidth accounting)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if fp16 and dtype in ("float32", "float64"):
        dtype = "float16"
    return math.prod(int(s) for s in shape) * DTYPES[dtype].itemsize


def tensor_encoded_size(tensor: torch.Tensor, fp16: bool = False, name: str = "<unnamed>") -> int:
    """:func:`encoded_size` of a torch tensor: refused as :func:`encode` refuses it where its dtype has no wire
    name; ``name`` only labels that error."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        supported = ", ".join(DTYPES)
        raise CodecError(name, f"unsupported dtype {tensor.dtype} (supported: {supported})", "unsupported_dtype")
    return encoded_size(tuple(tensor.shape), dtype, fp16)


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_header(name: str, dtype: str, shape: tuple[int, ...] | list[int]) -> tuple[tuple[int, ...], int]:
    """Validate dtype and shape; return the shape as a tuple and the byte size it implies."""
    if dtype not in DTYPES:
        raise CodecError(name, f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})", "unknown_dtype")
    try:
        dims = tuple(int(s) for s in shape)
    except (TypeError, ValueError) as exc:
        raise CodecError(name, f"invalid shape {shape!r}", "bad_shape") from exc
    if len(dims) > MAX_DIMS:
        raise CodecError(name, f"invalid shape: {len(dims)} dimensions, at most {MAX_DIMS}", "bad_shape")
    if any(d < 0 for d in dims):
        raise CodecError(name, f"invalid shape {_fmt_shape(dims)}: negative dimension", "bad_shape")
    # an array of these dimensions must be addressable even where one of them is 0 (numpy checks the rest)
    if math.prod(max(d, 1) for d in dims) * DTYPES[dtype].itemsize > _MAX_ARRAY_BYTES:
        raise CodecError(name, f"invalid shape {_fmt_shape(dims)}: no array is this large", "bad_shape")
    return dims, math.prod(dims) * DTYPES[dtype].itemsize


def decode(
    name: str,
    dtype: str,
    shape: tuple[int, ...] | list[int],
    data: bytes | bytearray | memoryview | np.ndarray,
    *,
    expected_shape: tuple[int, ...] | None = None,
    expected_dtype: str | None = None,
    allow_nonfinite: bool = False,
    max_bytes: int | None = None,
    copy: bool = True,
) -> np.ndarray:
    """Validate and deserialize one tensor; returns a writable native-byte-order copy.

    A float16 payload is accepted where float32 or float64 is expected (fp16 transport) and is
    upcast to the expected dtype. ``copy=False`` lets the result share ``data`` when no
    conversion is needed; only for a writable buffer the caller hands over (a 45 MB model is
    otherwise copied once more for nothing).
    """
    dims, size = _check_header(name, dtype, shape)
    if max_bytes is not None and max(size, len(data)) > max_bytes:
        raise CodecError(name, f"too large: {max(size, len(data))} bytes exceeds the limit of {max_bytes}", "too_large")
    if len(data) != size:
        kind = "truncated" if len(data) < size else "oversized"
        raise CodecError(name, f"{kind}: got {len(data)} bytes, shape {_fmt_shape(dims)} {dtype} needs {size}", kind)
    if expected_shape is not None and dims != tuple(expected_shape):
        raise CodecError(
            name,
            f"shape {_fmt_shape(dims)} does not match expected {_fmt_shape(tuple(expected_shape))}",
            "shape_mismatch",
        )
    target = dtype
    if expected_dtype is not None and dtype != expected_dtype:
        if dtype == "float16" and expected_dtype in ("float32", "float64"):
            target = expected_dtype
        else:
            raise CodecError(name, f"dtype {dtype!r} does not match expected {expected_dtype!r}", "dtype_mismatch")
    wire = np.frombuffer(data, dtype=DTYPES[dtype]).reshape(dims)
    if dtype in _FLOATS and not allow_nonfinite and not all_finite(wire):
        raise CodecError(name, "contains NaN or Inf values", "nonfinite")
    if dtype == "bool" and wire.size and np.frombuffer(data, dtype=np.uint8).max() > 1:
        raise CodecError(name, "bool payload holds bytes other than 0 and 1", "invalid_bool")
    return wire.astype(DTYPES[target].newbyteorder("="), copy=copy or not wire.flags.writeable)


def iter_chunks(
    name: str, encoded: EncodedTensor, version: int = 0, chunk_bytes: int = CHUNK_BYTES, start: int = 0
) -> Iterator[Chunk]:
    """Cut one encoded tensor into chunks of at most ``chunk_bytes``; a zero-size tensor is one empty chunk.

    ``start``: the first chunk's offset (a resumed stream sends the rest of a tensor the receiver holds in part).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be ≥ 1, got {chunk_bytes}")
    data, total = encoded.data, len(encoded.data)
    if not 0 <= start < max(total, 1):
        raise ValueError(f"start must be in [0, {total}) for {name!r}, got {start}")
    offset = start
    while True:
        piece = data[offset : offset + chunk_bytes]
        yield Chunk(name, encoded.dtype, encoded.shape, version, offset, piece, total)
        offset += len(piece)
        if offset >= total:
            return


@dataclass
class _Partial:
    name: str
    dtype: str
    shape: tuple[int, ...]
    version: int
    total_bytes: int
    buf: np.ndarray | None  # uint8, preallocated to total_bytes (None when spooled): each chunk copied once, in place
    view: memoryview | None  # of buf: slice assignment from a chunk's bytes or memoryview is one memcpy
    spool_offset: int = 0  # where the tensor's bytes start in the spool file (when spooled)
    filled: int = 0
    chunks: int = 0

    @property
    def complete(self) -> bool:
        return self.filled == self.total_bytes


def _write_all(fd: int | None, data: bytes | memoryview, offset: int) -> None:
    assert fd is not None
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _read_all(fd: int | None, size: int, offset: int) -> np.ndarray:
    assert fd is not None
    buf = np.empty(size, dtype=np.uint8)
    view, done = memoryview(buf), 0  # type: ignore[arg-type]  # a numpy array is a buffer; typeshed's Buffer does not say so
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"spool file ended {size - done} bytes early")
        done += got
    return buf


class Reassembler:
    """Rebuilds a stream of chunks (tensors one after another, each in offset order) into arrays.

    Streams are strictly sequential, so anything else (gaps, overlaps, reordering, interleaving,
    a header that changes, a name sent twice) means a broken or hostile sender and is rejected at
    the first offending chunk, before more bytes are buffered. A chunk carries at most
    ``CHUNK_BYTES`` (the wire's rule; larger ones are ``too_large``). ``max_total_bytes`` bounds the
    memory one message may take; it is checked against each tensor's declared size when the
    tensor starts, so an oversized message is refused before its bytes arrive. ``accepted`` names the
    tensors it may carry, refused at their first chunk otherwise: an empty tensor costs no payload
    byte, but its header costs memory, so the number of names must be bounded too.

    With ``spool`` (a file opened for reading and writing), chunks are written to that file as they
    arrive and read back only by :meth:`finish`: receiving a message then holds one chunk in
    memory, not the message, so a server can receive many slow uploads at once and decode them
    one at a time (page cache is not the process's memory).
    """

    def __init__(
        self, max_total_bytes: int | None = None, spool: BinaryIO | None = None, accepted: Collection[str] | None = None
    ) -> None:
        self.max_total_bytes = max_total_bytes
        self.accepted = accepted
        self._spool = spool.fileno() if spool is not None else None
        self._spool_end = 0
        self._done: dict[str, _Partial] = {}
        self._current: _Partial | None = None
        self._received = 0
        self._declared = 0
        self._handed_over = False  # the first finish() returns arrays over the buffers themselves
        self._resumed: _Partial | None = None  # a tensor an earlier stream broke off in (see :meth:`resume`)

    @property
    def bytes_received(self) -> int:
        """Payload bytes accepted so far (chunk data only, not headers)."""
        return self._received

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names seen so far, in arrival order (the last one may be incomplete)."""
        return tuple(self._done) + ((self._current.name,) if self._current is not None else ())

    @property
    def progress(self) -> tuple[int, int]:
        """Where a stream that broke off resumes: (tensors received whole, bytes received of the next one)."""
        cur = self._current
        if cur is None:
            return len(self._done), 0
        return (len(self._done) + 1, 0) if cur.complete else (len(self._done), cur.filled)

    def _broken_off(self) -> _Partial | None:
        """The tensor received in part (in memory): this stream's last, else the one it was to resume."""
        for part in (self._current, self._resumed):
            if part is not None and 0 < part.filled < part.total_bytes and part.view is not None:
                return part
        return None

    @property
    def part(self) -> tuple[str, int, int] | None:
        """The tensor a stream broke off in, as ``(name, version, bytes received)``: where a retry resumes it."""
        part = self._broken_off()
        return None if part is None else (part.name, part.version, part.filled)

    def resume(self) -> Reassembler:
        """A reassembler for the retry of this stream, which broke off in a tensor (:attr:`part`): the retry's
        first chunk of that tensor continues the bytes received, with the same header at the offset reached, or
        starts it over at offset 0 (the sender holds a newer version of it). Tensors completed here stay here."""
        following = Reassembler(self.max_total_bytes, None, self.accepted)
        part = self._broken_off()
        if part is not None:
            following._resumed = part
            following._declared = part.total_bytes
        return following

    def add(self, chunk: Chunk) -> None:
        cur = self._current
        if cur is None or chunk.name != cur.name:
            cur = self._continued(chunk) or self._start(chunk)
        else:
            header = (chunk.dtype, tuple(chunk.shape), chunk.total_bytes, chunk.version)
            if header != (cur.dtype, cur.shape, cur.total_bytes, cur.version):
                raise CodecError(
                    chunk.name,
                    f"header changed mid-stream: dtype/shape/total_bytes/version {header} after "
                    f"{(cur.dtype, cur.shape, cur.total_bytes, cur.version)}",
                    "header_changed",
                )
            if cur.complete and not chunk.data and chunk.offset == cur.total_bytes:
                raise CodecError(chunk.name, "duplicate chunk after the tensor was complete", "duplicate")
            if chunk.offset != cur.filled:
                raise CodecError(chunk.name, f"chunk at offset {chunk.offset}, expected offset {cur.filled}", "offset")
        n = len(chunk.data)
        if n > CHUNK_BYTES:
            raise CodecError(chunk.name, f"chunk of {n} bytes exceeds the {CHUNK_BYTES}-byte chunk limit", "too_large")
        if not n and cur.total_bytes > 0:
            raise CodecError(chunk.name, f"empty chunk at offset {chunk.offset}", "empty_chunk")
        if cur.filled + n > cur.total_bytes:
            raise CodecError(
                chunk.name,
                f"oversized: chunk at offset {chunk.offset} with {n} bytes runs past total_bytes {cur.total_bytes}",
                "oversized",
            )
        if cur.view is not None:
            cur.view[cur.filled : cur.filled + n] = chunk.data  # same length: an in-place copy, never a resize
        else:
            _write_all(self._spool, chunk.data, cur.spool_offset + cur.filled)
        cur.filled += n
        cur.chunks += 1
        self._received += n

    def _close_current(self, following: str) -> None:
        prev = self._current
        if prev is not None:
            if not prev.complete:
                raise CodecError(
                    prev.name,
                    f"truncated: stream moved on to {following!r} after {prev.filled} of {prev.total_bytes} bytes",
                    "truncated",
                )
            self._done[prev.name] = prev
            self._current = None

    def _continued(self, chunk: Chunk) -> _Partial | None:
        """The resumed tensor (:meth:`resume`) where ``chunk`` continues it; ``None`` (dropping it where ``chunk``
        starts it over) otherwise."""
        part = self._resumed
        if part is None or chunk.name != part.name:
            return None
        self._resumed = None
        if chunk.offset == 0:  # sent whole: a newer version
            self._declared -= part.total_bytes
            return None
        header = (chunk.dtype, tuple(chunk.shape), chunk.total_bytes, chunk.version)
        held = (part.dtype, part.shape, part.total_bytes, part.version)
        if header != held or chunk.offset != part.filled:
            raise CodecError(
                chunk.name,
                f"a resumed tensor goes on at offset {part.filled} with dtype/shape/total_bytes/version {held}, got "
                f"offset {chunk.offset} with {header}",
                "offset",
            )
        self._close_current(chunk.name)
        self._current = part
        return part

    def _start(self, chunk: Chunk) -> _Partial:
        self._close_current(chunk.name)
        if chunk.name in self._done:
            raise CodecError(chunk.name, "duplicate: tensor sent twice in one message", "duplicate")
        if self.accepted is not None and chunk.name not in self.accepted:
            raise CodecError(chunk.name, "unknown tensor: the model has none of this name", "unknown_tensor")
        dims, size = _check_header(chunk.name, chunk.dtype, chunk.shape)
        if chunk.total_bytes != size:
            kind = "truncated" if chunk.total_bytes < size else "oversized"
            raise CodecError(
                chunk.name,
                f"{kind}: total_bytes {chunk.total_bytes} but shape {_fmt_shape(dims)} {chunk.dtype} needs {size}",
                kind,
            )
        if self.max_total_bytes is not None and self._declared + size > self.max_total_bytes:
            raise CodecError(
                chunk.name,
                f"too large: message would reach {self._declared + size} bytes, limit is {self.max_total_bytes}",
                "too_large",
            )
        if chunk.offset != 0:
            raise CodecError(chunk.name, f"first chunk at offset {chunk.offset}, expected offset 0", "offset")
        self._declared += size
        if self._spool is not None:  # the tensor's bytes go to the next free range of the spool file
            self._current = _Partial(chunk.name, chunk.dtype, dims, chunk.version, size, None, None, self._spool_end)
            self._spool_end += size
            return self._current
        # np.empty, not bytearray: pages are only touched as bytes arrive (a declared-but-unsent tensor
        # costs no memory), and numpy asks for huge pages for large buffers, which makes filling a
        # fresh 45 MB model about 5x faster than faulting in a bytearray's 4 KiB pages
        buf = np.empty(size, dtype=np.uint8)
        self._current = _Partial(chunk.name, chunk.dtype, dims, chunk.version, size, buf, buf.data)
        return self._current

    def versions(self) -> dict[str, int]:
        """The version each tensor carried (fetches tag tensors with their global version)."""
        out = {n: p.version for n, p in self._done.items()}
        if self._current is not None:
            out[self._current.name] = self._current.version
        return out

    def finish(
        self,
        expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
        allow_nonfinite: bool = False,
        complete_only: bool = False,
    ) -> dict[str, np.ndarray]:
        """Decode everything received, checking names, shapes and dtypes against ``expected`` when given.

        Only names that arrived are returned: a name in ``expected`` that never arrived is not an
        error here, because which tensors are due is the caller's decision. The first call's
        arrays use the receive buffers in place (no copy); a later call returns fresh copies.
        ``complete_only``: a stream that broke off leaves its last tensor incomplete; it is dropped
        instead of refused (what was completed can still be kept).
        """
        cur = self._current
        if cur is not None and complete_only and not cur.complete:
            self._current = cur = None
        if cur is not None:
            if not cur.complete:
                raise CodecError(
                    cur.name, f"truncated: stream ended after {cur.filled} of {cur.total_bytes} bytes", "truncated"
                )
            self._done[cur.name] = cur
            self._current = None
        out: dict[str, np.ndarray] = {}
        for name, part in self._done.items():
            data, copy = part.buf, self._handed_over
            if data is None:  # spooled: read back into a fresh buffer, which is the array's own
                data, copy = _read_all(self._spool, part.total_bytes, part.spool_offset), False
            exp_shape: tuple[int, ...] | None = None
            exp_dtype: str | None = None
            if expected is not None:
                if name not in expected:
                    raise CodecError(name, "unknown tensor", "unknown_tensor")
                exp_shape, exp_dtype = expected[name]
            out[name] = decode(
                name,
                part.dtype,
                part.shape,
                data,
                expected_shape=exp_shape,
                expected_dtype=exp_dtype,
                allow_nonfinite=allow_nonfinite,
                copy=copy,
            )
        self._handed_over = True
        return out
